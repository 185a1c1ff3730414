"""Random test batches with the awkward cases the objective must handle."""

from __future__ import annotations

import numpy as np

# Non-contiguous groups of different sizes: 4 → rows 0, 2, 5 (+ padding row 9); 9 → 1, 4, 8;
# 2 → 3, 6 (constant rewards: zero advantage); 7 → row 7 alone (singleton).
GROUP_IDS = np.array([4, 9, 4, 2, 9, 4, 2, 7, 9, 4], np.int32)
B, T = len(GROUP_IDS), 12
PADDING_ROW = 9
GAP_ROW = 3  # one masked position inside its completion


def make_batch(
    seed: int = 0, beh_scale: float = 0.5, ratio_scale: float = 0.35
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(logp, batch) float32 with masked tokens, ragged lengths, a padding row, TIS mismatch.

    Rows alternate between a tiny and a large current/old log-ratio, so both clipped and
    unclipped tokens (and GSPO sequences) exist (a large ``ratio_scale`` also gives ratios past
    a dual-clip bound); masked positions hold garbage that must not
    leak into the loss (huge log-ratios there would overflow exp).
    """
    rng = np.random.default_rng(seed)
    mask = np.zeros((B, T), np.float32)
    for i in range(B):
        start = int(rng.integers(2, 5))
        end = int(rng.integers(start + 1, T + 1))
        mask[i, start:end] = 1.0
    mask[GAP_ROW, :] = 0.0
    mask[GAP_ROW, [3, 4, 6, 7, 8]] = 1.0
    mask[PADDING_ROW] = 0.0

    old = rng.normal(-1.5, 0.5, (B, T))
    row_scale = np.where(np.arange(B) % 2 == 0, 1e-5, ratio_scale)[:, None]
    logp = old + row_scale * rng.normal(size=(B, T))
    beh = old + beh_scale * rng.normal(size=(B, T))
    ref = logp + 0.3 * rng.normal(size=(B, T))
    rewards = rng.normal(0.5, 1.0, B)
    rewards[[3, 6]] = 0.7  # a constant group
    values = rng.normal(0.3, 0.5, (B, T))
    values_new = values + rng.normal(0, 0.3, (B, T))

    off = mask == 0
    old[off] = -60.0  # exp(logp − old) would overflow if masked tokens were used
    beh[off] = 40.0
    ref[off] = 55.0
    logp[off] = 0.0
    batch = {
        "old_logprobs": old.astype(np.float32),
        "behavior_logprobs": beh.astype(np.float32),
        "ref_logprobs": ref.astype(np.float32),
        "mask": mask,
        "rewards": rewards.astype(np.float32),
        "group_ids": GROUP_IDS,
        "values": values.astype(np.float32),
    }
    batch["_values_new"] = values_new.astype(np.float32)
    return logp.astype(np.float32), batch


def as64(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The same batch in float64 for the NumPy reference (float32 values, exactly)."""
    return {k: (v.astype(np.float64) if v.dtype == np.float32 else v) for k, v in batch.items()}


def jax_batch(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The batch without test-only keys."""
    return {k: v for k, v in batch.items() if not k.startswith("_")}
