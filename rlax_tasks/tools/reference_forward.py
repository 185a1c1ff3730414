"""A dense Qwen2 forward in NumPy float64, written from the published architecture (RMSNorm,
rotate-half RoPE, grouped-query causal attention with q/k/v biases, SwiGLU): `rlax doctor`'s
reference for the logits its devices compute, sharing no kernel, no JAX and no XLA with them."""

from __future__ import annotations

from typing import Any

import numpy as np

from rlax_tasks.models import ModelConfig


def _leaves(params: Any) -> dict[str, np.ndarray]:
    """{"layers.self_attn.q_proj.kernel": float64 array, ...} of an nnx State (or nested
    mappings of arrays)."""
    out: dict[str, np.ndarray] = {}

    def walk(node: Any, prefix: str) -> None:
        if hasattr(node, "items"):
            for key, child in node.items():
                walk(child, f"{prefix}.{key}" if prefix else str(key))
        else:
            out[prefix] = np.asarray(getattr(node, "value", node), np.float64)

    walk(params, "")
    return out


def _rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def _rope(x: np.ndarray, theta: float) -> np.ndarray:
    """x [T, heads, head_dim] rotated by position (rotate-half convention)."""
    t, _, dim = x.shape
    inv_freq = 1.0 / theta ** (np.arange(0, dim, 2) / dim)
    angles = np.arange(t)[:, None] * inv_freq[None, :]
    cos = np.cos(np.concatenate([angles, angles], -1))[:, None, :]
    sin = np.sin(np.concatenate([angles, angles], -1))[:, None, :]
    half = dim // 2
    return x * cos + np.concatenate([-x[..., half:], x[..., :half]], -1) * sin


def qwen2_logits(config: ModelConfig, params: Any, ids: np.ndarray) -> np.ndarray:
    """The logits [B, T, vocab] of a dense Qwen2 ``config`` (no rope scaling, no MoE, no
    qk-norm) with ``params`` (the Policy's) on token ids [B, T].

    Args:
        config: the model's shapes.
        params: its parameters, as ``Policy.params`` holds them.
        ids: token ids, [batch, time].

    Returns:
        float64 logits.
    """
    if config.rope_scaling or config.num_experts or config.qk_norm:
        raise ValueError("the NumPy reference covers dense Qwen2 without rope scaling only")
    p = _leaves(params)
    group = config.num_attention_heads // config.num_key_value_heads
    out = []
    for row in np.asarray(ids):
        h = p["embed_tokens.embedding"][row]
        t = len(row)
        causal = np.tril(np.ones((t, t), bool))
        for i in range(config.num_hidden_layers):
            layer = {k[len("layers.") :]: v[i] for k, v in p.items() if k.startswith("layers.")}
            x = _rms_norm(h, layer["input_layernorm.weight"], config.rms_norm_eps)
            q, k, v = (
                np.einsum("td,dhe->the", x, layer[f"self_attn.{n}_proj.kernel"])
                + layer[f"self_attn.{n}_proj.bias"]
                for n in "qkv"
            )
            q, k = _rope(q, config.rope_theta), _rope(k, config.rope_theta)
            k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
            scores = np.einsum("qhe,khe->hqk", q, k) / np.sqrt(config.head_dim)
            scores = np.where(causal, scores, -np.inf)
            weights = np.exp(scores - scores.max(-1, keepdims=True))
            weights /= weights.sum(-1, keepdims=True)
            attended = np.einsum("hqk,khe->qhe", weights, v)
            h = h + np.einsum("the,hed->td", attended, layer["self_attn.o_proj.kernel"])
            x = _rms_norm(h, layer["post_attention_layernorm.weight"], config.rms_norm_eps)
            gate = x @ layer["mlp.gate_proj.kernel"]
            up = x @ layer["mlp.up_proj.kernel"]
            h = h + (gate / (1.0 + np.exp(-gate)) * up) @ layer["mlp.down_proj.kernel"]
        h = _rms_norm(h, p["norm.weight"], config.rms_norm_eps)
        head = p["embed_tokens.embedding"].T if config.tie_word_embeddings else p["lm_head.kernel"]
        out.append(h @ head)
    return np.stack(out)
