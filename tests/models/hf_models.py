"""Tiny randomly initialized Hugging Face models, built in-process (no hub), for parity tests."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import transformers

FAMILIES = {
    "llama": transformers.LlamaConfig,
    "qwen2": transformers.Qwen2Config,
    "qwen3": transformers.Qwen3Config,
    "qwen3_moe": transformers.Qwen3MoeConfig,
}
# the mixture-of-experts fields of a tiny qwen3_moe (on top of TINY)
TINY_MOE = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])  # fmt: skip
TINY = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)


def tiny_hf_model(family: str, seed: int = 0, **overrides: Any) -> transformers.PreTrainedModel:
    """A float32 HF causal LM of ``family`` with weights ~N(0, 0.2) (large enough to matter)."""
    torch.manual_seed(seed)
    moe = TINY_MOE if family == "qwen3_moe" else {}
    config = FAMILIES[family](**{**TINY, **moe, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
        for name, p in model.named_parameters():
            if "norm" in name:  # norms near 1, as in trained models
                p.add_(1.0)
    return model.eval()


def hf_logits(model: transformers.PreTrainedModel, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """HF logits with the positions our model uses for padded rows (count of real tokens - 1)."""
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            position_ids=torch.tensor(positions),
        )
    return out.logits.float().numpy()


def left_padded_batch(rng: np.random.Generator, vocab: int, lengths: list[int]) -> tuple:
    """int ids [B, max_len] with each row's tokens right-aligned, and its 0/1 attention mask."""
    t = max(lengths)
    ids = np.zeros((len(lengths), t), np.int64)
    mask = np.zeros((len(lengths), t), np.int64)
    for row, n in enumerate(lengths):
        ids[row, t - n :] = rng.integers(1, vocab, n)
        mask[row, t - n :] = 1
    return ids, mask
