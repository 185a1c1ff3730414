"""The inference worker: version tagging, the reload rule of docs/design.md §3, the HTTP service and
CLI."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading
import time

import pytest
from fastapi.testclient import TestClient

from rlax_tasks.models import Policy
from rlax_tasks.models.tokenizer import char_tokenizer
from rlax_tasks.rollout import Sampler, SamplingParams
from rlax_tasks.rollout.service import WorkerClient, create_app
from rlax_tasks.rollout.weight_source import FixedWeights
from rlax_tasks.rollout.worker import GroupRequest, InferenceWorker
from tests.compute.helpers import wait_for
from tests.tiny_model import tiny_model_config

TOKENIZER = char_tokenizer()
CONFIG = tiny_model_config(vocab_size=len(TOKENIZER), eos_token_id=2)
# the sampling settings of every group here, as the HTTP API takes them
PARAMS_JSON = {"max_new_tokens": 12, "temperature": 1.0, "seed": 4, "ignore_eos": True}
PARAMS = SamplingParams(**PARAMS_JSON)


class VersionedWeights:
    """An in-memory weight source with versions set by the test (the PS protocol's shape)."""

    def __init__(self, versions: dict[int, Policy]) -> None:
        self.versions = versions
        self.latest = min(versions)
        self.acks: list[int] = []
        self.lock = threading.Lock()

    def latest_version(self) -> int:
        with self.lock:
            return self.latest

    def pull(self, min_version=None, *, like=None):  # noqa: ANN001, ANN202
        with self.lock:
            assert min_version is None or self.latest >= min_version
            return self.latest, self.versions[self.latest].params

    def ack(self, version: int) -> None:
        self.acks.append(version)


@pytest.fixture(scope="module")
def policies():
    return {v: Policy.init(CONFIG, seed=v, tokenizer=TOKENIZER) for v in range(4)}


def group(pid: str, text: str, g: int = 3, params: SamplingParams = PARAMS) -> GroupRequest:
    return GroupRequest(pid, tuple(TOKENIZER.encode(text)), g, params)


def expected(policy: Policy, text: str, g: int = 3, params: SamplingParams = PARAMS):
    outs = Sampler(policy, max_slots=4, max_len=64).generate(
        [TOKENIZER.encode(text)], n=g, params=params
    )
    return [o.tokens for o in outs]


def collect(worker: InferenceWorker, n: int, timeout_s: float = 120.0):
    got, deadline = [], time.monotonic() + timeout_s
    while len(got) < n and time.monotonic() < deadline:
        got += worker.results(wait_s=1.0)
    assert len(got) == n, f"only {len(got)} of {n} groups finished"
    return {r.prompt_id: r for r in got}


def test_groups_are_generated_and_version_tagged(policies):
    policy = policies[0]
    sampler = Sampler(policy, max_slots=4, max_len=64)
    with InferenceWorker(sampler, FixedWeights(policy.params, version=7)) as worker:
        worker.submit([group("a", "1+2="), group("b", "30-4=", g=2)])
        results = collect(worker, 2)
    assert results["a"].version == results["b"].version == 7
    assert [c.tokens for c in results["a"].completions] == expected(policy, "1+2=")
    assert [c.tokens for c in results["b"].completions] == expected(policy, "30-4=", g=2)
    assert results["a"].texts == [
        TOKENIZER.decode(c.tokens, skip_special_tokens=True) for c in results["a"].completions
    ]


LONG = SamplingParams(max_new_tokens=40, temperature=1.0, seed=1, ignore_eos=True)


def test_reload_only_when_j_versions_behind_and_partial_groups_regenerate(policies):
    source = VersionedWeights(policies)
    long = LONG
    sampler = Sampler(policies[0], max_slots=2, max_len=64, decode_chunk=1)
    worker = InferenceWorker(sampler, source, reload_every=2, poll_interval_s=0.0, interrupt=False)
    with worker:
        assert worker.version == 0
        source.latest = 1  # one version ahead: j=2 says keep generating with v0
        worker.submit([group(f"p{i}", f"{i}*{i}=", g=2, params=long) for i in range(4)])
        first = collect(worker, 1)
        assert all(r.version == 0 for r in first.values())
        assert worker.version == 0 and source.acks == [0]
        source.latest = 2  # two ahead: reload, discarding the unfinished groups
        rest = collect(worker, 3)
    assert source.acks == [0, 2]
    assert worker.stats.reloads == 2 and worker.stats.groups_discarded >= 1
    regenerated = [r for r in rest.values() if r.version == 2]
    assert regenerated, "no group was regenerated with the new weights"
    for r in {**first, **rest}.values():  # each group comes wholly from the version it names
        i = r.prompt_id[1:]
        want = expected(policies[r.version], f"{i}*{i}=", g=2, params=long)
        assert [c.tokens for c in r.completions] == want


def test_at_a_reload_the_sequences_in_flight_continue_on_the_new_weights(policies):
    """``interrupt`` (the default): nothing is generated twice; a completion that spans the
    reload keeps its first tokens (what v0 samples) and records each token's version, and its
    group is as old as its oldest token."""
    source = VersionedWeights(policies)
    sampler = Sampler(policies[0], max_slots=2, max_len=64, decode_chunk=1)
    with InferenceWorker(sampler, source, reload_every=2, poll_interval_s=0.0) as worker:
        worker.submit([group(f"p{i}", f"{i}*{i}=", g=2, params=LONG) for i in range(4)])
        first = collect(worker, 1)
        source.latest = 2  # two ahead: reload; the sequences in flight go on with v2
        rest = collect(worker, 3)
    assert worker.stats.reloads == 2 and worker.stats.groups_discarded == 0
    spanning = 0
    for r in {**first, **rest}.values():
        i = r.prompt_id[1:]
        from_v0 = expected(policies[0], f"{i}*{i}=", g=2, params=LONG)
        for c, want in zip(r.completions, from_v0, strict=True):
            assert len(c.versions) == len(c.tokens) == 40 and set(c.versions) <= {0, 2}
            switch = c.versions.index(2) if 2 in c.versions else 40
            assert c.versions == [0] * switch + [2] * (40 - switch)
            assert c.tokens[:switch] == want[:switch]  # v0's part: what v0 samples
            spanning += 0 < switch < 40
        assert r.version == min(min(c.versions) for c in r.completions)
    assert spanning, "no completion was in flight at the reload"


class UnreachableAcks(VersionedWeights):
    """A source whose acks fail while ``down`` (a PS restarting elsewhere after a preemption)."""

    def __init__(self, versions: dict[int, Policy]) -> None:
        super().__init__(versions)
        self.down = False
        self.failed: list[int] = []

    def ack(self, version: int) -> None:
        if self.down:
            self.failed.append(version)
            raise ConnectionError("parameter server unreachable")
        super().ack(version)


def test_an_ack_the_source_cannot_take_is_retried_and_the_worker_keeps_generating(policies):
    source = UnreachableAcks(policies)
    sampler = Sampler(policies[0], max_slots=2, max_len=64)
    with InferenceWorker(sampler, source, poll_interval_s=0.0) as worker:
        source.down = True
        source.latest = 1
        wait_for(lambda: worker.status()["version"] == 1, timeout_s=30)  # loaded v1 unacked
        worker.submit([group("a", "1+2=")])
        assert collect(worker, 1)["a"].version == 1  # and keeps generating with it
        assert source.failed and set(source.failed) == {1} and source.acks == [0]
        source.down = False
        wait_for(lambda: source.acks == [0, 1], timeout_s=30)
        worker.submit([group("b", "2+2=")])
        assert collect(worker, 1)["b"].version == 1
        assert worker.status()["error"] is None


def test_duplicate_and_invalid_groups_are_rejected_whole(policies):
    sampler = Sampler(policies[0], max_slots=2, max_len=32)
    with InferenceWorker(sampler, FixedWeights(policies[0].params)) as worker:
        with pytest.raises(ValueError, match="max_len"):
            worker.submit(
                [
                    group("ok", "1+1="),
                    group("big", "1+1=", params=SamplingParams(max_new_tokens=100)),
                ]
            )
        assert worker.status()["queued"] == 0
        worker.submit([group("x", "2+2=")])
        with pytest.raises(ValueError, match="already in flight"):
            worker.submit([group("x", "2+2=")])
        assert worker.reset() == 1
        assert worker.results(wait_s=0.5) == []


def test_http_service_auth_validation_and_results(policies):
    policy = policies[0]
    sampler = Sampler(policy, max_slots=4, max_len=64)
    with InferenceWorker(sampler, FixedWeights(policy.params, version=3)) as worker:
        client = TestClient(create_app(worker, token="s3cret"))
        assert client.get("/v1/status").status_code == 401
        assert client.get("/v1/status", headers={"Authorization": "Bearer nope"}).status_code == 403
        auth = {"Authorization": "Bearer s3cret"}
        bad = client.post("/v1/groups", headers=auth, json={"groups": [{"prompt_id": "a"}]})
        assert bad.status_code == 400 and "prompt_tokens" in bad.json()["detail"]
        bad = client.post(
            "/v1/groups",
            headers=auth,
            json={
                "groups": [
                    {
                        "prompt_id": "a",
                        "prompt_tokens": [5],
                        "group_size": 2,
                        "params": {"temprature": 1},
                    }
                ]
            },
        )
        assert bad.status_code == 400 and "temprature" in bad.json()["detail"]
        body = {
            "groups": [
                {
                    "prompt_id": "a",
                    "prompt_tokens": TOKENIZER.encode("1+2="),
                    "group_size": 3,
                    "params": PARAMS_JSON,
                }
            ]
        }
        assert client.post("/v1/groups", headers=auth, json=body).json() == {"accepted": 1}
        results = []
        while not results:
            results = client.get("/v1/results?wait_s=5", headers=auth).json()["results"]
    (r,) = results
    assert r["version"] == 3 and r["prompt_id"] == "a"
    assert [c["tokens"] for c in r["completions"]] == expected(policy, "1+2=")
    assert all(len(c["logprobs"]) == len(c["tokens"]) for c in r["completions"])


@pytest.mark.slow
def test_rlax_worker_cli_serves_an_hf_directory(tmp_path, policies):
    policies[1].save_pretrained(str(tmp_path / "model"))
    env = {**os.environ, "RLAX_PS_TOKEN": "tok"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rlax_tasks.cli",
            "worker",
            "--model-dir",
            str(tmp_path / "model"),
            "--max-slots",
            "4",
            "--max-len",
            "64",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), proc.stderr.read()
        client = WorkerClient(url, token="tok", timeout_s=30)
        client.submit(
            [
                {
                    "prompt_id": "q",
                    "prompt_tokens": TOKENIZER.encode("7+8="),
                    "group_size": 3,
                    "params": PARAMS_JSON,
                }
            ]
        )
        results = []
        deadline = time.monotonic() + 120
        while not results and time.monotonic() < deadline:
            results = client.results(wait_s=5)
        assert results[0]["version"] == 0
        assert [c["tokens"] for c in results[0]["completions"]] == expected(policies[1], "7+8=")
        with pytest.raises(ValueError, match="group_size"):
            client.submit([{"prompt_id": "z", "prompt_tokens": [5], "group_size": 0}])
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.slow
def test_worker_follows_the_real_parameter_server(policies):
    """Weights pulled from `ParameterServer` with the docs/design.md §3 reload rule; acks reach
    the server. The worker pulls over TCP, as from another host: its reload is a delta from the
    version it held, and generates exactly what the new weights give."""
    from rlax_tasks.paramserver import ParameterServerClient
    from rlax_tasks.paramserver.server import ParameterServer, ServerConfig

    with ParameterServer(ServerConfig(token="t", keep_versions=4)) as server:
        trainer = ParameterServerClient(server.address, token="t")
        trainer.push(0, policies[0].params)
        source = ParameterServerClient(
            server.address, token="t", worker_id="w0", timeout_s=10, shared_memory=False
        )
        sampler = Sampler(Policy.init(CONFIG, seed=3, tokenizer=TOKENIZER), 4, 64)
        with InferenceWorker(sampler, source, reload_every=2, poll_interval_s=0.0) as worker:
            assert worker.version == 0
            trainer.push(1, policies[1].params)
            worker.submit([group("a", "1+2=")])
            first = collect(worker, 1)["a"]
            trainer.push(2, policies[2].params)
            wait_for(lambda: worker.version == 2)  # two versions ahead: j=2 reloads
            worker.submit([group("b", "1+2=")])
            second = collect(worker, 1)["b"]
            acked = server.status()["workers"]
            pulled = worker.status()
        trainer.close()
        source.close()
    # j=2: one version ahead (1) is no reason to reload, so "a" ran on 0; 2 came after "a"
    assert first.version == 0 and second.version == 2
    assert [c.tokens for c in first.completions] == expected(policies[first.version], "1+2=")
    assert [c.tokens for c in second.completions] == expected(policies[2], "1+2=")
    assert acked["w0"]["acked"] == 2
    assert (source.last_pull.version, source.last_pull.base) == (2, 0)
    assert 0 < pulled["pulled_bytes"] <= pulled["pulled_full_bytes"]


def test_a_group_with_min_version_waits_for_newer_weights(policies):
    """The controller's staleness bound: a worker behind a group's min_version reloads first,
    even when the j rule alone would keep its weights."""
    source = VersionedWeights(policies)
    sampler = Sampler(policies[0], max_slots=4, max_len=64)
    with InferenceWorker(sampler, source, reload_every=5, poll_interval_s=0.0) as worker:
        source.latest = 2
        worker.submit([group("old", "1+1=")])
        first = collect(worker, 1)["old"]
        assert first.version == 0  # j=5: no reload for this one
        worker.submit([dataclasses.replace(group("new", "2+2="), min_version=2)])
        second = collect(worker, 1)["new"]
    assert second.version == 2
    assert [c.tokens for c in second.completions] == expected(policies[2], "2+2=")


@pytest.mark.slow
def test_a_worker_whose_generation_fails_exits_1_instead_of_serving_the_error(tmp_path, policies):
    """Weights the worker cannot load (another model's shapes) stop its generation: the process
    exits 1, so its job is restarted, rather than answering every call with HTTP 500."""
    from rlax_tasks.paramserver import ParameterServerClient
    from rlax_tasks.paramserver.server import ParameterServer, ServerConfig

    policies[0].save_pretrained(str(tmp_path / "model"))
    other = Policy.init(tiny_model_config(vocab_size=len(TOKENIZER), hidden_size=48), seed=0)
    with ParameterServer(ServerConfig(token="tok", keep_versions=4)) as server:
        trainer = ParameterServerClient(server.address, token="tok")
        trainer.push(0, policies[0].params)
        proc = subprocess.Popen(
            [sys.executable, "-m", "rlax_tasks.cli", "worker", "--model-dir",
             str(tmp_path / "model"), "--ps-url", server.address, "--max-slots", "2",
             "--max-len", "32"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "RLAX_PS_TOKEN": "tok"},
        )  # fmt: skip
        try:
            url = proc.stdout.readline().strip()
            assert url.startswith("http://127.0.0.1:"), proc.stderr.read()
            trainer.push(1, other.params)  # the worker's next poll reloads, and cannot
            assert proc.wait(timeout=120) == 1
        finally:
            if proc.poll() is None:
                proc.kill()
            trainer.close()
    assert "its generation failed" in proc.stderr.read()


def test_waiting_for_results_wakes_when_a_group_finishes_and_removes_nothing(policies):
    policy = policies[0]
    sampler = Sampler(policy, max_slots=4, max_len=64)
    with InferenceWorker(sampler, FixedWeights(policy.params, version=0)) as worker:
        t0 = time.monotonic()
        assert worker.wait_for_results(0.2) is False  # nothing submitted: the timeout
        assert time.monotonic() - t0 >= 0.19
        worker.submit([group("a", "1+2=")])
        assert worker.wait_for_results(60.0) is True  # woken by the finished group
        assert worker.wait_for_results(0.0) is True  # still there: waiting takes nothing
        assert [r.prompt_id for r in worker.results()] == ["a"]
        assert worker.wait_for_results(0.05) is False
