"""JAX's persistent compilation cache, shared by every process of a run.

A component restarted after a preemption (or a later run with the same shapes) loads its
compiled programs from run_root/jax-cache instead of compiling them again: most of its start-up.
A ``JAX_COMPILATION_CACHE_DIR`` set by the user wins over the run's directory."""

from __future__ import annotations

import logging
import os
from typing import Any

from rlax_tasks.rundir import storage

log = logging.getLogger(__name__)

DIR_ENV = "JAX_COMPILATION_CACHE_DIR"
MIN_SECONDS_ENV = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"
# JAX's default threshold skips most programs of a small model on CPU, which still add up in
# every process; a cache read costs far less than a compile
MIN_COMPILE_SECONDS = "0.1"


def cache_env(cfg: Any) -> dict[str, str]:
    """The environment that points a run's processes at its compilation cache ({} when off)."""
    if not cfg.compilation_cache:
        return {}
    return {
        DIR_ENV: os.environ.get(DIR_ENV) or storage.join(cfg.run_root, "jax-cache"),
        MIN_SECONDS_ENV: os.environ.get(MIN_SECONDS_ENV) or MIN_COMPILE_SECONDS,
    }


def enable_in_process(cfg: Any) -> None:
    """Turns the run's cache on in this process (the supervisor's evaluator, a benchmark)."""
    env = cache_env(cfg)
    if not env:
        return
    import jax  # lazy: the launchers import this module and stay JAX-free

    jax.config.update("jax_compilation_cache_dir", env[DIR_ENV])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(env[MIN_SECONDS_ENV]))
    log.debug("JAX compilation cache: %s", env[DIR_ENV])
