"""The tiny-arith-moe preset end to end, as a user runs it (`rlax run --preset tiny-arith-moe`):
the warm-up builds its 4-expert Qwen3-MoE base, training replays the sampler's routes, and the
held-out pass@1 rises (measured: 0.138 -> 0.382 in 300 steps, benchmarks/README.md; the test
runs the first 150, where a CI run measured 0.133 -> 0.330). With XLA's default optimisation, as
a user's run has it: its 1,500 warm-up and 150 training steps run minutes, where TEST_XLA_FLAGS'
faster compiles (optimisation off) cost several times their saving."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rlax_tasks.controller import read_rollouts


def _jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.mark.slow
def test_tiny_arith_moe_learns_with_its_routes_replayed(tmp_path):
    # no forced devices (tests/conftest.py's 8) and no TEST_XLA_FLAGS: the job's CPU flags only
    env = {**os.environ, "XLA_FLAGS": ""}
    argv = [sys.executable, "-m", "rlax_tasks.cli", "run", "--preset", "tiny-arith-moe",
            "--run-root", str(tmp_path / "runs"), "--steps", "150"]  # fmt: skip
    out = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=900)  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    run_dir = tmp_path / "runs" / "tiny-arith-moe"
    progress = _jsonl(str(run_dir / "eval" / "progress.jsonl"))
    before, after = progress[0], progress[-1]
    assert (before["version"], after["version"]) == (0, 150)
    assert after["pass@1"] > before["pass@1"] + 0.15, (before, after)
    steps = _jsonl(str(run_dir / "metrics.jsonl"))
    assert all(s["moe/route_mismatch_frac"] == 0 for s in steps)  # every route replayed
    assert all(0 < s["moe/recorded_routes_frac"] < 1 for s in steps)
    rows = read_rollouts(str(run_dir))
    assert rows["routed_experts"].notna().all()
    assert {tuple(s) for s in rows["routed_experts_shape"]} == {(2, 2)}  # 2 layers, 2 per token
    assert "| pass@1 |" in out.stdout
