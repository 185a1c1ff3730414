"""The tiny-arith base model: compact arithmetic format, supervised warm-up, cached HF checkpoint.

path = ensure_base_model("runs/base-models", name="tiny-arith")   # built once, then cached
policy = load_pretrained(path)
evaluate_pass_rates(policy, TinyArith().problems(200, seed=1), n=8, k_list=(1, 8))

The default recipe (2-layer 0.1M-parameter Qwen2, 3000 AdamW steps, ~1 min on 2 cores) trains
with label smoothing over the answer tokens: the base then knows most answers (greedy ~70%) but
samples them diffusely at temperature 1 (pass@1 ~20%, pass@8 ~75%), like a pretrained LLM whose
pass@k far exceeds its pass@1. That gap is what a few minutes of GRPO can close on 2 cores;
without smoothing, the gap is small and RL gained only a few points in 3 minutes (measured).
"""

from rlax_tasks.warmup.base_model import MARKER, base_model_name, ensure_base_model, read_marker
from rlax_tasks.warmup.pass_rates import evaluate_pass_rates, score_pass_rates
from rlax_tasks.warmup.recipe import WarmupRecipe, WarmupRecipeError
from rlax_tasks.warmup.supervised import WarmupStats, train_base_policy, training_problems
from rlax_tasks.warmup.tiny_arith import FORMAT_VERSION, TinyArith, encode_text

__all__ = [
    "FORMAT_VERSION",
    "MARKER",
    "TinyArith",
    "WarmupRecipe",
    "WarmupRecipeError",
    "WarmupStats",
    "base_model_name",
    "encode_text",
    "ensure_base_model",
    "evaluate_pass_rates",
    "read_marker",
    "score_pass_rates",
    "train_base_policy",
    "training_problems",
]
