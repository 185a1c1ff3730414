"""``lineage.jsonl``: one JSON line per training step (docs/design.md §7): the version it produced,
the prompt ids consumed with their rollout versions, the groups dropped and prompts skipped since.

Appending is idempotent on resume and a cut-off last line is dropped on open; ``restore`` puts
back a committed step's missing line, rebuilt from ``rollouts/`` and marked ``"restored"``."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from rlax_tasks.controller.buffer import Batch
from rlax_tasks.controller.rollouts import read_step_batch
from rlax_tasks.rundir import storage
from rlax_tasks.rundir.paths import run_paths

log = logging.getLogger(__name__)


def lineage_record(step: int, batch: Batch) -> dict[str, Any]:
    """The lineage line of the trainer step ``step`` that trained on ``batch``."""
    return {
        "step": step,
        "version": batch.version,
        "prompt_ids": batch.prompt_ids,
        "rollout_versions": batch.rollout_versions,
        # per group, [[version, tokens sampled with it], ...]: a group continued on newer
        # weights mid-sequence holds several
        "token_versions": [g.version_counts() for g in batch.groups],
        "dropped_stale": [
            {"prompt_id": d.prompt_id, "version": d.version}
            for d in batch.dropped
            if d.reason == "stale"
        ],
        "dropped_zero_variance": [
            {"prompt_id": d.prompt_id, "version": d.version}
            for d in batch.dropped
            if d.reason == "zero_variance"
        ],
        "skipped_prompts": [s.to_dict() for s in batch.skipped],
    }


def _parse(data: bytes, path: str) -> tuple[list[dict[str, Any]], int]:
    """(complete records, byte length of the valid prefix); a bad last line is dropped."""
    records, good = [], 0
    lines = data.split(b"\n")
    for i, line in enumerate(lines):
        last = i == len(lines) - 1
        if not line:
            if not last:
                good += 1
            continue
        try:
            record = json.loads(line)
            if last:  # no newline after it: the write was cut short
                raise ValueError("no trailing newline")
        except ValueError:
            if last or all(not rest for rest in lines[i + 1 :]):
                log.warning("%s: dropping a truncated last line (%d bytes)", path, len(line))
                break
            raise ValueError(f"{path}: line {i + 1} is not valid JSON; fix or remove it") from None
        records.append(record)
        good += len(line) + 1
    return records, good


class LineageWriter:
    """Appends lineage records to run_dir/lineage.jsonl, once per step."""

    def __init__(self, run_dir: str) -> None:
        self.path = run_paths(run_dir).lineage
        data = storage.read_bytes(self.path) if storage.exists(self.path) else b""
        self._records, good = _parse(data, self.path)
        if good != len(data):
            self._rewrite(data[:good])
        self._steps = {r["step"] for r in self._records}

    @property
    def records(self) -> list[dict[str, Any]]:
        return list(self._records)

    def has(self, step: int) -> bool:
        return step in self._steps

    def append(self, record: dict[str, Any]) -> bool:
        """Writes ``record`` unless its step is already recorded; returns whether it wrote."""
        step = record["step"]
        if step in self._steps:
            old = next(r for r in self._records if r["step"] == step)
            if old != record:
                log.warning(
                    "step %d is already in %s with different content; kept", step, self.path
                )
            return False
        line = json.dumps(record, sort_keys=True).encode() + b"\n"
        if storage.is_gcs(self.path):
            current = b"".join(
                json.dumps(r, sort_keys=True).encode() + b"\n" for r in self._records
            )
            storage.write_bytes(self.path, current + line)
        else:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            with open(self.path, "ab") as fh:
                fh.write(line)
                fh.flush()
                os.fsync(fh.fileno())
        self._records.append(record)
        self._steps.add(step)
        return True

    def restore(self, records: list[dict[str, Any]]) -> list[int]:
        """Puts back records of committed steps missing from the file, in step order (the
        file is rewritten whole); returns the steps restored."""
        new = [r for r in records if r["step"] not in self._steps]
        if not new:
            return []
        merged = sorted(self._records + new, key=lambda r: r["step"])
        data = b"".join(json.dumps(r, sort_keys=True).encode() + b"\n" for r in merged)
        storage.write_bytes(self.path, data)  # whole, atomically (temp + rename locally)
        self._records = merged
        self._steps.update(r["step"] for r in new)
        return sorted(r["step"] for r in new)

    def _rewrite(self, data: bytes) -> None:
        if storage.is_gcs(self.path):
            storage.write_bytes(self.path, data)
        else:
            with open(self.path, "r+b") as fh:
                fh.truncate(len(data))


def recovered_record(
    run_dir: str, step: int, prompt_ids: list[str] | None = None
) -> dict[str, Any] | None:
    """The lineage line of committed step ``step`` rebuilt from ``rollouts/`` (the batch it
    trained on), or from ``prompt_ids`` (a snapshot's record of the step) when that file is
    gone; None when neither is there. It says ``"restored"`` from where."""
    try:
        record = lineage_record(step, read_step_batch(run_dir, step))
        source = "rollouts"
        if prompt_ids is not None and list(prompt_ids) != record["prompt_ids"]:
            log.warning("step %d: the snapshot's prompt ids differ from rollouts/: kept", step)
    except FileNotFoundError:
        if prompt_ids is None:
            return None
        record = {"step": step, "version": step, "prompt_ids": list(prompt_ids),
                  "rollout_versions": [], "token_versions": [], "dropped_stale": [],
                  "dropped_zero_variance": [], "skipped_prompts": []}  # fmt: skip
        source = "snapshot"
    record["restored"] = source
    return record


def read_lineage(run_dir: str) -> list[dict[str, Any]]:
    """The complete records of run_dir/lineage.jsonl (a truncated last line is ignored)."""
    path = run_paths(run_dir).lineage
    if not storage.exists(path):
        return []
    return _parse(storage.read_bytes(path), path)[0]
