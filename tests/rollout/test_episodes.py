"""Multi-turn episodes on the real sampler (docs/design.md §15): the loss mask is exactly the
model's tokens, observations are what the chat template renders between turns, each next turn
prefills only its observation (the KV cache is kept), and faulty steps become observations."""

from __future__ import annotations

import os
import time

import pytest

from rlax_tasks.environments import EnvironmentSpec
from rlax_tasks.environments.render import ChatRenderer
from rlax_tasks.rollout import Sampler, SamplingParams
from rlax_tasks.rollout.episodes import LOST_STEP, EpisodeDriver
from rlax_tasks.rollout.requests import GroupRequest
from rlax_tasks.rollout.weight_source import FixedWeights
from rlax_tasks.rollout.worker import InferenceWorker
from tests.rollout.episode_helpers import CALLS_ENV, TOKENIZER, step_calls, turn_ending_policy

PARAMS = SamplingParams(max_new_tokens=48, temperature=1.0, seed=7)
SPEC = EnvironmentSpec("counted-echo", max_turns=3, tool_timeout_s=0.5,
                       max_observation_tokens=64)  # fmt: skip


@pytest.fixture(autouse=True)
def calls_file(tmp_path, monkeypatch):
    monkeypatch.setenv(CALLS_ENV, str(tmp_path / "calls.jsonl"))


@pytest.fixture(scope="module")
def policy():
    return turn_ending_policy()


def _run(driver: EpisodeDriver, n: int, spec: EnvironmentSpec = SPEC):
    """Runs ``n`` episodes to their end; returns them and every turn the sampler finished."""
    for i in range(n):
        driver.start(("p", i), spec, {"prompt": f"{i}+1=?"}, PARAMS)
    done, turns = [], []
    while driver.episodes:
        finished = driver.sampler.step() if driver.sampler.has_unfinished else []
        for c in finished:
            assert driver.owns(c)
            turns.append(c)
            driver.on_turn(c)
        done += driver.poll()
    return done, turns


def test_the_mask_is_the_models_tokens_and_each_turn_prefills_its_observation(policy):
    sampler = Sampler(policy, max_slots=4, max_len=512)
    done, turns = _run(EpisodeDriver(sampler), 4)
    assert len(done) == 4
    by_episode = {}
    for c in turns:
        by_episode.setdefault(c.request.request_id[1], []).append(c)
    multi = 0
    for ep in done:
        mine = by_episode[ep.key]
        renderer = ChatRenderer(TOKENIZER, ep.env.tools)
        assert list(ep.prompt) == renderer.initial_tokens([{"role": "user", "content":
                                                             f"{ep.key[1]}+1=?"}])  # fmt: skip
        # the sequence: turn, observation, turn, ... with the mask 1 exactly on the turns
        at, history = 0, ep.history[:1]
        for k, c in enumerate(mine):
            assert ep.tokens[at : at + len(c.tokens)] == c.tokens
            assert ep.mask[at : at + len(c.tokens)] == [1] * len(c.tokens)
            assert ep.logprobs[at : at + len(c.tokens)] == c.logprobs
            at += len(c.tokens)
            if k == len(mine) - 1:
                break
            text = TOKENIZER.decode(c.tokens, skip_special_tokens=True)
            obs_messages = ep.history[len(history) + 1 : len(history) + 2]
            obs = renderer.observation_tokens(history, text, obs_messages)
            assert ep.tokens[at : at + len(obs)] == obs
            assert ep.mask[at : at + len(obs)] == [0] * len(obs)
            assert set(ep.logprobs[at : at + len(obs)]) == {0.0}
            history = ep.history[: len(history) + 2]
            at += len(obs)
            # KV reuse: the next turn prefilled its observation and this turn's last token
            assert mine[k + 1].prefilled == len(obs) + 1
        assert at == len(ep.tokens) == len(ep.mask) == len(ep.versions)
        multi += len(mine) > 1
        assert ep.finish_reason in ("stop", "length")
    assert multi >= 3, "most episodes should have taken several turns"
    assert len(step_calls()) == sum(len(v) for v in by_episode.values()) - sum(
        ep.finish_reason == "length" for ep in done
    )


@pytest.mark.parametrize("fault", ["sleep", "crash", "flood"])
def test_a_step_that_hangs_crashes_or_floods_becomes_an_observation(policy, fault):
    sampler = Sampler(policy, max_slots=4, max_len=512)
    spec = EnvironmentSpec("counted-echo", max_turns=2, tool_timeout_s=0.3,
                           max_observation_tokens=128, settings={"fault": fault})  # fmt: skip
    done, turns = _run(EpisodeDriver(sampler), 2, spec)
    assert len(done) == 2
    for ep in done:
        if len(ep.history) < 3:
            continue  # ended in its first turn (no room, or never ended its turn)
        observation = ep.history[2]["content"]
        expected = {"sleep": "did not finish in 0.3s", "crash": "the tool crashed",
                    "flood": "x" * 100}[fault]  # fmt: skip
        assert expected in observation
        masked = len(ep.mask) - sum(ep.mask)
        assert masked <= 128
        if fault != "flood":
            assert ep.stats["tool_errors"] >= 1


def _group(prompt_id: str, resume=()) -> GroupRequest:
    return GroupRequest(prompt_id, (1,), 3, PARAMS, resume=tuple(resume),
                        environment=SPEC_4.to_dict(), row={"prompt": prompt_id})  # fmt: skip


SPEC_4 = EnvironmentSpec("counted-echo", max_turns=4, tool_timeout_s=2.0,
                         max_observation_tokens=64, settings={"delay_s": 0.2})  # fmt: skip


def test_a_worker_killed_mid_episode_is_resumed_from_its_records_running_no_step_twice(policy):
    """Records taken mid-episode (what a snapshot holds) go to a fresh worker: each episode
    goes on from its tokens (none generated again), and no turn's step runs twice."""
    ids = [f"q{i}" for i in range(4)]
    first = InferenceWorker(Sampler(policy, max_slots=4, max_len=512), FixedWeights(
        policy.params)).start()  # fmt: skip
    first.submit([_group(p) for p in ids])
    held: dict = {}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # until some episode holds a complete turn
        held = first.progress()
        states = [r.episode for rs in held.values() for r in rs if r.episode]
        done_turns = any(e["turns"] >= 1 and not e["awaiting"] for e in states)
        if done_turns and any(e["awaiting"] for e in states) and len(held) == len(ids):
            break
        time.sleep(0.02)
    first.stop()  # its generation thread ends: what it did after `held` is lost, as at a kill
    states = [r.episode for rs in held.values() for r in rs]
    assert any(e["awaiting"] for e in states), "no record held a step in flight"
    assert any(e["turns"] >= 1 for e in states), "no record held a complete turn"
    os.environ[CALLS_ENV] += ".after"  # the steps the resumed episodes run

    second = InferenceWorker(Sampler(policy, max_slots=4, max_len=512), FixedWeights(
        policy.params)).start()  # fmt: skip
    wire = [GroupRequest.from_dict(_group(p, held.get(p, ())).to_dict()) for p in ids]
    second.submit(wire)
    results = {}
    while len(results) < len(ids):
        results.update({r.prompt_id: r for r in second.results(wait_s=30)})
    second.stop()
    resumed, owed = 0, 0
    for p in ids:
        records = {r.sample: r for r in held.get(p, ())}
        for i, c in enumerate(results[p].completions):
            r = records.get(i)
            held_turns = r.episode["turns"] if r is not None else 0
            lost = sum(m.get("content") == LOST_STEP for m in c.episode["history"])
            # the steps run after the kill: each turn the episode took beyond those held,
            # less the one whose result was lost (not run again)
            owed += c.episode["turns"] - held_turns - lost
            if r is None:
                continue
            if r.episode["awaiting"]:  # its step was in flight: reported lost, not run again
                after = c.episode["history"][len(r.episode["history"]) + 1]
                assert after["content"] == LOST_STEP
            # every held token is the episode's, as held (generated once, before the kill)
            assert tuple(c.tokens[: len(r.tokens)]) == r.tokens
            assert tuple(c.mask[: len(r.tokens)]) == r.mask
            assert c.resumed == len(r.tokens)
            resumed += len(r.tokens)
    assert resumed > 0 and second.stats.resumed_tokens == resumed
    # a held turn whose step ran again would be a call that no new turn accounts for
    assert len(step_calls()) == owed
