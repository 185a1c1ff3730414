"""The job runner: ``python -m rlax_tasks.compute.runner --status-dir DIR -- CMD...``.

It records itself in ``DIR/runner.json``, runs CMD in its process group, rewrites the heartbeat
while CMD runs, forwards SIGTERM/SIGINT, and writes ``DIR/exit.json`` when it ends. On a gs://
DIR logs go to a local directory, uploaded while CMD runs (what changed, every LOG_SYNC_S with a
heartbeat: a preempted VM's job leaves its log up to then) and when it ends (``jobstatus`` reads
the state back)."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import psutil

from rlax_tasks.compute import jobstatus
from rlax_tasks.process.host_malloc import with_huge_pages
from rlax_tasks.rundir import storage

log = logging.getLogger(__name__)

LOG_SYNC_S = 10.0  # the least time between two uploads of a running job's logs (gs:// only)


def runner_argv(
    status_dir: str,
    command: list[str],
    heartbeat_interval_s: float,
    log_sync_s: float = LOG_SYNC_S,
) -> list[str]:
    """The argv that runs ``command`` under this runner (what the backends and agents start)."""
    return [
        sys.executable,
        "-m",
        "rlax_tasks.compute.runner",
        "--status-dir",
        status_dir,
        "--heartbeat-interval",
        str(heartbeat_interval_s),
        "--log-sync",
        str(log_sync_s),
        "--",
        *command,
    ]


def run_job(
    status_dir: str,
    command: list[str],
    heartbeat_interval_s: float = 5.0,
    log_sync_s: float = LOG_SYNC_S,
) -> int:
    """Runs ``command`` while heartbeating into ``status_dir``; returns its return code. On a
    gs:// ``status_dir`` the logs are uploaded with a heartbeat at most every ``log_sync_s``."""
    me = psutil.Process()
    jobstatus.write_json(
        storage.join(status_dir, jobstatus.RUNNER),
        {
            "pid": os.getpid(),
            "create_time": me.create_time(),
            "host": socket.gethostname(),
            "started_at": time.time(),
            "command": command,
        },
    )
    if storage.exists(storage.join(status_dir, jobstatus.STOP)):
        # stopped before it started: record a SIGTERM death without running anything
        log.info("stop requested before the start of %s", command)
        jobstatus.write_json(
            storage.join(status_dir, jobstatus.EXIT),
            {"returncode": -signal.SIGTERM, "finished_at": time.time()},
        )
        return -signal.SIGTERM
    remote = storage.is_gcs(status_dir)
    log_dir = tempfile.mkdtemp(prefix="rlax-job-") if remote else status_dir
    os.makedirs(log_dir, exist_ok=True)
    out_path = os.path.join(log_dir, jobstatus.STDOUT)
    err_path = os.path.join(log_dir, jobstatus.STDERR)
    with open(out_path, "ab") as out, open(err_path, "ab") as err:
        child = subprocess.Popen(
            command,
            stdout=out,
            stderr=err,
            stdin=subprocess.DEVNULL,
            env=with_huge_pages(os.environ),  # see rlax_tasks.process.host_malloc
        )

    def forward(signum: int, _frame: object) -> None:
        if child.poll() is None:
            child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)

    done = threading.Event()
    logs = _LogSync(log_dir, status_dir) if remote else None

    def heartbeat() -> None:
        while not done.is_set():
            try:
                jobstatus.write_json(
                    storage.join(status_dir, jobstatus.HEARTBEAT),
                    {"time": time.time(), "pid": child.pid},
                )
            except Exception:  # noqa: BLE001 - a missed beat is tolerated; many are preemption
                log.warning("heartbeat write to %s failed", status_dir, exc_info=True)
            if logs is not None:
                try:
                    logs.sync(min_interval_s=log_sync_s)
                except Exception:  # noqa: BLE001 - the next sync (or the last) uploads them
                    log.warning("log upload to %s failed", status_dir, exc_info=True)
            done.wait(heartbeat_interval_s)

    beats = threading.Thread(target=heartbeat, name="heartbeat", daemon=True)
    beats.start()
    returncode = child.wait()
    done.set()
    beats.join()
    if logs is not None:
        logs.sync()
        shutil.rmtree(log_dir, ignore_errors=True)
    jobstatus.write_json(
        storage.join(status_dir, jobstatus.EXIT),
        {"returncode": returncode, "finished_at": time.time()},
    )
    return returncode


class _LogSync:
    """Uploads the job's stdout/stderr from ``log_dir`` to ``status_dir`` when they changed."""

    def __init__(self, log_dir: str, status_dir: str) -> None:
        self.log_dir, self.status_dir = log_dir, status_dir
        self.sizes: dict[str, int] = {}
        self.last = float("-inf")

    def sync(self, min_interval_s: float = 0.0) -> None:
        """Uploads each log whose size changed, unless the last sync is under
        ``min_interval_s`` old."""
        if time.monotonic() - self.last < min_interval_s:
            return
        self.last = time.monotonic()
        for name in (jobstatus.STDOUT, jobstatus.STDERR):
            path = os.path.join(self.log_dir, name)
            size = os.path.getsize(path)
            if self.sizes.get(name) == size:
                continue
            with open(path, "rb") as fh:
                storage.write_bytes(storage.join(self.status_dir, name), fh.read())
            self.sizes[name] = size


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rlax-job-runner", description=__doc__.splitlines()[0])
    p.add_argument("--status-dir", required=True)
    p.add_argument("--heartbeat-interval", type=float, default=5.0)
    p.add_argument(
        "--log-sync", type=float, default=LOG_SYNC_S, help="seconds between log uploads (gs://)"
    )
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("no command given after --")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s runner: %(message)s")
    rc = run_job(args.status_dir, command, args.heartbeat_interval, args.log_sync)
    # mirror the command's outcome (a signal death becomes 128+signal, as in a shell)
    return rc if rc >= 0 else 128 - rc


if __name__ == "__main__":
    sys.exit(main())
