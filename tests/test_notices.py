"""Notices: posted by components, read once each by whoever watches the run."""

from __future__ import annotations

import pytest

from rlax_tasks.rundir import notices
from rlax_tasks.rundir.paths import run_paths


def test_notices_are_read_once_each_in_order(tmp_path):
    run_dir = str(tmp_path / "run")
    assert notices.read_since(run_dir, 0) == ([], 0)
    notices.post(run_dir, "fallback", "snapshots/12.json set aside", source="controller")
    first, offset = notices.read_since(run_dir, 0)
    assert [n.format() for n in first] == ["[fallback] controller: snapshots/12.json set aside"]
    notices.post(run_dir, "fatal", "disk full", source="trainer")
    second, offset2 = notices.read_since(run_dir, offset)
    assert [(n.kind, n.source, n.message) for n in second] == [("fatal", "trainer", "disk full")]
    assert notices.read_since(run_dir, offset2) == ([], offset2)


def test_a_torn_last_line_waits_and_a_foreign_line_is_skipped(tmp_path):
    run_dir = str(tmp_path)
    notices.post(run_dir, "warning", "one", source="x")
    with open(run_paths(run_dir).notices, "a") as f:
        f.write("not json\n")
        f.write('{"kind": "warning", "message": "half')
    got, offset = notices.read_since(run_dir, 0)
    assert [n.message for n in got] == ["one"]
    with open(run_paths(run_dir).notices, "a") as f:
        f.write(' done", "source": "y"}\n')
    got, _ = notices.read_since(run_dir, offset)
    assert [n.message for n in got] == ["half done"]


def test_source_defaults_to_the_job_name(tmp_path, monkeypatch):
    monkeypatch.setenv("RLAX_JOB_NAME", "worker-3")
    notices.post(str(tmp_path), "warning", "slow")
    (n,), _ = notices.read_since(str(tmp_path), 0)
    assert n.source == "worker-3"


def test_unknown_kind_is_refused(tmp_path):
    with pytest.raises(ValueError, match="notice kind 'oops'"):
        notices.post(str(tmp_path), "oops", "x")
