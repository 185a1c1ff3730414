"""glibc malloc settings for a long-running process that computes with XLA on the host CPU.

XLA:CPU allocates each execution's temporary buffer with ``malloc`` on one of its pool threads:
75 MB for the tiny preset's train step. glibc serves a block that large from a fresh ``mmap``
(a pool thread's arena holds at most 64 MB) and unmaps it when freed, so every execution
page-faults the whole buffer in again: 18k minor faults and ~30 ms of system time per train step
on 2 CPU cores, beside ~28 ms of work. ``keep_freed_memory`` routes every thread to the main
heap, serves large blocks from it and keeps the freed memory there, so the next execution
reuses the same pages (the step: 0.039-0.047 s -> 0.028-0.030 s).

Freed memory is never trimmed (``NEVER_TRIM``): glibc gives back the whole free top of the heap
once it exceeds the trim threshold, and a threshold (an ``int``, at most 2 GiB) below a step's
temporary gives all of it back after every execution. The 30M benchmark model's train step
(32 x 144 tokens, a 32k vocabulary) allocates 3 GB: with a 1 GiB threshold every step
page-faulted it in again (770k faults, 2 s of kernel time per step on 2 cores: 6.8 s a step;
never trimmed, 5.6 s). The process keeps its peak heap, which each step reaches anyway.

A long-running command (``rlax colocated``, ``trainer``, ``worker``) calls
``tune_if_host_compute`` first, before JAX starts its threads (an arena is picked at a thread's
first allocation). Processes on an accelerator keep glibc's defaults: their XLA buffers live in
device memory, and many host threads would then share one heap lock.

The heap is also backed by transparent huge pages (``with_huge_pages``): XLA:CPU's buffers span
tens of thousands of 4 KiB pages. In alternating runs on 2 cores the tiny preset's train step
took 29.8-32.8 ms on 4 KiB pages against 26.1-29.9 ms on 2 MiB ones (a colocated step 68.7-77.6
against 61.9-69.3 ms; a train step compiled in the same process 38.0-40.2 against 30.5-33.9 ms),
at the same resident size. glibc asks for them only when its ``glibc.malloc.hugetlb`` tunable
is set, and reads it once, at process start: so the launchers (``rlax run``'s supervisor, the
job runner) set it in the environment of the processes they start. A command started by hand
runs on 4 KiB pages unless its environment sets it (``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``).
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
import platform
from collections.abc import Mapping

log = logging.getLogger(__name__)

# mallopt parameters (glibc's malloc.h)
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
# mallopt's M_TRIM_THRESHOLD value for "never give the free top of the heap back" (mallopt(3))
NEVER_TRIM = -1
# glibc (2.35+) tunable: malloc advises the kernel to back the memory it maps with transparent
# huge pages (madvise; the system's setting "madvise" or "always" lets it)
HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb"
# modules of JAX's accelerator runtimes: a process may compute on one when any is installed
ACCELERATOR_MODULES = (
    "jax_cuda12_plugin",
    "jax_cuda13_plugin",
    "jax_rocm60_plugin",
    "jax_rocm7_plugin",
    "libtpu",
)


def computes_on_host(env: Mapping[str, str] | None = None) -> bool:
    """Whether JAX will compute on the CPU in a process with environment ``env`` (default: this
    one's): ``JAX_PLATFORMS`` names only ``cpu``, or it is unset and no accelerator runtime is
    installed (JAX then has only its CPU backend)."""
    env = os.environ if env is None else env
    platforms = {p.strip() for p in env.get("JAX_PLATFORMS", "").split(",") if p.strip()}
    if platforms:
        return platforms == {"cpu"}
    return not any(importlib.util.find_spec(name) for name in ACCELERATOR_MODULES)


def is_glibc() -> bool:
    """Whether this process runs on Linux with glibc (the malloc these settings are for)."""
    return platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def _tunables(env: Mapping[str, str]) -> list[str]:
    """The ``name=value`` entries of ``env``'s ``GLIBC_TUNABLES``."""
    return [t for t in env.get("GLIBC_TUNABLES", "").split(":") if t]


def with_huge_pages(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` for a new process, with its malloc heap on transparent huge pages
    (``HUGE_PAGES_TUNABLE=1`` added to ``GLIBC_TUNABLES``) when the process will compute on the
    host CPU; as given otherwise, or when ``GLIBC_TUNABLES`` already sets that tunable."""
    env = dict(env)
    tunables = _tunables(env)
    if not is_glibc() or not computes_on_host(env):
        return env
    if any(t.split("=", 1)[0] == HUGE_PAGES_TUNABLE for t in tunables):
        return env  # the user's choice stands
    env["GLIBC_TUNABLES"] = ":".join([*tunables, f"{HUGE_PAGES_TUNABLE}=1"])
    return env


def keep_freed_memory(trim_threshold: int = NEVER_TRIM) -> bool:
    """One heap for every thread, large blocks from it (no per-allocation ``mmap``), freed
    memory kept for reuse (up to ``trim_threshold`` bytes at the top of the heap; ``NEVER_TRIM``:
    all of it). False (nothing changed) without glibc."""
    if trim_threshold != NEVER_TRIM and not 0 <= trim_threshold < 2**31:
        # mallopt takes a C int: a larger value would wrap around (16 GiB reads as 0)
        raise ValueError(
            f"trim_threshold must be NEVER_TRIM or in [0, 2**31), got {trim_threshold}"
        )
    if not is_glibc():
        return False
    libc = ctypes.CDLL(None)
    settings = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, trim_threshold))
    applied = all(libc.mallopt(name, value) == 1 for name, value in settings)
    if not applied:
        log.warning("glibc refused a malloc setting; XLA:CPU buffers may page-fault each step")
    return applied


def tune_if_host_compute() -> bool:
    """``keep_freed_memory`` when this process computes on the CPU (``computes_on_host``);
    returns whether it was applied."""
    if not computes_on_host():
        return False
    applied = keep_freed_memory()
    if applied:
        huge = f"{HUGE_PAGES_TUNABLE}=1" in _tunables(os.environ)
        log.debug(
            "malloc: one heap, freed memory kept (XLA:CPU temporaries reused), %s",
            "on huge pages" if huge else f"on 4 KiB pages (no {HUGE_PAGES_TUNABLE}=1)",
        )
    return applied
