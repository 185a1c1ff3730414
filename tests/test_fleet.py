"""The fleet simulation (benchmarks/fleet.py) end to end in its --quick form: real controller,
real parameter-server replicas (one of two killed half-way), simulated workers preempted and
joining. Every group the workers generated is accounted for, counted by the workers themselves
and by the fake trainer (outside the controller), and every version reached every worker."""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import fleet  # noqa: E402


@pytest.mark.slow
def test_quick_fleet_accounts_for_every_group_and_reaches_every_worker(tmp_path, capsys):
    out = tmp_path / "fleet.json"
    assert fleet.main(["--quick", "--out", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [r["replicas"] for r in runs] == [1, 2]
    for r in runs:
        books = r["accounting"]
        assert books["balanced"], books["checks"]
        w = books["workers"]
        assert w["generated"] > 0 and books["outcome"]["trained (trainer's count)"] > 0
        assert r["steps"] >= 1 and r["versions"], r["label"]
        assert r["every_worker_reached_every_version"], r["versions"]
        assert all(v["missing"] == 0 and v["reach_s"] is not None for v in r["versions"])
        assert r["first_version"]["reach_s"] is not None
        assert r["preempted"] > 0  # churn ran: groups were lost with workers and re-issued
        assert r["controller_error"] is None
    assert runs[1]["replica_killed"]
    assert "BALANCED" in capsys.readouterr().out
