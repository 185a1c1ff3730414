"""Partial rollouts (docs/design.md §7): what a worker's unfinished groups hold, reported between
two steps, and a group handed back with those records going on from them, not sampling them
again."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from rlax_tasks.rollout import Sampler, SamplingParams
from rlax_tasks.rollout.requests import GroupRequest, Request, SampleProgress
from rlax_tasks.rollout.service import create_app
from rlax_tasks.rollout.weight_source import FixedWeights
from rlax_tasks.rollout.worker import InferenceWorker
from tests.compute.helpers import wait_for
from tests.rollout.test_worker import TOKENIZER, collect, expected, policies  # noqa: F401

LONG = SamplingParams(max_new_tokens=40, temperature=1.0, seed=3, ignore_eos=True)
PROMPT = tuple(TOKENIZER.encode("12*7="))


def records_after(policy, steps: int, version: int = 5) -> list[SampleProgress]:  # noqa: ANN001
    """What a sampler holds of a 3-sample group after ``steps`` decode steps, sample 1 finished
    early (a shorter budget), as a worker reports it."""
    sampler = Sampler(policy, max_slots=4, max_len=64, decode_chunk=1)
    sampler.set_params(policy.params, version=version)
    short = SamplingParams(**{**vars(LONG), "max_new_tokens": 3})
    for i in range(3):
        params = short if i == 1 else LONG
        sampler.add_request(Request(PROMPT, params, sample_index=i, request_id=("p", i)))
    finished = []
    for _ in range(steps):
        finished += sampler.step()
    held = [SampleProgress.of(c.request.sample_index, c) for c in finished]
    held += [SampleProgress.of(p.request.sample_index, p) for p in sampler.in_progress()]
    return sorted(held, key=lambda r: r.sample)


def test_a_group_resumed_from_its_records_samples_only_the_rest(policies):  # noqa: F811
    policy = policies[0]
    records = records_after(policy, steps=9)
    assert [r.finish_reason for r in records] == [None, "length", None]
    held = {r.sample: r for r in records}
    assert len(held[0].tokens) == 10 and held[0].versions == (5,) * 10  # prefill + 9
    # sample 1's record says it ended after 3 tokens (its stream's first 3): it comes back
    want = expected(policy, "12*7=", g=3, params=LONG)
    assert held[1].tokens == tuple(want[1][:3])

    sampler = Sampler(policy, max_slots=4, max_len=64)
    group = GroupRequest("p", PROMPT, 3, LONG, resume=(held[0], held[1]))  # 2 of them handed
    with InferenceWorker(sampler, FixedWeights(policy.params, version=6)) as worker:
        worker.submit([group])
        result = collect(worker, 1)["p"]
        stats = worker.status()
    done = result.completions
    # the same random streams: what an uninterrupted run samples, with v5's first tokens
    # (the same weights under another version number here)
    assert [c.tokens for c in (done[0], done[2])] == [want[0], want[2]]
    assert done[1].tokens == list(held[1].tokens) and done[1].finish_reason == "length"
    assert [c.resumed for c in done] == [10, 3, 0]
    assert done[0].versions == [5] * 10 + [6] * 30 and done[2].versions == [6] * 40
    assert done[0].logprobs[:10] == list(held[0].logprobs)
    assert result.version == 5  # the oldest token's
    # nothing handed back was sampled again: 30 + 40 new tokens
    assert sampler.stats.generated_tokens == 30 + 40
    assert stats["resumed_tokens"] == 13 and stats["tokens_generated"] == 70
    # and the result's JSON carries the counts
    assert [c.get("resumed", 0) for c in result.to_dict()["completions"]] == [10, 3, 0]


def test_a_worker_reports_what_its_groups_hold_between_two_steps(policies):  # noqa: F811
    policy = policies[0]
    sampler = Sampler(policy, max_slots=4, max_len=64, decode_chunk=1)
    with InferenceWorker(sampler, FixedWeights(policy.params, version=2)) as worker:
        client = TestClient(create_app(worker, token="t"))
        auth = {"Authorization": "Bearer t"}
        assert worker.progress() == {}
        worker.submit([GroupRequest("p", PROMPT, 3, LONG)])
        reports = []

        def partway() -> bool:
            reports.append(worker.progress(timeout_s=30))
            samples = reports[-1].get("p", [])
            return any(r.finish_reason is None and 0 < len(r.tokens) < 40 for r in samples)

        wait_for(partway, timeout_s=60, every_s=0.0)
        over_http = client.get("/v1/progress", headers=auth)
        result = collect(worker, 1)["p"]
    assert over_http.status_code == 200
    assert {g["prompt_id"] for g in over_http.json()["groups"]} <= {"p"}
    for report in reports:  # every record is a prefix of what the sample ended with
        for r in report.get("p", []):
            final = result.completions[r.sample]
            n = len(r.tokens)
            assert list(r.tokens) == final.tokens[:n] and list(r.logprobs) == final.logprobs[:n]
            assert r.versions == (2,) * n
            assert (r.finish_reason is not None) == (n == 40)
    assert client.get("/v1/progress").status_code == 401


def test_resume_records_are_checked_and_name_what_is_wrong():
    ok = {"sample": 0, "tokens": [5, 6], "logprobs": [-0.1, -0.2]}
    base = {"prompt_id": "p", "prompt_tokens": [4], "group_size": 2, "params": {}}
    g = GroupRequest.from_dict({**base, "resume": [ok]})
    assert g.resume[0].tokens == (5, 6) and GroupRequest.from_dict(g.to_dict()) == g
    for bad, message in [
        ({**ok, "sample": 2}, r"sample must be an int in \[0, 2\)"),
        ({**ok, "logprobs": [-0.1]}, "logprobs must be a list as long as tokens"),
        ({**ok, "versions": [1]}, "versions must be one int >= 0 per token"),
        ({**ok, "tokens": list(range(128))} | {"logprobs": [0.0] * 128}, "max_new_tokens"),
        ({**ok, "finish_reason": "done"}, "finish_reason must be one of"),
        ({**ok, "color": 1}, r"unknown field\(s\) \['color'\]"),
    ]:
        with pytest.raises(ValueError, match=message):
            GroupRequest.from_dict({**base, "resume": [bad]})
    with pytest.raises(ValueError, match="a sample appears twice"):
        GroupRequest.from_dict({**base, "resume": [ok, ok]})
