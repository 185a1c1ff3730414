"""A sampler's counters, for progress lines, the worker's status and benchmarks."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class SamplerStats:
    """Counters for progress lines and benchmarks."""

    prefill_calls: int = 0
    decode_calls: int = 0
    generated_tokens: int = 0
    completions: int = 0
    prefilled_tokens: int = 0  # prompt tokens computed by admissions (extensions included)
    extended_tokens: int = 0  # of those, behind a kept cache (an episode's next turn)
    evicted: int = 0  # kept caches given up for a waiting request
    prefill_s: float = 0.0
    decode_s: float = 0.0
    last_swap_s: float | None = None
