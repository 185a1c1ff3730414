"""`rlax run` with three parameter-server replicas (docs/design.md §16): real processes, one
replica killed for good mid-run, exact step and rollout accounting."""

from __future__ import annotations

import glob
import json
import os
import re

import pytest

from rlax_tasks.run.local_run import run_local
from tests.conftest import TEST_XLA_FLAGS
from tests.run.test_local_run import read_jsonl, small_config, steps_trained

LOADED = re.compile(r"worker loaded weights v(\d+)")
FAILED_OVER = re.compile(r"worker (worker-\d+): replica (\S+) failed .*; now on (\S+)")


def _log(run_dir: str, job: str) -> str:
    (path,) = glob.glob(os.path.join(run_dir, "logs", f"{job}.log"))
    with open(path) as f:
        return f.read()


@pytest.mark.slow
def test_three_replicas_serve_every_worker_and_a_killed_one_loses_nothing(tmp_path, monkeypatch):
    """ps, ps-1 and ps-2 serve three workers (one each); ps-1 is killed with SIGKILL after step 3
    and kept down: worker-1 fails over to ps-2, every worker loads versions after the kill, and
    the run ends with every step trained once and every drawn prompt accounted for."""
    monkeypatch.setenv("XLA_FLAGS", TEST_XLA_FLAGS)
    steps = 8
    cfg = small_config(
        tmp_path,
        **{"workers.count": 3, "paramserver.replicas": 3, "staleness.reload_every": 1,
           "staleness.max_staleness": 2},
    )  # fmt: skip
    killed_at: list[int] = []

    def hook(sup):
        done = steps_trained(cfg.run_dir)
        if not killed_at and done >= 3:
            sup.kill("ps-1")  # SIGKILL: no deregistration, as a preempted host
            sup.stop(["ps-1"])  # and not restarted: its workers must move
            killed_at.append(done)

    report = run_local(cfg, steps=steps, evaluate=False, supervisor_hook=hook)
    assert killed_at, "ps-1 was never killed"
    assert report["restarts"]["ps"] == 0 and report["restarts"]["ps-2"] == 0
    lineage = read_jsonl(os.path.join(cfg.run_dir, "lineage.jsonl"))
    assert [r["step"] for r in lineage] == list(range(1, steps + 1))  # none trained twice
    consumed = [p for r in lineage for p in r["prompt_ids"]]
    assert len(consumed) == len(set(consumed))

    # each replica relayed versions to its own worker; worker-1 moved when ps-1 died
    moved = FAILED_OVER.findall(_log(cfg.run_dir, "worker-1"))
    assert moved and moved[0][0] == "worker-1" and moved[0][2].endswith(
        _port_of(cfg.run_dir, "ps-2")
    ), moved
    for w in ("worker-0", "worker-1", "worker-2"):
        loaded = [int(v) for v in LOADED.findall(_log(cfg.run_dir, w))]
        assert max(loaded) > killed_at[0] + 1, (w, loaded)  # versions after the kill reached it
    relayed = _log(cfg.run_dir, "ps-2")
    assert f"version {killed_at[0] + 2} relayed" in relayed

    # every prompt drawn is trained on or counted as dropped or skipped, none silently lost
    status = _final_status(cfg.run_dir)
    accounted = sum(
        status.get(k, 0)
        for k in ("trained_groups", "dropped_stale", "dropped_zero_variance", "skipped_prompts",
                  "queued", "in_flight", "buffered", "scoring")
    )  # fmt: skip
    assert status["drawn"] == accounted, status
    assert status["trained_groups"] == steps * cfg.rollout.prompts_per_step


def _port_of(run_dir: str, job: str) -> str:
    """The port ``job`` listened on (its `ps serve --port`), from the run's plan in its log."""
    m = re.search(r"listening on (http://\S+)", _log(run_dir, job))
    assert m, job
    return m.group(1).rsplit(":", 1)[1]


def _final_status(run_dir: str) -> dict:
    m = re.findall(r"controller done at step \d+: (\{.*\})", _log(run_dir, "controller"))
    assert m, "no final controller status"
    return json.loads(m[-1].replace("'", '"'))
