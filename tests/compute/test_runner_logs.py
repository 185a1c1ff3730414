"""rlax_tasks.compute.runner on a gs:// status directory (GCS emulator): a running job's logs
reach GCS while it runs, so a job killed with its VM leaves them up to its last sync."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from rlax_tasks.compute import jobstatus
from rlax_tasks.compute.runner import runner_argv
from rlax_tasks.rundir import storage
from tests.compute.helpers import wait_for


def _log(status_dir: str, name: str) -> str:
    try:
        return storage.read_bytes(storage.join(status_dir, name)).decode()
    except FileNotFoundError:
        return ""


def test_a_killed_jobs_logs_are_on_gcs_up_to_its_last_sync(gcs_bucket):
    status_dir = storage.join(gcs_bucket, "jobs", "talker.1")
    # one line on each stream, then a second stderr line a little later, then a long sleep
    script = (
        "import sys, time; print('out one', flush=True); print('err one', file=sys.stderr, "
        "flush=True); time.sleep(1.5); print('err two', file=sys.stderr, flush=True); "
        "time.sleep(120)"
    )
    argv = runner_argv(status_dir, [sys.executable, "-c", script], 0.2, log_sync_s=0.5)
    runner = subprocess.Popen(argv, start_new_session=True)
    try:
        wait_for(lambda: "err two" in _log(status_dir, jobstatus.STDERR), timeout_s=30)
        assert _log(status_dir, jobstatus.STDOUT) == "out one\n"
    finally:
        os.killpg(runner.pid, signal.SIGKILL)  # the VM goes: no upload at the end
        runner.wait(timeout=10)
    assert _log(status_dir, jobstatus.STDERR) == "err one\nerr two\n"
    assert not storage.exists(storage.join(status_dir, jobstatus.EXIT))
