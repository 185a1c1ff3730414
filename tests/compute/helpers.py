"""Shared test helpers: the stand-in job program, waiting, and the fake Cloud TPU API process."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

JOB_PROGRAM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "job_program.py")
# `<entrypoint> <argv>` runs the stand-in program instead of the (slow to import) rlax CLI
ENTRYPOINT = [sys.executable, JOB_PROGRAM]
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def wait_for(fn: Callable[[], Any], timeout_s: float = 30.0, every_s: float = 0.1) -> Any:
    """Polls ``fn`` until it returns something truthy; fails the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {fn}")
        time.sleep(every_s)


@contextlib.contextmanager
def fake_cloud_tpu(log_dir: str, provision_delay_s: float = 0.3) -> Iterator[str]:
    """``python -m infra.fakes.cloud_tpu --port 0`` as a process; yields its URL."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "infra.fakes.cloud_tpu",
            "--port",
            "0",
            "--provision-delay",
            str(provision_delay_s),
            "--log-dir",
            log_dir,
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        url = proc.stdout.readline().strip()
        assert url.startswith("http://"), f"fake did not print its URL: {url!r}"
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def preempt(url: str, name: str) -> dict:
    import requests

    reply = requests.post(f"{url}/fake/preempt", json={"name": name}, timeout=10)
    reply.raise_for_status()
    return reply.json()


def read_counter(path: str) -> int:
    """The step the stand-in ``count`` job has checkpointed (0 before its first step)."""
    try:
        with open(path) as fh:
            return int(fh.read() or 0)
    except FileNotFoundError:
        return 0
