"""Child processes that die with their parent: a parent-death signal set in the child itself,
so that a ``kill -9`` of a launcher (`rlax run`, a DAG task, a benchmark) leaves nothing running
(docs/design.md §13)."""

from __future__ import annotations

import os
import shutil
import sys

# Runs argv[2:] with SIGKILL as its parent-death signal (kept across exec): set here, in the
# child, because a preexec_fn would make the parent fork() with its threads (JAX's) running.
# The signal comes when the parent's starting thread dies: use a Supervisor from one
# long-lived thread (`rlax run`'s main thread).
_LAUNCHER = """
import ctypes, os, signal, sys
if ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0) != 0:
    sys.exit(f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(ctypes.get_errno())}")
if os.getppid() != int(sys.argv[1]):
    sys.exit(1)  # the parent died before prctl: nobody would kill this one later
os.execv(sys.argv[2], sys.argv[2:])
"""


def dies_with_parent(command: list[str]) -> list[str]:
    """``command`` started so that it dies with this process (Linux; elsewhere as it is)."""
    if not sys.platform.startswith("linux"):
        return command
    program = command[0] if os.sep in command[0] else shutil.which(command[0]) or command[0]
    return [sys.executable, "-c", _LAUNCHER, str(os.getpid()), program, *command[1:]]
