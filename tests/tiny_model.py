"""The tests' one tiny model: a random-init Qwen2-shaped ``ModelConfig``, other shapes by keyword.

``tiny_model_config()`` is the default (2 layers, dims divisible by 2 and 8 so fsdp / tensor
really shard); ``shape=`` picks another of ``SHAPES`` and keyword overrides change any field.
The ``tiny_config`` fixture (tests/conftest.py) gives the default.
"""

from __future__ import annotations

from typing import Any

from rlax_tasks.models import ModelConfig, Policy
from rlax_tasks.models.tokenizer import char_tokenizer

# 2 layers, 4 heads of 8, 2 kv heads, hidden 32, MLP 64
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8)  # fmt: skip
SHAPES: dict[str, dict[str, int]] = {
    "small": SMALL,
    # 1 layer, 2 heads of 16, 1 kv head: the cheapest model that decodes
    "one_layer": {**SMALL, "num_hidden_layers": 1, "num_attention_heads": 2,
                  "num_key_value_heads": 1, "head_dim": 16},
    # the tiny-arith preset's shape class: hidden 64, MLP 128, 4 heads of 16
    "wide": {**SMALL, "hidden_size": 64, "intermediate_size": 128, "head_dim": 16},
}  # fmt: skip
# the special token ids of rlax_tasks.models.tokenizer.char_tokenizer
CHAR_TOKEN_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


def tiny_model_config(shape: str = "small", **overrides: Any) -> ModelConfig:
    """A Qwen2 ``ModelConfig`` (vocab 64, q/k/v biases) of ``SHAPES[shape]``, with ``overrides``."""
    fields: dict[str, Any] = dict(model_type="qwen2", vocab_size=64, qkv_bias=True)
    return ModelConfig(**{**fields, **SHAPES[shape], **overrides})


def save_char_model(path: str, shape: str = "one_layer", seed: int = 0, **overrides: Any) -> None:
    """Writes a random tiny model with the character tokenizer to ``path`` (an HF directory)."""
    tok = char_tokenizer()
    config = tiny_model_config(shape, vocab_size=len(tok), **CHAR_TOKEN_IDS, **overrides)
    Policy.init(config, seed=seed, tokenizer=tok).save_pretrained(path)
