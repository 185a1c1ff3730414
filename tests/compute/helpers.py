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
# the image the fake Cloud TPU API's registry holds (the cloud_tpu backend's `image` setting):
# its hosts pull it and run it through the docker stand-in, as TPU VMs do
FAKE_IMAGE = "us-docker.pkg.dev/rlax-test/rlax/rlax-tasks:test"
# all the fake's hosts and containers see of the test process: the GCS emulator's address (the
# route to GCS) and the shared JAX compilation cache (a speed-up)
FAKE_PASS_ENV = (
    "STORAGE_EMULATOR_HOST,JAX_COMPILATION_CACHE_DIR,JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"
)


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
def fake_cloud_tpu(
    log_dir: str, provision_delay_s: float = 0.3, image: str = FAKE_IMAGE
) -> Iterator[str]:
    """``python -m infra.fakes.cloud_tpu --port 0`` as a process (its registry holding
    ``image``); yields its URL. Its hosts' files (startup.log, docker/containers/*.log) are
    under ``log_dir``."""
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
            "--image",
            image,
        ],
        cwd=REPO,
        # a process of a multi-host slice waits up to 60 s for the others in the fake libtpu
        # (the hosts' agents start their processes seconds apart on a loaded machine)
        env={**os.environ, "RLAX_FAKE_PASS_ENV": FAKE_PASS_ENV, "RLAX_FAKE_LIBTPU_WAIT_S": "60"},
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


def fake_backend_settings(url: str, zone: str = "us-central2-b", **extra: Any) -> dict:
    """Settings of the cloud_tpu backend pointed at the fake API ``url``: project "proj",
    anonymous, the fake registry's image, a fast agent poll, plus ``extra`` (run_root,
    entrypoint)."""
    return {
        "project": "proj",
        "zone": zone,
        "api_endpoint": url,
        "anonymous": True,
        "image": FAKE_IMAGE,
        "agent_poll_s": 0.2,
        **extra,
    }


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


def fake_state(url: str) -> dict:
    """``GET /fake/state`` of the fake Cloud TPU API."""
    import requests

    reply = requests.get(f"{url}/fake/state", timeout=10)
    reply.raise_for_status()
    return reply.json()


def host_record(slice_root: str, host: int) -> dict | None:
    """What the node agent of ``host`` published (``<slice root>/hosts/<host>.json``)."""
    from rlax_tasks.compute import jobstatus

    return jobstatus.read_json(jobstatus.host_record_path(slice_root, host))


def read_vars(path: str) -> dict[str, str]:
    """The NAME=value lines a job printed (``job_program.py env``/``group``)."""
    from rlax_tasks.rundir import storage

    text = storage.read_bytes(path).decode()
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def tpu_slice_spec(name: str, accelerator_type: str, runtime_version: str, zone: str = "") -> Any:
    """A ``SliceSpec`` of Cloud TPU type ``accelerator_type`` for run "r1" (``zone`` "": the
    backend's)."""
    from rlax_tasks.compute import SliceSpec

    labels = {"rlax-run-id": "r1"}
    return SliceSpec(
        name, accelerator_type, runtime_version=runtime_version, labels=labels, zone=zone
    )
