"""Model configuration: one validated dataclass for the Llama / Qwen2 / Qwen3 decoder family and
Qwen3's mixture-of-experts form (``qwen3_moe``: every layer's MLP is top-k routed experts).

It is built from (and written back to) a Hugging Face ``config.json`` dict; every error names the
offending field so a user can fix their checkpoint or preset.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from rlax_tasks.utils.validation import check_choice, check_int, check_number, field_error

# HF ``model_type`` -> the HF architecture class name written on save.
SUPPORTED_MODEL_TYPES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
MOE_MODEL_TYPES = ("qwen3_moe",)
# config.json fields of other MoE families' routers that this router does not compute: a
# checkpoint that sets one to anything but the value here is refused, naming the field
_UNSUPPORTED_ROUTER_FIELDS: dict[str, Any] = {
    "scoring_func": "softmax",
    "topk_method": "greedy",
    "n_shared_experts": 0,
    "shared_expert_intermediate_size": 0,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.0,
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
SUPPORTED_DTYPES = ("float32", "bfloat16")


class ModelConfigError(ValueError):
    """A checkpoint's config.json (or a preset) describes a model this package cannot build."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters of a decoder-only transformer (HF naming where it exists)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # None for plain RoPE, else {"rope_type": "linear"|"llama3", "factor": ..., ...}
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    # bias on q/k/v projections (Qwen2 always; Llama/Qwen3 when attention_bias)
    qkv_bias: bool = False
    # bias on the output projection (Llama/Qwen3 when attention_bias)
    o_bias: bool = False
    mlp_bias: bool = False
    # per-head RMSNorm on q and k before RoPE (Qwen3)
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    # mixture of experts (qwen3_moe; 0 = a dense MLP): every layer routes each token to
    # ``num_experts_per_tok`` of ``num_experts`` SwiGLU experts of width ``moe_intermediate_size``,
    # weighted by their softmax router probabilities (renormalised over the k when
    # ``norm_topk_prob``)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    # the load-balancing loss's weight a checkpoint was trained with (kept for save; the trainer's
    # own weight is trainer.router_aux_loss_coef)
    router_aux_loss_coef: float = 0.0

    def __post_init__(self) -> None:
        e = field_error(ModelConfigError)
        check_choice("model_type", self.model_type, sorted(SUPPORTED_MODEL_TYPES), e)
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            check_int(name, getattr(self, name), e, minimum=1)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelConfigError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ModelConfigError(f"head_dim={self.head_dim} must be even for RoPE")
        for name in ("rms_norm_eps", "rope_theta"):
            check_number(name, getattr(self, name), e, low=0, open_low=True)
        if self.rope_scaling is not None:
            _validate_rope_scaling(self.rope_scaling)
        if self.is_moe:
            for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
                check_int(name, getattr(self, name), e, minimum=1)
            if self.num_experts_per_tok > self.num_experts:
                raise ModelConfigError(
                    f"num_experts_per_tok={self.num_experts_per_tok} exceeds num_experts="
                    f"{self.num_experts}"
                )
        elif self.num_experts:
            raise ModelConfigError(
                f"num_experts={self.num_experts} needs a mixture-of-experts model_type "
                f"({', '.join(MOE_MODEL_TYPES)}); model_type={self.model_type!r} is dense"
            )

    @property
    def is_moe(self) -> bool:
        """Whether every layer's MLP is routed experts."""
        return self.model_type in MOE_MODEL_TYPES

    def __hash__(self) -> int:  # rope_scaling is a dict: hash a canonical form instead
        return hash(json.dumps(dataclasses.asdict(self), sort_keys=True))

    @property
    def num_groups(self) -> int:
        """Query heads per key/value head (grouped-query attention)."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """All end-of-sequence ids as a tuple (HF allows an int or a list)."""
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    def num_parameters(self) -> int:
        """Number of parameters (embeddings counted once when tied)."""
        d, f, h, kv, hd = (
            self.hidden_size,
            self.intermediate_size,
            self.num_attention_heads,
            self.num_key_value_heads,
            self.head_dim,
        )
        attn = d * h * hd + 2 * d * kv * hd + h * hd * d
        if self.qkv_bias:
            attn += h * hd + 2 * kv * hd
        if self.o_bias:
            attn += d
        if self.qk_norm:
            attn += 2 * hd
        mlp = 3 * d * f + (2 * f + d if self.mlp_bias else 0)
        if self.is_moe:  # the router; the experts are added below
            mlp = d * self.num_experts
        layer = attn + mlp + 2 * d
        embed = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * layer + embed + d + self.num_expert_parameters()

    def num_expert_parameters(self) -> int:
        """Parameters of the experts' SwiGLU weights, every layer's (0 for a dense model)."""
        if not self.is_moe:
            return 0
        expert = 3 * self.hidden_size * self.moe_intermediate_size
        return self.num_hidden_layers * self.num_experts * expert

    def num_active_parameters(self) -> int:
        """Parameters one token computes with: all but the experts it is not routed to."""
        if not self.is_moe:
            return self.num_parameters()
        idle = self.num_experts - self.num_experts_per_tok
        return self.num_parameters() - self.num_expert_parameters() * idle // self.num_experts

    # ----------------------------------------------------------------- HF config.json
    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Builds the config from an HF config.json dict (transformers v4 or v5 layout)."""
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            archs = cfg.get("architectures")
            raise ModelConfigError(
                f"unsupported architecture: model_type={model_type!r} (architectures={archs!r}); "
                f"supported model types: {sorted(SUPPORTED_MODEL_TYPES)}"
            )
        for key in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        ):
            if key not in cfg:
                raise ModelConfigError(f"config.json has no {key!r} field")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ModelConfigError(f"hidden_act={act!r} is not supported (only 'silu' / SwiGLU)")
        if model_type in ("qwen2", "qwen3") and cfg.get("use_sliding_window", False):
            raise ModelConfigError(
                "use_sliding_window=true is not supported; set it to false (full attention)"
            )
        if cfg.get("pretraining_tp", 1) not in (1, None):
            raise ModelConfigError("pretraining_tp != 1 is not supported")
        moe = _moe_from_hf(cfg) if model_type in MOE_MODEL_TYPES else {}

        rope_theta, rope_scaling = _rope_from_hf(cfg)
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        attention_bias = bool(cfg.get("attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type != "qwen2" and attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)) if model_type == "llama" else False,
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
            pad_token_id=cfg.get("pad_token_id"),
            **moe,
        )

    def to_hf_dict(self, dtype: str = "float32") -> dict[str, Any]:
        """The HF config.json dict for this model, loadable by ``transformers.AutoConfig``."""
        rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope_parameters = {**self.rope_scaling, "rope_theta": self.rope_theta}
        cfg: dict[str, Any] = {
            "architectures": [SUPPORTED_MODEL_TYPES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "hidden_act": "silu",
            # v5 layout, plus the v4 fields so older transformers read it too
            "rope_parameters": rope_parameters,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "dtype": dtype,
            "torch_dtype": dtype,
            "use_cache": True,
        }
        if self.model_type == "llama":
            cfg["attention_bias"] = self.qkv_bias
            cfg["mlp_bias"] = self.mlp_bias
        elif self.model_type in ("qwen3", "qwen3_moe"):
            cfg["attention_bias"] = self.qkv_bias
            cfg["use_sliding_window"] = False
        else:
            cfg["use_sliding_window"] = False
        if self.is_moe:
            cfg.update(
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=self.norm_topk_prob,
                router_aux_loss_coef=self.router_aux_loss_coef,
                decoder_sparse_step=1,
                mlp_only_layers=[],
                output_router_logits=False,
            )
        return cfg


_MOE_SIZES = ("num_experts_per_tok", "moe_intermediate_size")


def _moe_from_hf(cfg: dict[str, Any]) -> dict[str, Any]:
    """The mixture-of-experts fields of a qwen3_moe config.json; a layout or router this model
    cannot compute is one error naming the field."""
    for key, computed in _UNSUPPORTED_ROUTER_FIELDS.items():
        value = cfg.get(key)
        if value is not None and value != computed:
            raise ModelConfigError(
                f"{key}={value!r} is not supported: this router computes {key}={computed!r} "
                "(top-k over a softmax, no shared or grouped experts)"
            )
    if cfg.get("decoder_sparse_step", 1) != 1:
        raise ModelConfigError(
            f"decoder_sparse_step={cfg['decoder_sparse_step']!r} is not supported: every layer "
            "must be a mixture-of-experts layer (decoder_sparse_step 1)"
        )
    if cfg.get("mlp_only_layers"):
        raise ModelConfigError(
            f"mlp_only_layers={cfg['mlp_only_layers']!r} is not supported: every layer must be "
            "a mixture-of-experts layer (mlp_only_layers [])"
        )
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    fields = {"num_experts": experts, **{k: cfg.get(k) for k in _MOE_SIZES}}
    missing = [k for k, v in fields.items() if v is None]
    if missing:
        raise ModelConfigError(f"config.json has no {missing[0]!r} field")
    return {
        "num_experts": experts,
        "num_experts_per_tok": cfg["num_experts_per_tok"],
        "moe_intermediate_size": cfg["moe_intermediate_size"],
        "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
        "router_aux_loss_coef": float(cfg.get("router_aux_loss_coef") or 0.0),
    }


def _rope_from_hf(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling) from v5 ``rope_parameters`` or v4 ``rope_theta``/``rope_scaling``."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        raise ModelConfigError("per-layer-type rope_parameters are not supported")
    scaling = dict(params) if isinstance(params, dict) else dict(cfg.get("rope_scaling") or {})
    theta = scaling.pop("rope_theta", None) or cfg.get("rope_theta") or 10000.0
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if rope_type == "default":
        return float(theta), None
    scaling = {"rope_type": rope_type, **scaling}
    if rope_type == "llama3":
        scaling.setdefault(
            "original_max_position_embeddings",
            cfg.get("original_max_position_embeddings", cfg.get("max_position_embeddings", 4096)),
        )
    _validate_rope_scaling(scaling)
    return float(theta), scaling


def _validate_rope_scaling(scaling: dict[str, Any]) -> None:
    rope_type = scaling.get("rope_type")
    if rope_type not in SUPPORTED_ROPE_TYPES or rope_type == "default":
        raise ModelConfigError(
            f"rope_scaling.rope_type={rope_type!r} is not supported; "
            f"supported: {list(SUPPORTED_ROPE_TYPES)}"
        )
    required = ["factor"]
    if rope_type == "llama3":
        required += ["low_freq_factor", "high_freq_factor", "original_max_position_embeddings"]
    for key in required:
        if key not in scaling:
            raise ModelConfigError(f"rope_scaling ({rope_type}) is missing the field {key!r}")
        if not isinstance(scaling[key], int | float) or scaling[key] <= 0:
            raise ModelConfigError(f"rope_scaling.{key} must be a positive number")
    if rope_type == "llama3" and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise ModelConfigError("rope_scaling.high_freq_factor must exceed low_freq_factor")
