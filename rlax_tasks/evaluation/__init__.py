"""Evaluation: pass@k (unbiased estimator), maj@k, an evaluator over datasets, reports."""

from __future__ import annotations

from rlax_tasks.utils.lazy_exports import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "EvalConfig": ".evaluator",
        "EvalResult": ".evaluator",
        "GenerateFn": ".generation",
        "PolicyGenerator": ".generation",
        "evaluate": ".evaluator",
        "load_model": ".checkpoints",
        "maj_at_k": ".metrics",
        "majority_answer": ".metrics",
        "mean_pass_at_k": ".metrics",
        "pass_at_k": ".metrics",
        "register_loader": ".checkpoints",
        "unregister_loader": ".checkpoints",
        "write_eval_outputs": ".report",
    },
)
