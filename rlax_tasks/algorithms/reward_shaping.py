"""DAPO's soft overlong punishment: a length-dependent reward added to the verifier reward.

R_length(L) = 0 for L ≤ max_len − cache_len, falls linearly to −factor at L = max_len, and is
−factor beyond (Yu et al. 2025, eq. 13, scaled by ``factor``).
"""

from __future__ import annotations

import numpy as np


def overlong_penalty(
    lengths: np.ndarray, max_len: int, cache_len: int, factor: float = 1.0
) -> np.ndarray:
    """Penalty (≤ 0, float64, shape of ``lengths``) for completion lengths in tokens."""
    if not isinstance(max_len, int | np.integer) or max_len <= 0:
        raise ValueError(f"max_len must be a positive integer, got {max_len!r}")
    if not isinstance(cache_len, int | np.integer) or not 0 <= cache_len <= max_len:
        raise ValueError(
            f"cache_len must be an integer in [0, max_len={max_len}], got {cache_len!r}"
        )
    if not np.isfinite(factor) or factor < 0:
        raise ValueError(f"factor must be a finite number >= 0, got {factor!r}")
    lengths = np.asarray(lengths, dtype=np.float64)
    if np.any(lengths < 0):
        raise ValueError("lengths must be >= 0")
    start = max_len - cache_len
    ramp = (start - lengths) / max(cache_len, 1)
    penalty = np.where(lengths <= start, 0.0, np.where(lengths <= max_len, ramp, -1.0))
    return factor * penalty
