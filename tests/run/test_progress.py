"""The status line of a run (`rlax run`, `rlax airflow train`): read from the run's files only."""

from __future__ import annotations

import json
import os
import time

from rlax_tasks.run.progress import WINDOW_S, dropped_stale, format_duration, status_line
from rlax_tasks.rundir.paths import run_paths

NOW = 1_800_000_000.0  # the wall clock the status lines are computed at


def _append(path: str, *rows: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def _metrics(run_dir: str, steps: range, every_s: float, last_at: float = NOW) -> None:
    """Rows for ``steps``, one every ``every_s`` seconds, the last at ``last_at``."""
    last = steps[-1]
    _append(
        run_paths(run_dir).metrics,
        *({"step": s, "reward_mean": s / 10, "time": last_at - (last - s) * every_s}
          for s in steps),
    )  # fmt: skip


def test_status_line_reads_step_reward_dropped_version_rate_and_eta(tmp_path):
    run_dir = str(tmp_path)
    _metrics(run_dir, range(1, 6), every_s=0.5)  # 2 steps/s
    _append(run_paths(run_dir).lineage, {"step": 1, "dropped_stale": ["a", "b"]},
            {"step": 2, "dropped_stale": []}, {"step": 3, "dropped_stale": ["c"]})  # fmt: skip
    _append(run_paths(run_dir).weight_sync, {"step": 4, "push_s": 0.1})
    line = status_line(run_dir, 11, time.monotonic() - 65, now=NOW + 1)
    assert line == (
        "step 5/11  reward 0.500  dropped 3 stale  weights v4  2.00 steps/s  eta 3s  elapsed 1m 05s"
    )


def test_status_line_before_the_first_step(tmp_path):
    line = status_line(str(tmp_path), 300, time.monotonic() - 12, now=NOW)
    assert line == "step 0/300  waiting for the first step  elapsed 12s"


def test_the_step_never_exceeds_the_total_and_the_eta_is_never_negative(tmp_path):
    run_dir = str(tmp_path)
    _metrics(run_dir, range(1, 13), every_s=1.0)  # a resumed run given fewer steps than done
    line = status_line(run_dir, 10, time.monotonic(), now=NOW)
    assert line.startswith("step 10/10  ") and "eta 0s" in line and "weights v12" in line


def test_the_rate_is_recent_and_unknown_when_stalled_or_from_one_row(tmp_path):
    run_dir = str(tmp_path / "a")
    # an older launch at 0.1 step/s, then this one at 4 steps/s: the window is the recent rows
    _metrics(run_dir, range(1, 4), every_s=10.0, last_at=NOW - 1000)
    _metrics(run_dir, range(4, 11), every_s=0.25)
    assert "4.00 steps/s  eta 23s" in status_line(run_dir, 102, time.monotonic(), now=NOW)
    # nothing for longer than the window: no rate, no ETA (never a stale guess)
    later = NOW + WINDOW_S + 1
    assert "- steps/s  eta -" in status_line(run_dir, 100, time.monotonic(), now=later)
    one = str(tmp_path / "b")
    _metrics(one, range(7, 8), every_s=1.0)
    assert "step 7/9  reward 0.700  dropped 0 stale  weights v7  - steps/s  eta -" in (
        status_line(one, 9, time.monotonic(), now=NOW)
    )


def test_dropped_stale_reads_only_what_was_appended_and_starts_over_on_a_new_file(tmp_path):
    run_dir = str(tmp_path)
    lineage = run_paths(run_dir).lineage
    assert dropped_stale(run_dir) == 0
    _append(lineage, {"step": 1, "dropped_stale": ["a"]})
    with open(lineage, "a") as f:
        f.write('{"step": 2, "dropped_stale": ["b", "c"]')  # being written: read next time
    assert dropped_stale(run_dir) == 1
    with open(lineage, "a") as f:
        f.write("}\n")
    assert dropped_stale(run_dir) == 3
    os.remove(lineage)
    _append(lineage, {"step": 1, "dropped_stale": []})
    assert dropped_stale(run_dir) == 0


def test_format_duration():
    assert [format_duration(s) for s in (-3, 0, 59.4, 60, 3599, 3600, 7620)] == [
        "0s", "0s", "59s", "1m 00s", "59m 59s", "1h 00m", "2h 07m",
    ]  # fmt: skip
