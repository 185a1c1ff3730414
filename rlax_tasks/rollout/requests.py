"""What a caller asks the sampler for (a prompt and its sampling settings) and what comes back."""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Sequence
from typing import Any, Literal

FinishReason = Literal["eos", "stop", "length"]


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request generation settings; ``validate`` names the bad field.

    temperature 0 means greedy. ``top_k`` 0 and ``top_p`` 1.0 switch those filters off. The stop
    set is the model's EOS ids (unless ``ignore_eos``) plus ``stop_token_ids``; the first stop
    token or stop string ends the completion and is kept in it.
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False

    def validate(self, vocab_size: int) -> None:
        """Raises ValueError naming the first invalid field."""
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {self.max_new_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or not 0 <= t < vocab_size:
                raise ValueError(f"stop_token_ids: {t!r} is not a token id in [0, {vocab_size})")
        for s in self.stop_strings:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop_strings: {s!r} must be a non-empty string")

    @property
    def filtering(self) -> bool:
        """Whether top-k/top-p change anything (greedy ignores them)."""
        return self.temperature > 0 and (self.top_k > 0 or self.top_p < 1.0)


@dataclasses.dataclass(frozen=True)
class Request:
    """One completion to generate: ``sample_index`` separates the n samples of one prompt."""

    prompt: tuple[int, ...]
    params: SamplingParams = SamplingParams()
    sample_index: int = 0
    request_id: Any = None

    @classmethod
    def make(
        cls,
        prompt: Sequence[int],
        params: SamplingParams | None = None,
        sample_index: int = 0,
        request_id: Any = None,
    ) -> Request:
        tokens = tuple(int(t) for t in prompt)
        return cls(tokens, params or SamplingParams(), sample_index, request_id)


@dataclasses.dataclass
class Completion:
    """A finished request: generated ``tokens`` (prompt excluded), the log-prob of each under the
    distribution it was sampled from, and why it ended."""

    request: Request
    tokens: list[int]
    logprobs: list[float]
    finish_reason: FinishReason

    @property
    def prompt(self) -> tuple[int, ...]:
        return self.request.prompt


def prompt_seeds(seed: int, count: int) -> list[int]:
    """One seed per prompt, derived from ``seed`` and the prompt's index.

    A seed is per request (the same seed draws the same random numbers whatever shares the
    batch), so prompts given one shared seed would share their random streams: an evaluation
    over many prompts needs a seed per prompt for its samples to be independent.
    """
    return [zlib.crc32(f"{int(seed)}:{i}".encode()) & 0x7FFFFFFF for i in range(count)]


def per_prompt_params(seed: int, count: int, **settings: Any) -> list[SamplingParams]:
    """``count`` SamplingParams with ``settings``, each with its own seed (``prompt_seeds``):
    what a caller passes as ``Sampler.generate(params=...)`` for independent samples."""
    return [SamplingParams(seed=s, **settings) for s in prompt_seeds(seed, count)]
