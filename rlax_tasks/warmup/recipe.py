"""The warm-up recipe: what base model to build and how, as validated data with a fingerprint.

The fingerprint (hash of every field plus the format/code versions) names the cached model, so a
changed recipe never reuses a model built by another one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from rlax_tasks.data.compact import FORMAT_VERSION
from rlax_tasks.models import ModelConfig
from rlax_tasks.models.tokenizer import char_tokenizer, chat_char_tokenizer
from rlax_tasks.rewards.tasks import ArithmeticTask
from rlax_tasks.utils.validation import check_int, check_known, check_number, field_error
from rlax_tasks.warmup.tiny_arith import DEFAULT_KNOBS, TinyArith
from rlax_tasks.warmup.tool_transcripts import max_episode_tokens

# bump when the warm-up code changes what a recipe produces
RECIPE_VERSION = 1
# what the model is trained to read and write: "compact" ("12+34=" then "46<eos>"), or
# "tool-chat" (calculator episodes in ChatML, rlax_tasks.warmup.tool_transcripts)
FORMATS = ("compact", "tool-chat")


class WarmupRecipeError(ValueError):
    """A warm-up recipe field is invalid; the message names it."""


_error = field_error(WarmupRecipeError)


@dataclasses.dataclass(frozen=True)
class WarmupRecipe:
    """A tiny Qwen2 + char tokenizer, trained supervised on compact arithmetic problems.

    The defaults are the tiny-arith preset's base model: quick to train on CPU, and far more
    often right in 8 samples than in one (held out, temperature 1): the gap GRPO closes."""

    # task difficulty (ArithmeticTask knobs)
    min_digits: int = DEFAULT_KNOBS["min_digits"]
    max_digits: int = DEFAULT_KNOBS["max_digits"]
    num_operands: int = DEFAULT_KNOBS["num_operands"]
    ops: tuple[str, ...] = DEFAULT_KNOBS["ops"]
    # model (Qwen2 family)
    hidden_size: int = 64
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    # mixture of experts (0: the dense Qwen2 MLP): a Qwen3-MoE of ``num_experts`` experts of
    # width ``moe_intermediate_size``, ``num_experts_per_tok`` per token, in every layer
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 64
    # the text format (FORMATS); with "tool-chat", the fraction of warm-up episodes that call
    # the calculator (the others answer directly)
    format: str = "compact"
    tool_fraction: float = 0.5
    # supervised training
    steps: int = 3000
    batch_size: int = 64
    learning_rate: float = 3e-3
    lr_warmup_steps: int = 50
    final_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    # target = (1 - eps) * answer + eps * uniform over answer tokens (digits, '-', <eos>): keeps
    # the base's sampling distribution broad (pass@k >> pass@1), the headroom RL sharpens
    label_smoothing: float = 0.35
    seed: int = 0
    # warm-up problems come from this stream of the task...
    data_seed: int = 1000
    num_train_problems: int = 20_000
    # ...minus every problem of the held-out stream (the preset's eval set) so it stays unseen
    heldout_seed: int | None = 1
    heldout_size: int = 1000

    def __post_init__(self) -> None:
        object.__setattr__(self, "ops", tuple(self.ops))
        for name in (
            "min_digits",
            "max_digits",
            "num_operands",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "steps",
            "batch_size",
            "num_train_problems",
        ):
            check_int(name, getattr(self, name), _error, minimum=1)
        if self.num_experts:
            for name in ("num_experts_per_tok", "moe_intermediate_size"):
                check_int(name, getattr(self, name), _error, minimum=1)
            if self.num_experts_per_tok > self.num_experts:
                raise WarmupRecipeError("num_experts_per_tok must not exceed num_experts")
        for name in ("lr_warmup_steps", "seed", "data_seed", "heldout_size", "num_experts"):
            check_int(name, getattr(self, name), _error, minimum=0)
        check_int("heldout_seed", self.heldout_seed, _error, minimum=0, optional=True)
        if self.heldout_seed is not None and self.heldout_seed == self.data_seed:
            raise WarmupRecipeError("heldout_seed must differ from data_seed")
        for name in ("learning_rate", "max_grad_norm"):
            check_number(name, getattr(self, name), _error, low=0.0, open_low=True)
        check_number("weight_decay", self.weight_decay, _error, low=0.0)
        check_number("final_lr_ratio", self.final_lr_ratio, _error, low=0.0, high=1.0)
        check_number("label_smoothing", self.label_smoothing, _error, low=0.0, high=0.9)
        if self.format not in FORMATS:
            raise WarmupRecipeError(f"format must be one of {', '.join(FORMATS)}, got "
                                    f"{self.format!r}")  # fmt: skip
        check_number("tool_fraction", self.tool_fraction, _error, low=0.0, high=1.0)
        if self.hidden_size % self.num_attention_heads:
            raise WarmupRecipeError(
                f"hidden_size={self.hidden_size} must be a multiple of "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if (self.hidden_size // self.num_attention_heads) % 2:
            raise WarmupRecipeError("hidden_size / num_attention_heads (head_dim) must be even")
        if self.num_attention_heads % self.num_key_value_heads:
            raise WarmupRecipeError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        try:
            self.task()
        except ValueError as exc:
            raise WarmupRecipeError(f"task knobs: {exc}") from exc

    # ------------------------------------------------------------------ derived objects
    def task(self) -> ArithmeticTask:
        """The ArithmeticTask these knobs describe."""
        return ArithmeticTask(
            min_digits=self.min_digits,
            max_digits=self.max_digits,
            num_operands=self.num_operands,
            ops=self.ops,
        )

    def task_format(self) -> TinyArith:
        """The compact prompt/answer format over this recipe's task."""
        return TinyArith(self.task())

    def tokenizer(self) -> Any:
        """The char tokenizer of the format: with ChatML's markers for "tool-chat"."""
        return chat_char_tokenizer() if self.format == "tool-chat" else char_tokenizer()

    def max_tokens(self) -> int:
        """The longest training sequence of this recipe, in tokens."""
        fmt = self.task_format()
        if self.format == "compact":
            return fmt.max_prompt_tokens() + fmt.max_answer_tokens()
        return max_episode_tokens(fmt.max_prompt_tokens(), fmt.max_answer_tokens(),
                                  self.tokenizer())  # fmt: skip

    def model_config(self) -> ModelConfig:
        """The Qwen2 config (vocabulary = the format's char tokenizer's, untied embeddings), or
        with ``num_experts`` the Qwen3-MoE one."""
        tokenizer = self.tokenizer()
        moe = {}
        if self.num_experts:
            moe = dict(model_type="qwen3_moe", qkv_bias=False, qk_norm=True,
                       num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                       moe_intermediate_size=self.moe_intermediate_size,
                       norm_topk_prob=True)  # fmt: skip
        return ModelConfig(**{**dict(
            model_type="qwen2",
            vocab_size=len(tokenizer),
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.hidden_size // self.num_attention_heads,
            max_position_embeddings=max(64, 1 << self.max_tokens().bit_length()),
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
            qkv_bias=True,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        ), **moe})  # fmt: skip

    # ------------------------------------------------------------------ identity
    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly fields (inverse of ``from_dict``)."""
        d = dataclasses.asdict(self)
        d["ops"] = list(self.ops)
        if not self.num_experts:  # a dense recipe's fields (and fingerprint) as before MoE
            for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
                del d[name]
        if self.format == "compact":  # and a compact one's as before the tool-chat format
            del d["format"], d["tool_fraction"]
        return d

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> WarmupRecipe:
        """A recipe from a plain dict; unknown keys raise naming them."""
        known = [f.name for f in dataclasses.fields(cls)]
        check_known(values, known, field_error(WarmupRecipeError, ": "), "warm-up recipe field")
        return cls(**values)

    def fingerprint(self) -> str:
        """12 hex digits identifying what this recipe builds (fields + format/code versions)."""
        payload = {
            "recipe": self.to_dict(),
            "recipe_version": RECIPE_VERSION,
            "format_version": FORMAT_VERSION,
        }
        blob = json.dumps(payload, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


# the recipes a model directory is built by, by its name (model.path's last component; any
# other name: the default, tiny-arith's)
NAMED_RECIPES: dict[str, WarmupRecipe] = {
    "tiny-arith": WarmupRecipe(),
    # the tiny-arith-moe preset's base: 4 experts of width 128, 2 per token (the dense model's
    # MLP width 256 active), over the same task, in half the dense one's steps (its test runs
    # the warm-up in CI)
    "tiny-arith-moe": WarmupRecipe(num_experts=4, num_experts_per_tok=2,
                                   moe_intermediate_size=128, steps=1500),  # fmt: skip
    # the tiny-calc preset's base: ChatML calculator episodes over three operands with *, half
    # with a tool call and half answered directly (docs/design.md §15)
    "tiny-calc": WarmupRecipe(num_operands=3, ops=("+", "-", "*"), format="tool-chat",
                              label_smoothing=0.0, steps=2000, batch_size=32),  # fmt: skip
}


def recipe_for(name: str) -> WarmupRecipe:
    """The recipe that builds the model directory ``name``."""
    return NAMED_RECIPES.get(name, NAMED_RECIPES["tiny-arith"])
