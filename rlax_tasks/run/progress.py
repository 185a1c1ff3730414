"""What a person watching a run sees: the status line read from metrics.jsonl, and held-out
pass@k measured every ``eval.every_steps`` steps while the run goes (eval/progress.jsonl)."""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

from rlax_tasks.run_paths import run_paths

log = logging.getLogger(__name__)


def last_json_line(path: str) -> dict[str, Any] | None:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 65536))
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            return json.loads(line)
        except ValueError:
            continue
    return None


def status_line(run_dir: str, steps: int, started: float) -> str:
    m = last_json_line(run_paths(run_dir).metrics) or {}
    step = m.get("step", 0)
    reward = m.get("reward_mean")
    elapsed = time.monotonic() - started
    eta = (elapsed / step * (steps - step)) if step else float("nan")
    reward_txt = f"{reward:.3f}" if isinstance(reward, float) else "-"
    return f"step {step}/{steps}  reward {reward_txt}  elapsed {elapsed:.0f}s  eta {eta:.0f}s"


class HeldOutProgress:
    """Held-out pass@k every ``eval.every_steps`` training steps while the run goes.

    Appended to run_dir/eval/progress.jsonl: {"step", "version", "seconds" (wall seconds from
    this launch until the trainer produced that version, from metrics.jsonl "time"), "pass@k"...,
    "eval_seconds"}. It runs in the supervisor process; training goes on meanwhile.
    """

    def __init__(self, evaluator: Any, run_dir: str, ps_url: str, token: str, t0: float) -> None:
        self.evaluator, self.run_dir, self.t0 = evaluator, run_dir, t0
        self.ps_url, self.token = ps_url, token
        self.paths = run_paths(run_dir)
        self.path = self.paths.eval_progress
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        last = last_json_line(self.paths.metrics) or {}
        self.done_step = int(last.get("step", 0))  # a resumed run evaluates new steps only
        self.client: Any = None

    def _version_time(self, version: int) -> float | None:
        from rlax_tasks.run.report import read_jsonl

        for row in read_jsonl(self.paths.metrics):
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
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")

    def maybe_evaluate(self, every: int) -> None:
        step = int((last_json_line(self.paths.metrics) or {}).get("step", 0))
        if step < (self.done_step // every + 1) * every:
            return
        from rlax_tasks.paramserver import ParameterServerClient, ParameterServerError

        if self.client is None:
            self.client = ParameterServerClient(self.ps_url, token=self.token)
        target = step // every * every
        try:  # that step's version (or a newer one), else whatever is newest
            result = self.evaluator.evaluate(self.client, version=target)
        except ParameterServerError:
            try:
                result = self.evaluator.evaluate(self.client)
            except ParameterServerError as e:
                log.warning("held-out evaluation at step %d skipped: %s", step, e)
                self.done_step = step
                return
        self.done_step = max(step, result["version"])
        self.record(result["version"], result)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
