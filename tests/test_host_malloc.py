"""glibc malloc settings for XLA:CPU processes (rlax_tasks.process.host_malloc)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from rlax_tasks.process import host_malloc

# a jitted program whose temporary (the [4096, columns] product: 96 MB at 6144 columns)
# XLA:CPU allocates per call
PROBE = """
import json, resource, sys, time
if sys.argv[1] == "tuned":
    from rlax_tasks.process.host_malloc import keep_freed_memory
    assert keep_freed_memory()
import jax, jax.numpy as jnp
columns = int(sys.argv[2])
x, w, w2 = jnp.ones((4096, 64)), jnp.ones((64, columns)), jnp.ones((columns, 8))
f = jax.jit(lambda x, w, w2: jnp.sin(x @ w) @ w2)
f(x, w, w2).block_until_ready()
faults = []
for _ in range(int(sys.argv[3])):
    # XLA frees a call's temporary on its own thread just after the result is ready: a call at
    # once may allocate before that free (a new block, faulted in). A train step's next call
    # comes after the host's work on the last one's results; this pause stands for it
    time.sleep(0.1)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    f(x, w, w2).block_until_ready()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
with open("/proc/self/smaps_rollup") as fh:  # the heap's bytes on transparent huge pages
    huge = next(int(line.split()[1]) << 10 for line in fh if line.startswith("AnonHugePages:"))
print(json.dumps({"fewest_faults": min(faults), "huge_page_bytes": huge}))
"""

# the host-compute environment the probe runs in
HOST_ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}


def _probe(mode: str, columns: int = 6144, calls: int = 8, env: dict | None = None) -> dict:
    """PROBE's figures, run in a process with environment ``env`` (default: ``HOST_ENV``)."""
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode, str(columns), str(calls)],
        env=HOST_ENV if env is None else env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _fewest_faults_of_a_call(mode: str, columns: int = 6144, calls: int = 8) -> int:
    """The fewest page faults of ``calls`` calls: a VM's memory reclaim may take idle pages
    back between calls (then faulted in again), but it cannot make a fresh mapping fault less."""
    return _probe(mode, columns, calls)["fewest_faults"]


glibc_only = pytest.mark.skipif(not host_malloc.is_glibc(), reason="glibc only")


@glibc_only
def test_an_xla_cpu_temporary_is_reused_not_faulted_in_at_every_call():
    pages = 4096 * 6144 * 4 / 4096  # the temporary's 4 KiB pages
    default = _fewest_faults_of_a_call("default")
    tuned = _fewest_faults_of_a_call("tuned")
    assert default > 0.5 * pages  # glibc maps it afresh at every call
    assert tuned < 0.05 * pages  # the same pages again


@glibc_only
def test_a_temporary_above_any_trim_threshold_is_kept_too():
    """A 1.3 GB temporary (a 30M-parameter model's train step allocates 3 GB): above the 1 GiB
    trim threshold once used, glibc gave the whole heap top back after every call."""
    columns = 80_000
    pages = 4096 * columns * 4 / 4096
    assert _fewest_faults_of_a_call("tuned", columns, calls=3) < 0.05 * pages


def _transparent_huge_pages() -> str:
    """The kernel's transparent huge page mode: always, madvise or never ("" if unknown)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as fh:
            return fh.read().split("[", 1)[1].split("]", 1)[0]
    except (OSError, IndexError):
        return ""


@glibc_only
@pytest.mark.skipif(
    _transparent_huge_pages() != "madvise", reason="needs transparent huge pages on madvise"
)
def test_a_launched_host_compute_process_keeps_xla_temporaries_on_huge_pages():
    plain = {k: v for k, v in HOST_ENV.items() if k != "GLIBC_TUNABLES"}
    temporary = 4096 * 6144 * 4

    def huge_page_bytes(env: dict) -> int:
        return _probe("tuned", calls=3, env=env)["huge_page_bytes"]

    assert huge_page_bytes(host_malloc.with_huge_pages(plain)) >= 0.5 * temporary
    assert huge_page_bytes(plain) < 0.25 * temporary  # glibc alone asks for none


def test_huge_pages_go_to_host_compute_processes_beside_the_users_tunables(monkeypatch):
    monkeypatch.setattr(host_malloc, "is_glibc", lambda: True)
    cpu = {"JAX_PLATFORMS": "cpu", "PATH": "/bin"}
    assert host_malloc.with_huge_pages(cpu) == {**cpu, "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    theirs = {**cpu, "GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.mem.tagging=0"}
    assert host_malloc.with_huge_pages(theirs)["GLIBC_TUNABLES"] == (
        "glibc.malloc.arena_max=2:glibc.mem.tagging=0:glibc.malloc.hugetlb=1"
    )
    declined = {**cpu, "GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}
    assert host_malloc.with_huge_pages(declined) == declined  # the user's choice stands
    accelerator = {"JAX_PLATFORMS": "tpu"}
    assert host_malloc.with_huge_pages(accelerator) == accelerator
    assert "GLIBC_TUNABLES" not in cpu  # the caller's mapping is not changed
    monkeypatch.setattr(host_malloc, "is_glibc", lambda: False)
    assert host_malloc.with_huge_pages(cpu) == cpu


def test_a_trim_threshold_mallopt_cannot_take_is_refused():
    with pytest.raises(ValueError, match="trim_threshold"):
        host_malloc.keep_freed_memory(16 << 30)  # would wrap to 0 in mallopt's int


@pytest.mark.parametrize(
    ("platforms", "expected"),
    [("cpu", True), (" cpu ", True), ("cuda", False), ("cpu,cuda", False), ("tpu", False)],
)
def test_jax_platforms_decides_where_the_process_computes(monkeypatch, platforms, expected):
    monkeypatch.setenv("JAX_PLATFORMS", platforms)
    assert host_malloc.computes_on_host() is expected


def test_without_jax_platforms_an_installed_accelerator_runtime_decides(monkeypatch):
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    installed: set[str] = set()
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name in installed else None
    )
    assert host_malloc.computes_on_host()
    installed.add("libtpu")
    assert not host_malloc.computes_on_host()


def test_an_accelerator_process_keeps_glibc_defaults(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    calls = []
    monkeypatch.setattr(host_malloc, "keep_freed_memory", lambda: calls.append(1) or True)
    assert host_malloc.tune_if_host_compute() is False
    assert calls == []
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert host_malloc.tune_if_host_compute() is True
    assert calls == [1]
