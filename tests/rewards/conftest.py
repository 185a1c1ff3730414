"""Fixtures for the reward verifier tests: a shared math verifier and host-safety checks."""

from __future__ import annotations

import os
import shutil
import time

import psutil
import pytest

from rlax_tasks.rewards import bubblewrap
from rlax_tasks.rewards.math import MathVerifier


@pytest.fixture(scope="session")
def math_verifier():
    """One small pool for the whole session (worker start-up imports sympy: ~1 s each)."""
    with MathVerifier(workers=2, timeout_s=3.0) as verifier:
        yield verifier


@pytest.fixture
def bwrap_required():
    """The code verifier needs bubblewrap; a missing install is a set-up error, not a skip."""
    if shutil.which("bwrap") is None:
        pytest.fail(
            "bubblewrap (bwrap) is not installed; run the project set-up "
            "(Debian: apt-get install -y bubblewrap)"
        )


def _bwrap_children() -> list[tuple[psutil.Process, str]]:
    """(process, status) of each bwrap below this test process."""
    out = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.name() == "bwrap":
                out.append((child, child.status()))
        except psutil.NoSuchProcess:
            pass
    return out


def _under_another_worker(proc: psutil.Process) -> bool:
    """Whether ``proc`` runs under another pytest-xdist worker of this session (a sibling of
    this worker): that worker's sandboxes are its own to check. An escaped process, re-parented
    away from every worker, is still everybody's finding."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return False
    me, controller = os.getpid(), os.getppid()
    try:
        for parent in proc.parents():
            if parent.pid == me:
                return False
            if parent.ppid() == controller:
                return True
    except psutil.Error:
        return False
    return False


def sandbox_processes(marker: str | None = None) -> list[str]:
    """Processes that belong to a sandbox: a bwrap under this test process, a process whose
    command line has `marker`, or (as root) a process running as a sandbox uid."""
    found = [f"{child.pid} bwrap child" for child, _ in _bwrap_children()]
    for proc in psutil.process_iter(["pid", "uids", "cmdline", "status"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            cmdline = " ".join(proc.info["cmdline"] or [])
            uid = proc.info["uids"].real if proc.info["uids"] else -1
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if (marker and marker in cmdline) or (os.geteuid() == 0 and uid >= bubblewrap.UID_BASE):
            if _under_another_worker(proc):
                continue
            found.append(f"{proc.info['pid']} uid={uid} {cmdline[:100]}")
    return found


def assert_no_sandbox_processes(marker: str | None = None, wait_s: float = 2.0) -> None:
    deadline = time.monotonic() + wait_s
    while True:
        left = sandbox_processes(marker)
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not left, f"processes survived the sandbox: {left}"


@pytest.fixture
def no_leftovers(bwrap_required):
    """Fails the test if any sandboxed process outlives it."""
    yield
    assert_no_sandbox_processes()


@pytest.fixture(autouse=True)
def no_unreaped_sandboxes():
    """Every bwrap this test started must have been waited for (no zombies either)."""
    yield
    left = [f"{child.pid} {status}" for child, status in _bwrap_children()]
    assert not left, f"bwrap processes left after the test: {left}"
