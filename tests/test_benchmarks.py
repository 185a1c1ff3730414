"""The benchmarks' own checks and reports: the TRL benchmarks say what to install before they
start, not minutes in (a fresh machine set up with ``scripts/setup.sh --test`` has neither TRL
nor ``datasets``); rollout.py prints the machine's load and marks contended figures."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import rl_throughput, vs_trl  # noqa: E402


@pytest.mark.parametrize(
    ("main", "argv"),
    [
        (vs_trl.main, ["--model-size", "30m"]),
        (vs_trl.main, []),
        (rl_throughput.main, []),
    ],
)
def test_a_missing_trl_side_package_stops_the_benchmark_at_once(monkeypatch, capsys, main, argv):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "datasets" else find_spec(name, *a),
    )
    monkeypatch.setattr(rl_throughput, "run", lambda *a, **k: pytest.fail("the benchmark ran"))
    monkeypatch.setattr(vs_trl, "base_model_dir", lambda: pytest.fail("the benchmark ran"))
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "datasets not installed" in err and "scripts/setup.sh --bench" in err


def test_only_ours_needs_no_trl(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    ran = []
    monkeypatch.setattr(rl_throughput, "run", lambda *a, **k: ran.append(a) or {})
    assert vs_trl.main(["--model-size", "30m", "--only", "ours"]) == 0
    assert ran


def test_rollout_figures_come_with_the_machine_load_and_a_contended_mark(capsys):
    from benchmarks import rollout

    quiet = {"when": "before", "load_1m": 0.1, "busy_cores": 0.0, "cpu_count": 2}
    after = {**quiet, "when": "after", "load_1m": 1.9}
    figures = ["[generate] ours 900 tok/s", "[swap] 20 ms"]
    rollout.print_figures(figures, {**quiet, "contended": False}, {**after, "contended": False})
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("rollout benchmark, machine load before: load 0.10 (1 min)")
    assert out[1:] == figures
    busy = {**after, "busy_cores": 1.2, "contended": True}  # another process held a core
    rollout.print_figures(figures, {**quiet, "contended": False}, busy)
    out = capsys.readouterr().out.splitlines()
    assert all(line.endswith("[CONTENDED: load 0.1, busy 1.2 cores]") for line in out[1:])
