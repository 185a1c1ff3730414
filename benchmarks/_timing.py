"""Shared helpers for the benchmarks: wall-clock timing, the matmul FLOP/s ceiling, peak RSS.
Every benchmark times ``warmup`` untimed calls, then ``repeats`` calls each synchronised
(``block_until_ready``) before the clock stops, and reports the median. It records the machine's
load before and after (``machine_load``) and marks figures ``[CONTENDED: ...]`` when other work
shared the CPU, so a figure from a busy machine is never taken for a real one."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any


def setup_logging() -> None:
    """The benchmarks' log lines: time, level, logger, message, at INFO."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


def block(result: Any) -> None:
    """Waits for every asynchronously dispatched array (JAX) in ``result``; no-op for the rest."""
    import jax

    for leaf in jax.tree_util.tree_leaves(result):
        if hasattr(leaf, "block_until_ready"):
            leaf.block_until_ready()


@dataclasses.dataclass(frozen=True)
class Timing:
    """Seconds per call over the timed repeats (plus the first warm-up call, which compiles)."""

    median_s: float
    min_s: float
    max_s: float
    times_s: tuple[float, ...]
    first_call_s: float | None
    # CPUs' worth of this process's CPU time during the timed calls (how many cores it used)
    own_cores: float
    # CPUs' worth of OTHER processes' busy time meanwhile (> ~0.1: the figures are contaminated)
    other_cores: float | None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def median_time(
    fn: Callable[[], Any],
    repeats: int = 5,
    warmup: int = 1,
    sync: Callable[[Any], None] = block,
) -> Timing:
    """Times ``fn()``: ``warmup`` untimed calls, then the median of ``repeats`` synchronised calls.

    The result of each call is dropped before the next one starts, so at most one output is alive.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    first = None
    for i in range(max(warmup, 0)):
        t0 = time.perf_counter()
        out = fn()
        sync(out)
        if i == 0:
            first = time.perf_counter() - t0
        del out
    times = []
    sys0, cpu0, wall0 = _system_busy_s(), time.process_time(), time.perf_counter()
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        sync(out)
        times.append(time.perf_counter() - t0)
        del out
    sys1, cpu1, wall = _system_busy_s(), time.process_time(), time.perf_counter() - wall0
    own = (cpu1 - cpu0) / wall
    other = None if sys0 is None or sys1 is None else max((sys1 - sys0) / wall - own, 0.0)
    return Timing(statistics.median(times), min(times), max(times), tuple(times), first, own, other)


def jax_matmul_peak(
    sizes: tuple[int, ...] = (2048, 4096), dtype: str = "float32", repeats: int = 5
) -> dict[str, Any]:
    """Best FLOP/s of ``jax.jit(lambda a, b: a @ b)`` on square matrices: the practical ceiling."""
    import jax
    import jax.numpy as jnp

    matmul = jax.jit(lambda a, b: a @ b)

    def operands(n: int) -> Callable[[], Any]:
        ka, kb = jax.random.split(jax.random.key(n))
        a = jax.random.normal(ka, (n, n), jnp.float32).astype(dtype)
        b = jax.random.normal(kb, (n, n), jnp.float32).astype(dtype)
        return lambda: matmul(a, b)

    return _best_matmul(sizes, operands, repeats)


def _best_matmul(
    sizes: tuple[int, ...], make_call: Callable[[int], Callable[[], Any]], repeats: int
) -> dict[str, Any]:
    """Times the n x n matmul ``make_call(n)`` for each size; reports the best FLOP/s."""
    per_size, others = {}, {}
    for n in sizes:
        t = median_time(make_call(n), repeats=repeats, warmup=1)
        per_size[n] = 2 * n**3 / t.median_s
        others[n] = t.other_cores
    best = max(per_size, key=per_size.get)
    return {
        "flops_per_s": per_size[best],
        "best_size": best,
        "per_size": per_size,
        "other_cores": others,
    }


def torch_matmul_peak(
    sizes: tuple[int, ...] = (2048, 4096), dtype: str = "float32", repeats: int = 5
) -> dict[str, Any]:
    """Best FLOP/s of ``a @ b`` in PyTorch (CPU) on square matrices (for reference)."""
    import torch

    tdtype = getattr(torch, dtype)

    def operands(n: int) -> Callable[[], Any]:
        g = torch.Generator().manual_seed(n)
        a = torch.randn(n, n, generator=g).to(tdtype)
        b = torch.randn(n, n, generator=g).to(tdtype)
        return lambda: a @ b

    with torch.inference_mode():
        return _best_matmul(sizes, operands, repeats)


def _system_busy_s() -> float | None:
    """CPU-seconds all processes have spent busy since boot (Linux /proc/stat), else None."""
    try:
        with open("/proc/stat") as fh:
            fields = [int(x) for x in fh.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    busy = sum(fields[:8]) - fields[3] - fields[4]  # user..steal minus idle and iowait
    return busy / os.sysconf("SC_CLK_TCK")


def busy_cores(interval_s: float = 1.0) -> float | None:
    """CPUs' worth of busy time (all processes) over ``interval_s`` while this one sleeps.

    Run before a benchmark: anything well above 0 means other work is competing for the CPU and
    the timings will be low and noisy. None where /proc/stat is unavailable (non-Linux).
    """
    a, t0 = _system_busy_s(), time.perf_counter()
    time.sleep(interval_s)
    b, elapsed = _system_busy_s(), time.perf_counter() - t0
    return None if a is None or b is None else (b - a) / elapsed


def log_busy_cores(log: logging.Logger) -> float | None:
    """``busy_cores()`` logged before a run, with a warning when other work shares the CPU."""
    busy = busy_cores()
    log.info("busy cores before start: %s (other work shares the machine when > 0.1)", busy)
    if busy is not None and busy > 0.2:
        log.warning("other processes keep %.2f CPUs busy: the timings will be slow and noisy", busy)
    return busy


# a machine counts as contended (figures low and noisy) above either threshold; the load
# average's is per core (0.5 on 2 cores), so a many-core accelerator host is not kept waiting
CONTENDED_BUSY_CORES = 0.2
CONTENDED_LOAD_PER_CORE = 0.25


def contended_load_1m() -> float:
    """The 1-minute load average above which this machine counts as contended."""
    return CONTENDED_LOAD_PER_CORE * max(2, os.cpu_count() or 2)


def machine_load(
    log: logging.Logger | None = None,
    when: str = "before",
    interval_s: float = 1.0,
    settle_s: float = 150.0,
) -> dict[str, Any]:
    """The load around a benchmark (``when`` "before" first thing, "after" at the end): load
    averages, ``busy_cores`` (other processes' CPUs while this one sleeps) and ``contended``:
    busy_cores > 0.2, or before the run a 1-minute load > 0.5 (given ``settle_s`` to decay when
    nothing else is busy). For ``contended_mark`` and the JSON's ``machine_load``."""
    busy = busy_cores(interval_s)
    load = _loadavg()
    # before a run: a high load average with nothing else busy is a process that just ended
    # (the average decays over a minute); wait up to settle_s for it to settle
    deadline = time.monotonic() + settle_s
    while (
        when == "before"
        and load is not None
        and load[0] > contended_load_1m()
        and (busy is None or busy <= CONTENDED_BUSY_CORES)
        and time.monotonic() < deadline
    ):
        if log is not None:
            log.info("load %.2f with no other work busy: waiting for it to settle", load[0])
        time.sleep(10.0)
        busy, load = busy_cores(interval_s), _loadavg()
    load_1m = None if load is None else load[0]
    contended = (busy is not None and busy > CONTENDED_BUSY_CORES) or (
        when == "before" and load_1m is not None and load_1m > contended_load_1m()
    )
    out = {
        "when": when,
        "load_1m": load_1m,
        "load_5m": None if load is None else load[1],
        "load_15m": None if load is None else load[2],
        "busy_cores": busy,
        "cpu_count": os.cpu_count(),
        "cpu": cpu_model(),
        "contended": bool(contended),
    }
    if log is not None:
        text = f"machine load {when}: {describe_load(out)}"
        if contended:
            log.warning("%s -- CONTENDED: other work shares the CPU, figures are low/noisy", text)
        else:
            log.info("%s", text)
    return out


# the widest vector instructions a CPU offers, as /proc/cpuinfo's flags name them: the same
# program's speed (torch's kernels, XLA's) differs by far more than a run's noise between them
VECTOR_FLAGS = (("amx_tile", "AMX"), ("avx512f", "AVX-512"), ("avx2", "AVX2"))


def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str | None:
    """'<model name>, <widest vector instructions>' of this machine's CPU (None when
    ``cpuinfo`` cannot be read): figures from two machines compare only when this matches."""
    try:
        with open(cpuinfo) as f:
            text = f.read()
    except OSError:
        return None
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    vector = next((name for flag, name in VECTOR_FLAGS if flag in flags), "no AVX2")
    return f"{fields.get('model name', platform.machine() or 'unknown CPU')}, {vector}"


def _loadavg() -> tuple[float, float, float] | None:
    try:
        return os.getloadavg()
    except OSError:  # not available on this platform
        return None


def describe_load(load: dict[str, Any] | None) -> str:
    """``machine_load``'s dict in words: the load, the cores busy with other work, the CPU."""
    if not load:
        return "load n/a"
    cpu = f" ({load['cpu']})" if load.get("cpu") else ""
    return (
        f"load {fmt_opt(load.get('load_1m'))} (1 min), {fmt_opt(load.get('busy_cores'))} of "
        f"{load.get('cpu_count')} cores busy with other work{cpu}"
    )


def contended_mark(*loads: dict[str, Any] | None) -> str:
    """Suffix for a figure line: ' [CONTENDED: load 1.9, busy 1.3 cores]' when any of the
    ``machine_load`` dicts given (before, after) is contended, else ''. It shows the highest
    busy_cores and the highest 1-minute load measured before a run (a load taken after one
    counts the benchmark itself)."""
    given = [x for x in loads if x]
    if not any(x.get("contended") for x in given):
        return ""
    before = [x["load_1m"] for x in given if x.get("when") != "after" and x.get("load_1m")]
    busy = max((x["busy_cores"] for x in given if x.get("busy_cores") is not None), default=None)
    load = f"load {max(before):.1f}, " if before else ""
    return f" [CONTENDED: {load}busy {fmt_opt(busy, 1)} cores]"


def add_rounds_option(ap: argparse.ArgumentParser) -> None:
    """``--rounds N`` of the comparisons with TRL (``round_orders`` runs them); N >= 1."""

    def rounds(text: str) -> int:
        n = int(text)
        if n < 1:
            raise argparse.ArgumentTypeError(f"give a positive number of rounds, got {n}")
        return n

    ap.add_argument(
        "--rounds",
        type=rounds,
        default=1,
        help="run every side this many times, ours first in odd rounds and TRL first in even\n"
        "ones; the ratios are then each round's and their median (a cloud VM's speed drifts\n"
        "by a third over minutes: one round can land a slow spell on one side)",
    )


def round_orders(sides: list[str], rounds: int) -> list[list[str]]:
    """The order each round runs ``sides`` in: as given in odd rounds, reversed in even ones, so
    that a drift of the machine's speed over the run reaches every side alike."""
    return [list(sides) if i % 2 == 0 else sides[::-1] for i in range(rounds)]


def fmt_opt(x: float | None, digits: int = 2) -> str:
    """``x`` with ``digits`` decimals, or "n/a" when it is None."""
    return "n/a" if x is None else f"{x:.{digits}f}"


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (``ru_maxrss``: KiB on Linux, B on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def fmt_si(x: float, unit: str = "") -> str:
    """1.23e10 -> '12.30 G' + unit."""
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {prefix}{unit}"
    return f"{x:.2f} {unit}"


def print_report(lines: list[str], results: dict[str, Any]) -> None:
    """Prints a benchmark's report ``lines``, closed by the run's peak RSS and wall time."""
    rss, wall = results["peak_rss_bytes"] / 2**20, results["wall_s"]
    lines = [*lines, f"peak RSS: {rss:,.0f} MiB; wall time {wall:.0f}s", ""]
    print("\n".join(lines), flush=True)


def write_json(path: str | None, results: dict[str, Any], log: logging.Logger) -> None:
    """Writes ``results`` as JSON to ``path`` (a benchmark's --json-out), if one was given."""
    if path:
        with open(path, "w") as fh:
            json.dump(results, fh, indent=2, default=str)
        log.info("wrote %s", path)


def run_in_fresh_process(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, launched=T, **kwargs)`` in a fresh "spawn" process, ``T`` the monotonic time
    just before it starts, so a clock from ``T`` counts the interpreter's start and imports.
    ``fn``: a module-level function returning something picklable; its exception or the process
    dying is raised here as RuntimeError with the child's traceback, never a hang."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    launched = time.monotonic()  # CLOCK_MONOTONIC: the same clock in every process of the host
    proc = ctx.Process(
        target=_fresh_process_main, args=(send, fn, args, {**kwargs, "launched": launched})
    )
    proc.start()
    send.close()  # the child holds the only sending end: its death ends the wait below
    try:
        status, value = receive.recv()
    except EOFError:
        status, value = "died", None
    finally:
        receive.close()
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
            proc.join()
    name = getattr(fn, "__name__", fn)
    if status == "died":
        raise RuntimeError(
            f"{name} in a fresh process died without a result (exit code {proc.exitcode})"
        )
    if status == "error":
        raise RuntimeError(f"{name} failed in its fresh process:\n{value}")
    return value


def _fresh_process_main(send: Any, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
    import traceback

    try:
        result = ("ok", fn(*args, **kwargs))
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
        result = ("error", traceback.format_exc())
    send.send(result)
    send.close()
