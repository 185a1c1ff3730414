"""What a person watching a run sees: the status line read from the run's files (metrics.jsonl,
lineage.jsonl, weight_sync.jsonl), and held-out pass@k measured every ``eval.every_steps`` steps
while the run goes (eval/progress.jsonl, and TensorBoard's tb/eval/ as "heldout/pass@k")."""

from __future__ import annotations

import io
import json
import logging
import os
import time
from typing import Any

from rlax_tasks.rundir import storage
from rlax_tasks.rundir.paths import run_paths
from rlax_tasks.trainer.scalar_export import log_scalars

log = logging.getLogger(__name__)

HELDOUT = "heldout"  # the TensorBoard / W&B group of the in-training held-out pass@k
TAIL_BYTES = 65536  # the end of metrics.jsonl read for a status line (~50 rows)
WINDOW_ROWS = 20  # steps/s over at most the last 20 steps...
WINDOW_S = 120.0  # ...of the last 2 minutes; none newer than that: stalled, no rate


def tail_json_lines(path: str, max_bytes: int = TAIL_BYTES) -> list[dict[str, Any]]:
    """The JSON objects of the last ``max_bytes`` of a JSONL file or gs:// object, oldest first
    (a line cut by the window or by a crash is skipped); [] when it is missing."""
    window = io.BytesIO()
    try:
        info = storage.stat(path)
        if info is None:
            return []
        storage.download_range(path, window, max(0, info.size - max_bytes), info.size)
    except (OSError, EOFError):  # (EOFError: cut since the stat, a restarted trainer's torn row)
        return []
    lines = window.getvalue().splitlines()
    rows = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def last_json_line(path: str) -> dict[str, Any] | None:
    """The last complete JSON object of a local JSONL file, or None."""
    rows = tail_json_lines(path)
    return rows[-1] if rows else None


def trained_step(run_dir: str) -> int:
    """The step of the last row of run_dir/metrics.jsonl (0 before the first): how far the run
    is."""
    rows = tail_json_lines(run_paths(run_dir).metrics)
    return next((int(r["step"]) for r in reversed(rows) if "step" in r), 0)


def format_duration(seconds: float) -> str:
    """``45s``, ``3m 05s``, ``2h 07m`` (never negative)."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    return f"{s // 3600}h {s % 3600 // 60:02d}m"


def steps_per_second(rows: list[dict[str, Any]], now: float) -> float | None:
    """Steps per second over the recent metrics rows (their "step" and wall-clock "time"): the
    last ``WINDOW_ROWS`` rows within ``WINDOW_S`` of the newest, at least two. None when there
    are fewer than two, or the newest is older than ``WINDOW_S`` (stalled, or a resumed run
    that has not stepped yet)."""
    timed = [
        (int(r["step"]), float(r["time"]))
        for r in rows
        if isinstance(r.get("step"), int) and isinstance(r.get("time"), int | float)
    ][-WINDOW_ROWS:]
    if len(timed) < 2 or now - timed[-1][1] > WINDOW_S:
        return None
    recent = [x for x in timed if x[1] >= timed[-1][1] - WINDOW_S]
    (s0, t0), (s1, t1) = (recent if len(recent) >= 2 else timed[-2:])[0], timed[-1]
    return (s1 - s0) / (t1 - t0) if t1 > t0 and s1 > s0 else None


_dropped_cache: dict[str, tuple[int, int]] = {}  # lineage path -> (bytes read, dropped so far)


def dropped_stale(run_dir: str) -> int:
    """Rollout groups dropped as too stale so far (lineage.jsonl "dropped_stale"), read
    incrementally: each call reads only what was appended since the last."""
    path = run_paths(run_dir).lineage
    offset, total = _dropped_cache.get(path, (0, 0))
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size < offset:  # replaced or cut: count again
                offset, total = 0, 0
            f.seek(offset)
            data = f.read()
    except OSError:
        return 0
    data = data[: data.rfind(b"\n") + 1]  # a line being written is read next time
    for line in data.splitlines():
        try:
            total += len(json.loads(line).get("dropped_stale") or ())
        except (ValueError, AttributeError, TypeError):
            continue
    _dropped_cache[path] = (offset + len(data), total)
    return total


def status_line(run_dir: str, steps: int, started: float, *, now: float | None = None) -> str:
    """One line of a run's progress, from its files only: ``step 12/300  reward 0.412 ...  eta``.

    ``steps``: the run's total; ``started``: ``time.monotonic()`` at launch; ``now``: the wall clock
    (metrics rows carry wall-clock "time"). The step never exceeds ``steps``; the ETA is never
    negative ("-" while unknown)."""
    now = time.time() if now is None else now
    paths = run_paths(run_dir)
    elapsed = format_duration(time.monotonic() - started)
    rows = tail_json_lines(paths.metrics)
    if not rows or not isinstance(rows[-1].get("step"), int):
        return f"step 0/{steps}  waiting for the first step  elapsed {elapsed}"
    last = rows[-1]
    step = min(max(0, last["step"]), steps)
    reward = last.get("reward_mean")
    reward_txt = f"{reward:.3f}" if isinstance(reward, int | float) else "-"
    synced = last_json_line(paths.weight_sync)  # pushed versions (a colocated run: none)
    version = synced["step"] if synced and isinstance(synced.get("step"), int) else last["step"]
    rate = steps_per_second(rows, now)
    if step >= steps:
        eta = "0s"
    else:
        eta = format_duration((steps - step) / rate) if rate else "-"
    rate_txt = f"{rate:.2f}" if rate else "-"
    return (
        f"step {step}/{steps}  reward {reward_txt}  dropped {dropped_stale(run_dir)} stale  "
        f"weights v{version}  {rate_txt} steps/s  eta {eta}  elapsed {elapsed}"
    )


class HeldOutProgress:
    """Held-out pass@k every ``eval.every_steps`` training steps while the run goes, as the
    held-out job (rlax_tasks.run.heldout) measures it.

    Appended to run_dir/eval/progress.jsonl: {"step", "version", "seconds" (wall seconds from this
    launch until the trainer produced that version), "pass@k"..., "eval_seconds"}."""

    def __init__(self, run_dir: str, t0: float) -> None:
        self.run_dir, self.t0 = run_dir, t0
        self.paths = run_paths(run_dir)
        self.path = self.paths.eval_progress
        self.recorded: set[int] = set()

    def _version_time(self, version: int) -> float | None:
        for row in storage.read_jsonl(self.paths.metrics):
            if row.get("step") == version and "time" in row:
                return float(row["time"])
        return None

    def record(self, step: int, result: dict[str, Any]) -> None:
        produced = self._version_time(step) if step else self.t0
        row = {
            "step": step,
            "version": result["version"],
            "seconds": None if produced is None else round(produced - self.t0, 3),
            **{k: v for k, v in result.items() if k.startswith("pass@")},
            "mean_reward": result.get("mean_reward"),
            "eval_seconds": result.get("seconds"),
        }
        storage.append_line(self.path, (json.dumps(row) + "\n").encode())
        self.recorded.add(int(result["version"]))
        # TensorBoard (tb/eval/, "heldout/pass@k") and W&B when configured
        scores = {k: v for k, v in row.items() if k.startswith("pass@") or k == "mean_reward"}
        log_scalars(self.run_dir, step, scores, HELDOUT)

    def record_result(self, result: dict[str, Any]) -> None:
        """Records one result of the held-out job at its version, once per version."""
        if int(result["version"]) not in self.recorded:
            self.record(int(result["version"]), result)
