"""The tiny-arith base model: compact arithmetic format, supervised warm-up, cached HF checkpoint.

path = ensure_base_model("runs/base-models", name="tiny-arith")   # built once, then cached
policy = load_pretrained(path)
evaluate_pass_rates(policy, TinyArith().problems(200, seed=1), n=8, k_list=(1, 8))

The default recipe (2-layer 0.1M-parameter Qwen2, 3000 AdamW steps, ~1 min on 2 cores) trains
with label smoothing over the answer tokens: the base then knows most answers (greedy ~70%) but
samples them diffusely at temperature 1 (pass@1 ~20%, pass@8 ~75%), like a pretrained LLM whose
pass@k far exceeds its pass@1. That gap is what a few minutes of GRPO can close on 2 cores;
without smoothing, the gap is small and RL gained only a few points in 3 minutes (measured).


Names load lazily (``rlax_tasks.utils.lazy_exports``), so importing the package loads none of
its heavy modules."""

from __future__ import annotations

from rlax_tasks.utils.lazy_exports import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "FORMAT_VERSION": ".tiny_arith",
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
