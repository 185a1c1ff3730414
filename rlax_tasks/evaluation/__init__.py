"""Evaluation: pass@k (unbiased estimator), maj@k, an evaluator over datasets, reports."""

from rlax_tasks.evaluation.checkpoints import load_model, register_loader, unregister_loader
from rlax_tasks.evaluation.evaluator import EvalConfig, EvalResult, evaluate
from rlax_tasks.evaluation.generation import GenerateFn, PolicyGenerator
from rlax_tasks.evaluation.metrics import maj_at_k, majority_answer, mean_pass_at_k, pass_at_k
from rlax_tasks.evaluation.report import write_eval_outputs

__all__ = [
    "EvalConfig",
    "EvalResult",
    "GenerateFn",
    "PolicyGenerator",
    "evaluate",
    "load_model",
    "maj_at_k",
    "majority_answer",
    "mean_pass_at_k",
    "pass_at_k",
    "register_loader",
    "unregister_loader",
    "write_eval_outputs",
]
