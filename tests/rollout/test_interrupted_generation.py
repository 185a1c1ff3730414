"""Generation that survives a weight update: ``Sampler.interrupt`` sends the requests in flight
back with their tokens, and after ``set_params`` they continue on the new weights (their prefix
prefilled again), each token recording the version it was sampled with (docs/design.md §5)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from rlax_tasks.models import LogProbOptions, Policy
from rlax_tasks.models.forward import token_logprobs
from rlax_tasks.models.tokenizer import char_tokenizer
from rlax_tasks.rollout import Sampler, SamplingParams
from rlax_tasks.rollout.requests import Request
from tests.tiny_model import tiny_model_config

TOKENIZER = char_tokenizer()
CONFIG = tiny_model_config(vocab_size=len(TOKENIZER), eos_token_id=2)
PROMPTS = ["12+34=", "7*8=", "100-1="]
TEMPERATURE = 0.8


@pytest.fixture(scope="module")
def policies():
    return {v: Policy.init(CONFIG, seed=10 + v, tokenizer=TOKENIZER) for v in (1, 2)}


def _requests(params: SamplingParams, n: int = 2) -> list[Request]:
    return [
        Request.make(TOKENIZER.encode(p), params, sample_index=j, request_id=(i, j))
        for i, p in enumerate(PROMPTS)
        for j in range(n)
    ]


def _run(sampler: Sampler, requests: list[Request], swap_after: int | None = None, swap=None):
    """Every request to its end; with ``swap_after``, after that many ``step`` calls the requests
    in flight are interrupted and ``swap()`` sets the next weights."""
    for r in requests:
        sampler.add_request(r)
    done, steps = {}, 0
    while sampler.has_unfinished:
        if steps == swap_after:
            assert sampler.interrupt() > 0, "nothing was in flight to interrupt"
            swap()
        for c in sampler.step():
            done[c.request.request_id] = c
        steps += 1
    return [done[r.request_id] for r in requests]


def _reference(policy: Policy, completions: list) -> list[np.ndarray]:
    """log p(token t | prompt, tokens[:t]) at TEMPERATURE under ``policy`` for each completion's
    tokens, from one full forward of them all (right-padded)."""
    rows = [list(c.prompt) + c.tokens for c in completions]
    width = max(map(len, rows))
    ids = jnp.asarray([row + [0] * (width - len(row)) for row in rows], jnp.int32)
    mask = jnp.asarray([[t < len(row) for t in range(width)] for row in rows])
    options = LogProbOptions(temperature=TEMPERATURE)
    lp = np.asarray(token_logprobs(policy.graphdef, policy.params, ids, mask, options))
    return [lp[i, len(c.prompt) : len(c.prompt) + len(c.tokens)] for i, c in enumerate(completions)]


def test_a_request_taken_over_by_new_weights_keeps_its_tokens_and_records_each_version(policies):
    params = SamplingParams(max_new_tokens=24, temperature=TEMPERATURE, seed=5, ignore_eos=True)
    sampler = Sampler(policies[1], max_slots=8, max_len=64, decode_chunk=4)
    sampler.set_params(policies[1].params, version=1)
    out = _run(
        sampler, _requests(params), swap_after=2,
        swap=lambda: sampler.set_params(policies[2].params, version=2),
    )  # fmt: skip
    by_old, by_new = _reference(policies[1], out), _reference(policies[2], out)
    for c, old, new in zip(out, by_old, by_new, strict=True):
        assert len(c.tokens) == 24 and len(c.versions) == 24
        switch = c.versions.index(2)
        assert 0 < switch < 24 and c.versions == [1] * switch + [2] * (24 - switch), c.versions
        # each token's log-prob is the one its own version's model gives for that prefix
        want = np.where(np.asarray(c.versions) == 1, old, new)
        np.testing.assert_allclose(c.logprobs, want, atol=2e-5)
        # and not what the old model would have given after the switch
        assert np.abs(old[switch:] - np.asarray(c.logprobs[switch:])).max() > 1e-2


def test_interrupted_on_the_same_weights_a_request_continues_its_random_stream(policies):
    """Interrupting and continuing on the same weights changes nothing: token i is drawn with
    the i-th key of the request's stream, and the top-k kept ids are recorded throughout."""
    params = SamplingParams(
        max_new_tokens=20, temperature=TEMPERATURE, top_k=5, seed=9, ignore_eos=True
    )
    plain = Sampler(policies[1], max_slots=8, max_len=64, decode_chunk=4, support_capacity=8)
    plain.set_params(policies[1].params, version=1)
    want = _run(plain, _requests(params))
    again = Sampler(policies[1], max_slots=8, max_len=64, decode_chunk=4, support_capacity=8)
    again.set_params(policies[1].params, version=1)
    got = _run(again, _requests(params), swap_after=2, swap=lambda: None)
    for a, b in zip(want, got, strict=True):
        assert a.tokens == b.tokens
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=2e-5)
        assert a.support == b.support and len(b.support) == 20
        assert b.versions == [1] * 20
