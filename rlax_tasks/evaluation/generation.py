"""Sampling n completions per prompt text with the rollout Sampler (the one place that calls it).

Curation's pass-rate filter and the evaluator both generate through `sample_completions`, so
a test or another backend can swap in any function with the same signature (`GenerateFn`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rlax_tasks.data.prompts import PromptRenderer, PromptSettings
from rlax_tasks.data.schema import Prompt
from rlax_tasks.rollout.requests import SamplingParams, per_prompt_params
from rlax_tasks.utils.progress_meter import ProgressMeter

logger = logging.getLogger(__name__)

# (prompts, n) -> n completion texts per prompt, prompt-major; a prompt is text or chat messages
GenerateFn = Callable[[Sequence[Prompt], int], list[list[str]]]


def encode_prompts(
    renderer: PromptRenderer, prompts: Sequence[Prompt], max_prompt_tokens: int
) -> tuple[list[list[int] | None], list[str | None]]:
    """(ids, errors) per prompt, rendered by ``renderer``: ids is None and errors says why when
    a prompt cannot be encoded or is longer than ``max_prompt_tokens``."""
    ids: list[list[int] | None] = []
    errors: list[str | None] = []
    for prompt in prompts:
        try:
            tokens = renderer.encode(prompt)
        except ValueError as exc:
            ids.append(None)
            errors.append(str(exc))
            continue
        if len(tokens) > max_prompt_tokens:
            ids.append(None)
            errors.append(
                f"prompt has {len(tokens)} tokens, more than {max_prompt_tokens} "
                "(max_len - max_new_tokens)"
            )
        else:
            ids.append(tokens)
            errors.append(None)
    return ids, errors


def sample_token_ids(
    policy: Any,
    prompt_ids: Sequence[Sequence[int]],
    n: int,
    *,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    max_slots: int = 32,
    max_len: int = 2048,
    sampler: Any = None,
    stop_strings: Sequence[str] = (),
) -> list[list[list[int]]]:
    """n completions (token ids) per tokenized prompt, from `rlax_tasks.rollout.Sampler`
    (a new one for `policy`, or `sampler` when given: it keeps its KV cache between calls);
    logs samples done / total every few seconds (`rlax_tasks.utils.progress_meter`)."""
    # lazy: JAX; curation imports this module for ``GenerateFn`` without sampling
    from rlax_tasks.rollout import Sampler

    if not prompt_ids:
        return []
    if sampler is None:
        sampler = Sampler(policy, max_slots=max_slots, max_len=max_len)
    # a seed per prompt: samples of different prompts are independent
    params = per_prompt_params(
        seed,
        len(prompt_ids),
        max_new_tokens=max_new_tokens,
        temperature=float(temperature),
        stop_strings=tuple(stop_strings),
    )
    meter = ProgressMeter("sampling", len(prompt_ids) * n, logger=logger, unit="samples")
    outs = sampler.generate(
        [list(p) for p in prompt_ids], n=n, params=params, on_complete=lambda _: meter.update()
    )
    meter.finish()
    if len(outs) != len(prompt_ids) * n:
        raise RuntimeError(
            f"sampler returned {len(outs)} completions for {len(prompt_ids)} prompts x n={n}"
        )
    return [[list(outs[p * n + s].tokens) for s in range(n)] for p in range(len(prompt_ids))]


@dataclass
class PolicySampling:
    """What an evaluation samples with: ``policy`` and the sampler's settings (per-row seeds
    from ``seed``), and one Sampler built on first use, kept across calls and weight versions."""

    policy: Any
    max_new_tokens: int = 256
    temperature: float = 1.0
    seed: int = 0
    max_slots: int = 32
    max_len: int = 2048
    _sampler: Any = dataclasses.field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.max_len <= self.max_new_tokens:
            raise ValueError(
                f"max_len ({self.max_len}) must exceed max_new_tokens ({self.max_new_tokens})"
            )
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")

    @property
    def sampler(self) -> Any:
        """The Sampler of ``policy`` (compiled once; it keeps its KV cache between calls)."""
        if self._sampler is None:
            from rlax_tasks.rollout import Sampler  # lazy: JAX, as in sample_token_ids

            self._sampler = Sampler(self.policy, max_slots=self.max_slots, max_len=self.max_len)
        return self._sampler

    def set_params(self, params: Any) -> None:
        """Samples from now on with ``params`` (another weight version of the policy) on the
        same compiled sampler."""
        self.sampler.set_params(params)

    def row_params(self, count: int, stop: Sequence[str]) -> list[SamplingParams]:
        """One SamplingParams per row, each row with its own seed (``per_prompt_params``)."""
        return per_prompt_params(
            self.seed,
            count,
            max_new_tokens=self.max_new_tokens,
            temperature=float(self.temperature),
            stop_strings=tuple(stop),
        )


@dataclass
class PolicyGenerator(PolicySampling):
    """A `GenerateFn` sampling from `policy`, prompts rendered by ``prompt`` settings with the
    policy's tokenizer; `unusable` screens prompts first (too long, not encodable)."""

    prompt: PromptSettings = dataclasses.field(default_factory=PromptSettings)
    renderer: PromptRenderer = dataclasses.field(init=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        # a chat template the tokenizer lacks fails here, before any work
        self.renderer = PromptRenderer(self.prompt, self.policy.tokenizer)

    def encode(self, prompts: Sequence[Prompt]) -> tuple[list[list[int] | None], list[str | None]]:
        """(token ids, why not) per prompt, exactly as the sampler receives them."""
        return encode_prompts(self.renderer, prompts, self.max_len - self.max_new_tokens)

    def unusable(self, prompts: Sequence[Prompt]) -> list[str | None]:
        """Per prompt, why it cannot be sampled (None when it can)."""
        return self.encode(prompts)[1]

    def __call__(self, prompts: Sequence[Prompt], n: int) -> list[list[str]]:
        ids, errors = self.encode(prompts)
        bad = [(i, e) for i, e in enumerate(errors) if e is not None]
        if bad:
            i, err = bad[0]
            raise ValueError(f"prompt {i}: {err} ({len(bad)} prompt(s) affected)")
        tokens = sample_token_ids(
            self.policy,
            ids,  # type: ignore[arg-type]
            n,
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            seed=self.seed,
            max_slots=self.max_slots,
            max_len=self.max_len,
            sampler=self.sampler,
            stop_strings=self.prompt.stop,
        )
        decode = self.policy.tokenizer.decode
        return [[decode(t, skip_special_tokens=True) for t in per_prompt] for per_prompt in tokens]
