"""The benchmarks' one model: the ~30M-parameter Qwen2 shape, as an HF or an RLAX config.
``hf_config`` (transformers' ``Qwen2Config``, for the torch baselines and saved checkpoints) and
``rlax_config`` (``rlax_tasks.models.ModelConfig``) describe the same model; keyword overrides
change a field (e.g. ``vocab_size``)."""

from __future__ import annotations

from typing import Any

# ~29.6M parameters with tied embeddings (the exact count is computed and printed).
MODEL_SHAPE: dict[str, Any] = dict(
    vocab_size=32000, hidden_size=384, intermediate_size=1536, num_hidden_layers=8,
    num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=True,
)  # fmt: skip


def hf_config(max_position_embeddings: int = 2048, **overrides: Any) -> Any:
    """The model as a ``transformers.Qwen2Config`` (bos 1, eos 2, no sliding window)."""
    from transformers import Qwen2Config

    fields = dict(
        MODEL_SHAPE,
        max_position_embeddings=max_position_embeddings,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        use_sliding_window=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    return Qwen2Config(**{**fields, **overrides})


def rlax_config(max_position_embeddings: int = 2048, **overrides: Any) -> Any:
    """The model as an RLAX ``ModelConfig`` (q/k/v biases, as Qwen2)."""
    from rlax_tasks.models import ModelConfig

    fields = dict(
        MODEL_SHAPE,
        model_type="qwen2",
        head_dim=MODEL_SHAPE["hidden_size"] // MODEL_SHAPE["num_attention_heads"],
        qkv_bias=True,
        max_position_embeddings=max_position_embeddings,
    )
    return ModelConfig(**{**fields, **overrides})
