"""An episode's next turn behind its kept KV cache (docs/design.md §15): a turn that ends on a
stop id with ``keep_cache`` keeps its slot's cache, and the request that ``continues`` it
prefills only its new tokens (the observation), drawing what a whole prefill would draw."""

from __future__ import annotations

import numpy as np
import pytest

from rlax_tasks.models import Policy
from rlax_tasks.models.tokenizer import char_tokenizer
from rlax_tasks.rollout import Sampler, SamplingParams
from rlax_tasks.rollout.requests import Request
from tests.tiny_model import tiny_model_config

TOKENIZER = char_tokenizer()
CONFIG = tiny_model_config(vocab_size=len(TOKENIZER), eos_token_id=2)
OBSERVATION = TOKENIZER.encode("\nresult: 42\n")


@pytest.fixture(scope="module")
def policy():
    return Policy.init(CONFIG, seed=3, tokenizer=TOKENIZER)


@pytest.fixture(scope="module")
def first_turn(policy):
    """A prompt and the stop id its greedy turn ends on (a token it draws once, at its 4th)."""
    prompt = tuple(TOKENIZER.encode("12+34="))
    sampler = Sampler(policy, max_slots=2, max_len=64)
    [c] = sampler.generate([prompt], max_new_tokens=12, ignore_eos=True)
    end = next(i for i in range(3, 12) if c.tokens[i] not in c.tokens[:i])
    return prompt, c.tokens[end]


def _run(sampler: Sampler, *requests: Request) -> dict:
    for r in requests:
        sampler.add_request(r)
    done = {}
    while sampler.has_unfinished:
        done.update({c.request.request_id: c for c in sampler.step()})
    return done


def _turn(prompt, stop, request_id, continues=None) -> Request:
    params = SamplingParams(max_new_tokens=12, stop_token_ids=(stop,), ignore_eos=True)
    return Request(tuple(prompt), params, request_id=request_id, keep_cache=True,
                   continues=continues)  # fmt: skip


def _assert_as_whole(policy, prompt, stop, turn) -> None:
    """``turn`` drew what a fresh sampler draws for ``prompt`` from a whole prefill, with the
    same log-probs."""
    sampler = Sampler(policy, max_slots=2, max_len=64)
    whole = _run(sampler, _turn(prompt, stop, "x"))["x"]
    assert turn.tokens == whole.tokens
    np.testing.assert_allclose(turn.logprobs, whole.logprobs, atol=2e-6)


def test_a_continued_turn_prefills_only_its_observation_and_draws_the_same(policy, first_turn):
    prompt, stop = first_turn
    sampler = Sampler(policy, max_slots=2, max_len=64)
    one = _run(sampler, _turn(prompt, stop, "t1"))["t1"]
    assert one.finish_reason == "stop" and one.prefilled == len(prompt)
    assert sampler.kept_caches == 1
    second = (*prompt, *one.tokens, *OBSERVATION)
    two = _run(sampler, _turn(second, stop, "t2", continues="t1"))["t2"]
    # the observation, and the turn's last token (drawn, never fed to the cache by decode)
    assert two.prefilled == len(OBSERVATION) + 1
    assert sampler.stats.extended_tokens == len(OBSERVATION) + 1
    _assert_as_whole(policy, second, stop, two)


def test_a_waiting_request_takes_a_kept_slot_and_the_next_turn_prefills_all(policy, first_turn):
    prompt, stop = first_turn
    sampler = Sampler(policy, max_slots=1, max_len=64)
    one = _run(sampler, _turn(prompt, stop, "t1"))["t1"]
    other = Request(tuple(TOKENIZER.encode("7*8=")), SamplingParams(max_new_tokens=3),
                    request_id="other")  # fmt: skip
    _run(sampler, other)
    assert sampler.stats.evicted == 1 and sampler.kept_caches == 0
    second = (*prompt, *one.tokens, *OBSERVATION)
    two = _run(sampler, _turn(second, stop, "t2", continues="t1"))["t2"]
    assert two.prefilled == len(second)
    _assert_as_whole(policy, second, stop, two)


def test_new_weights_give_up_kept_caches(policy, first_turn):
    prompt, stop = first_turn
    sampler = Sampler(policy, max_slots=2, max_len=64)
    _run(sampler, _turn(prompt, stop, "t1"))
    sampler.interrupt()
    assert sampler.kept_caches == 0
    sampler.release("t1")  # (nothing kept: a no-op)
    assert np.all(~np.asarray(sampler._state.active))
