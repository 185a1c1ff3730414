"""The tiny-arith base model: compact arithmetic format, supervised warm-up, cached HF checkpoint.

The warm-up trains with label smoothing, so the base knows most answers but samples them
diffusely (pass@k far above pass@1, like a pretrained LLM): the gap a short GRPO run closes."""

from __future__ import annotations

from rlax_tasks.utils.lazy_exports import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "MARKER": ".base_model",
        "TinyArith": ".tiny_arith",
        "WarmupRecipe": ".recipe",
        "WarmupRecipeError": ".recipe",
        "WarmupStats": ".supervised",
        "base_model_name": ".base_model",
        "encode_text": ".tiny_arith",
        "ensure_base_model": ".base_model",
        "evaluate_pass_rates": ".pass_rates",
        "read_marker": ".base_model",
        "score_pass_rates": ".pass_rates",
        "train_base_policy": ".supervised",
        "training_problems": ".supervised",
    },
)
