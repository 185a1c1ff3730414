"""glibc malloc settings for a long-running process that computes with XLA on the host CPU.

XLA:CPU mallocs a large temporary each execution; by default glibc maps and unmaps it, faulting
it in every step. Call ``tune_if_host_compute`` before JAX starts its threads. glibc reads its
huge-page tunable once at start, so launchers set it for their children (``with_huge_pages``)."""

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
    """One heap for every thread, large blocks from it (no per-allocation ``mmap``), freed memory
    kept for reuse (up to ``trim_threshold`` bytes at the top of the heap; ``NEVER_TRIM``: all of
    it, as a lower threshold gives a step's whole temporary back each step). False (nothing
    changed) without glibc."""
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
    returns whether it was applied. Accelerator processes keep glibc's defaults: their buffers
    live in device memory, and one heap would make many host threads share one lock."""
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
