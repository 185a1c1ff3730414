"""The run's JAX compilation cache: where it lives, how a user overrides it, and that it hits."""

from __future__ import annotations

import os
import subprocess
import sys

from rlax_tasks.config import load_config
from rlax_tasks.plan.compilation_cache import DIR_ENV, MIN_SECONDS_ENV, cache_env


def test_cache_lives_under_the_run_root_unless_the_user_says_otherwise(tmp_path, monkeypatch):
    monkeypatch.delenv(DIR_ENV, raising=False)
    monkeypatch.delenv(MIN_SECONDS_ENV, raising=False)
    cfg = load_config("tiny-arith", {"run_root": str(tmp_path)})
    assert cache_env(cfg) == {DIR_ENV: str(tmp_path / "jax-cache"), MIN_SECONDS_ENV: "0.1"}
    gcs = load_config("tiny-arith", {"run_root": "gs://bucket/runs"})
    assert cache_env(gcs)[DIR_ENV] == "gs://bucket/runs/jax-cache"
    monkeypatch.setenv(DIR_ENV, "/elsewhere")
    assert cache_env(cfg)[DIR_ENV] == "/elsewhere"
    assert cache_env(load_config("tiny-arith", {"compilation_cache": False})) == {}


_PROGRAM = """
import time, jax, jax.numpy as jnp
f = jax.jit(lambda x: jnp.tanh(x @ x.T).sum())
t0 = time.perf_counter(); f(jnp.ones((64, 64))).block_until_ready()
print(time.perf_counter() - t0)
"""


def test_a_second_process_loads_what_the_first_compiled(tmp_path, monkeypatch):
    """The environment cache_env gives a process makes JAX write, then read, the cache."""
    monkeypatch.delenv(DIR_ENV, raising=False)
    monkeypatch.delenv(MIN_SECONDS_ENV, raising=False)
    env = {**os.environ, **cache_env(load_config("tiny-arith", {"run_root": str(tmp_path)}))}
    env[MIN_SECONDS_ENV] = "0"  # this program compiles too fast for the run's threshold
    cache = tmp_path / "jax-cache"
    subprocess.run([sys.executable, "-c", _PROGRAM], env=env, check=True, capture_output=True)
    entries = sorted(p.name for p in cache.iterdir())
    assert any(name.startswith("jit_") for name in entries), entries
    mtimes = {p.name: p.stat().st_mtime_ns for p in cache.iterdir()}
    subprocess.run([sys.executable, "-c", _PROGRAM], env=env, check=True, capture_output=True)
    # a hit reads the entries; a miss would have written new ones
    assert {p.name: p.stat().st_mtime_ns for p in cache.iterdir()} == mtimes
