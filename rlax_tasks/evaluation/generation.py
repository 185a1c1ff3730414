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

logger = logging.getLogger(__name__)

# (prompts, n) -> n completion texts per prompt, prompt-major
GenerateFn = Callable[[Sequence[str], int], list[list[str]]]


def encode_prompt(tokenizer: Any, prompt: str, chat_template: bool = False) -> list[int]:
    """Token ids of one prompt (through the tokenizer's chat template when asked)."""
    if tokenizer is None:
        raise ValueError("the model has no tokenizer files; save one next to config.json")
    if chat_template:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("--chat-template given but the tokenizer has no chat template")
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]
    return [int(t) for t in tokenizer(prompt)["input_ids"]]


def encode_prompts(
    tokenizer: Any, prompts: Sequence[str], max_prompt_tokens: int, chat_template: bool = False
) -> tuple[list[list[int] | None], list[str | None]]:
    """(ids, errors) per prompt: ids is None and errors says why when a prompt cannot be
    encoded (characters outside the vocabulary) or is longer than `max_prompt_tokens`."""
    ids: list[list[int] | None] = []
    errors: list[str | None] = []
    for prompt in prompts:
        try:
            tokens = encode_prompt(tokenizer, prompt, chat_template)
        except ValueError:
            raise
        except Exception as exc:  # noqa: BLE001 - tokenizers raise plain Exception
            ids.append(None)
            errors.append(f"the tokenizer cannot encode the prompt ({exc})")
            continue
        if not tokens:
            ids.append(None)
            errors.append("the prompt encodes to no tokens")
        elif len(tokens) > max_prompt_tokens:
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
) -> list[list[list[int]]]:
    """n completions (token ids) per tokenized prompt, from `rlax_tasks.rollout.Sampler`
    (a new one for `policy`, or `sampler` when given: it keeps its KV cache between calls)."""
    from rlax_tasks.rollout import Sampler, per_prompt_params

    if not prompt_ids:
        return []
    if sampler is None:
        sampler = Sampler(policy, max_slots=max_slots, max_len=max_len)
    # a seed per prompt: samples of different prompts are independent
    params = per_prompt_params(
        seed, len(prompt_ids), max_new_tokens=max_new_tokens, temperature=float(temperature)
    )
    outs = sampler.generate([list(p) for p in prompt_ids], n=n, params=params)
    if len(outs) != len(prompt_ids) * n:
        raise RuntimeError(
            f"sampler returned {len(outs)} completions for {len(prompt_ids)} prompts x n={n}"
        )
    return [[list(outs[p * n + s].tokens) for s in range(n)] for p in range(len(prompt_ids))]


@dataclass
class PolicyGenerator:
    """A `GenerateFn` sampling from `policy`, plus `unusable` to screen prompts first."""

    policy: Any
    max_new_tokens: int = 256
    temperature: float = 1.0
    seed: int = 0
    max_slots: int = 32
    max_len: int = 2048
    chat_template: bool = False
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

    def _encode(self, prompts: Sequence[str]) -> tuple[list[list[int] | None], list[str | None]]:
        return encode_prompts(
            self.policy.tokenizer, prompts, self.max_len - self.max_new_tokens, self.chat_template
        )

    def unusable(self, prompts: Sequence[str]) -> list[str | None]:
        """Per prompt, why it cannot be sampled (None when it can)."""
        return self._encode(prompts)[1]

    def __call__(self, prompts: Sequence[str], n: int) -> list[list[str]]:
        ids, errors = self._encode(prompts)
        bad = [(i, e) for i, e in enumerate(errors) if e is not None]
        if bad:
            i, err = bad[0]
            raise ValueError(f"prompt {i}: {err} ({len(bad)} prompt(s) affected)")
        if self._sampler is None:
            from rlax_tasks.rollout import Sampler

            self._sampler = Sampler(self.policy, max_slots=self.max_slots, max_len=self.max_len)
        tokens = sample_token_ids(
            self.policy,
            ids,  # type: ignore[arg-type]
            n,
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            seed=self.seed,
            max_slots=self.max_slots,
            max_len=self.max_len,
            sampler=self._sampler,
        )
        decode = self.policy.tokenizer.decode
        return [[decode(t, skip_special_tokens=True) for t in per_prompt] for per_prompt in tokens]
