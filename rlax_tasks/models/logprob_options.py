"""The static settings of a per-token log-prob pass, as one hashable object: the policy, the
train step and the reference prefill hand it down to ``forward.token_logprobs`` (a jit static
argument) instead of a keyword each. At the sampling temperature: docs/design.md §5."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class LogProbOptions:
    """How ``forward.token_logprobs`` computes log-probs; none of it changes an array's shape.

    Attributes:
        chunk_size: at most this many positions' logits at a time (``forward.chunked_logprobs``).
        remat: the layers' rematerialisation policy (``transformer.REMAT_POLICIES``).
        keep_logits_bytes: float32 logits up to this size are kept from the forward for the
            backward instead of recomputed.
        temperature: log-probs of softmax(logits / temperature), the distribution a sampler
            drew from.
        replay_routes: a mixture-of-experts model routes tokens with recorded experts through
            them (False: its own routes, only compared with the record; docs/design.md §14).
    """

    chunk_size: int = 128
    remat: str = "none"
    keep_logits_bytes: int = 0
    temperature: float = 1.0
    replay_routes: bool = True

    def __post_init__(self) -> None:
        if not self.chunk_size > 0:
            raise ValueError(f"LogProbOptions.chunk_size must be positive, got {self.chunk_size}")
        if not self.temperature > 0:
            raise ValueError(f"LogProbOptions.temperature must be positive, got {self.temperature}")
        if self.keep_logits_bytes < 0:
            raise ValueError(
                f"LogProbOptions.keep_logits_bytes must be >= 0, got {self.keep_logits_bytes}"
            )


DEFAULT_LOGPROBS = LogProbOptions()  # the defaults, as a signature's default value
