"""Weight sync: a ``--gib`` version pushed to `rlax ps serve` until ``--workers`` workers hold it,
verified (same-host shared memory, then TCP), against the memcpy floor of the same bytes
(1 + workers times), steady state from version 3; then through a minimal Arrow Flight server
with the same guarantees, a comparison only (no product path). Last, delta pulls: real models
(tiny-arith's and the 30M benchmark model) trained by Adam at lr 1e-6, bf16 versions pulled over
TCP whole and as deltas, bytes and time against the memcpy floor.
``.venv/bin/python benchmarks/weight_sync.py [--gib 1] [--workers 4] [--no-tcp] [--no-flight]
[--only-delta]``"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _setup  # noqa: E402, F401  (the repository root on sys.path; JAX on the CPU by default)
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks._flight_sync import flight_push, flight_server, flight_worker  # noqa: E402
from benchmarks._timing import busy_cores, fmt_si  # noqa: E402
from rlax_tasks.paramserver.wire import (  # noqa: E402
    DEFAULT_CHUNK_BYTES,
    crc32c,
)

TOKEN = "weight-sync-benchmark"
CONTENDED_BUSY_CORES = 0.2


def _worker(
    url: str, worker_id: str, versions: int, results: mp.Queue, shared_memory: bool
) -> None:
    """Pulls each new version as soon as it appears; reports when it holds it."""
    from rlax_tasks.paramserver import ParameterServerClient

    client = ParameterServerClient(
        url, token=TOKEN, worker_id=worker_id, timeout_s=300, shared_memory=shared_memory
    )
    client.register()
    held = None
    for v in range(1, versions + 1):
        # into the previous version's arrays: preallocated, as a worker reuses its host buffers
        version, held = client.pull(min_version=v, out=held)
        done = time.time()
        nbytes = sum(a.nbytes for a in held.values())
        for name, a in held.items():  # the version's own values (make_params), first and last
            want = version * 100 + int(name.split(".")[1])
            assert a.flat[0] == want and a.flat[-1] == want, (name, version)
        client.ack(version)
        results.put({"worker": worker_id, "version": version, "done": done, "bytes": nbytes})
    client.deregister()
    del held


def memcpy_floor(nbytes: int, copies: int, repeats: int = 3) -> float:
    """Seconds to copy ``nbytes`` ``copies`` times with numpy (best of ``repeats``)."""
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(copies):
            np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return best


def checksum_rates(nbytes: int = 128 * 2**20, repeats: int = 3) -> dict[str, float]:
    """Bytes per second one core checksums in 8 MiB blocks: CRC32C (wire format 2) and sha256
    (format 1), with memcpy alongside, alternating, best of ``repeats``."""
    data = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(data)
    blocks = [data[i : i + DEFAULT_CHUNK_BYTES] for i in range(0, nbytes, DEFAULT_CHUNK_BYTES)]
    kinds = {
        "memcpy": lambda: np.copyto(dst, data),
        "crc32c": lambda: [crc32c(b) for b in blocks],
        "sha256": lambda: [hashlib.sha256(b).digest() for b in blocks],
    }
    best = dict.fromkeys(kinds, float("inf"))
    for _ in range(repeats):
        for kind, run in kinds.items():
            t0 = time.perf_counter()
            run()
            best[kind] = min(best[kind], time.perf_counter() - t0)
    return {kind: nbytes / s for kind, s in best.items()}


def make_params(nbytes: int, arrays: int, version: int) -> dict:
    """``arrays`` float32 jax arrays totalling ``nbytes``, different for every version."""
    import jax

    per = nbytes // arrays // 4
    rows = per // 1024
    out = {}
    for i in range(arrays):
        host = np.full((rows, 1024), float(version * 100 + i), np.float32)
        out[f"layers.{i}.kernel"] = jax.device_put(host)
    return out


def _stats(sync_s: list[float], push_s: list[float], converge_s: list[float]) -> dict:
    conv = np.asarray(converge_s)
    return {
        "sync_s": sync_s,
        "push_s": push_s,
        "sync_median_s": statistics.median(sync_s),
        "push_median_s": statistics.median(push_s),
        "converge_p50_s": float(np.percentile(conv, 50)),
        "converge_p99_s": float(np.percentile(conv, 99)),
    }


def _start_workers(ctx: object, target: object, worker_args: object, n: int) -> list:
    """``n`` started processes of ``ctx`` running ``target(*worker_args(i))``."""
    workers = [ctx.Process(target=target, args=worker_args(i)) for i in range(n)]
    for w in workers:
        w.start()
    return workers


def _drive(
    name: str,
    push: object,
    args: argparse.Namespace,
    nbytes: int,
    results: mp.Queue,
    workers: list,
) -> dict:
    """Pushes ``args.versions`` versions with ``push(version, params)``; each one's time until
    every worker reported holding it. Then waits for the ``workers`` to exit."""
    sync_s, converge_s, push_s = [], [], []
    for v in range(1, args.versions + 1):
        params = make_params(nbytes, args.arrays, v)
        t0 = time.time()
        push(v, params)
        pushed = time.time()
        dones = [results.get(timeout=600) for _ in range(args.workers)]
        assert all(d["version"] == v and d["bytes"] == nbytes for d in dones), dones
        end = max(d["done"] for d in dones)
        sync_s.append(end - t0)
        push_s.append(pushed - t0)
        converge_s.extend(d["done"] - pushed for d in dones)
        print(
            f"{name} version {v}: push {pushed - t0:.2f}s, held by all {args.workers} workers "
            f"after {end - t0:.2f}s ({nbytes * (1 + args.workers) / (end - t0) / 1e9:.2f} GB/s "
            "moved)"
        )
        del params
    for w in workers:
        w.join(timeout=120)
    return _stats(sync_s, push_s, converge_s)


def run_http(args: argparse.Namespace, nbytes: int, shared_memory: bool) -> dict:
    """The parameter server: `rlax ps serve` + ``args.workers`` pulling worker processes, which
    copy each version out of the server's shared memory or (``shared_memory`` False) receive it
    over TCP."""
    env = dict(os.environ, RLAX_PS_TOKEN=TOKEN)
    run_root = tempfile.mkdtemp(prefix="weight-sync-")
    server = subprocess.Popen(
        [sys.executable, "-m", "rlax_tasks.cli", "ps", "serve", "--port", "0",
         "--keep-versions", "1", "--run-root", run_root, "--mirror-every", "1000000"],
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )  # fmt: skip
    try:
        url = server.stdout.readline().strip()
        if not url.startswith("http://"):
            raise RuntimeError(f"server did not start (first line {url!r})")
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        workers = _start_workers(
            ctx,
            _worker,
            lambda i: (url, f"w{i}", args.versions, results, shared_memory),
            args.workers,
        )

        from rlax_tasks.paramserver import ParameterServerClient

        trainer = ParameterServerClient(url, token=TOKEN, timeout_s=300)
        deadline = time.time() + 120
        while len(trainer.status()["workers"]) < args.workers and time.time() < deadline:
            time.sleep(0.1)
        name = "shared memory" if shared_memory else "tcp"
        return _drive(name, trainer.push, args, nbytes, results, workers)
    finally:
        server.terminate()
        server.wait(timeout=30)


# --------------------------------------------------------------------------- Arrow Flight
def run_flight(args: argparse.Namespace, nbytes: int) -> dict:
    """The same versions through a Flight server process and ``args.workers`` Flight clients."""
    import pyarrow.flight as fl

    ctx = mp.get_context("spawn")
    ready, results = ctx.Queue(), ctx.Queue()
    server = ctx.Process(target=flight_server, args=(ready,), daemon=True)
    server.start()
    try:
        port = ready.get(timeout=120)
        workers = _start_workers(
            ctx, flight_worker, lambda i: (port, f"f{i}", args.versions, results), args.workers
        )
        client = fl.connect(f"grpc://127.0.0.1:{port}")
        time.sleep(2.0)  # the workers import and connect; they then wait in do_get
        push = functools.partial(flight_push, client, chunk_bytes=DEFAULT_CHUNK_BYTES)
        return _drive("flight", push, args, nbytes, results, workers)
    finally:
        server.terminate()
        server.join(timeout=30)


# --------------------------------------------------------------------------- deltas
def adam_versions(config: object, versions: int, lr: float = 1e-6) -> Iterator[dict]:
    """bf16 weights of ``versions`` versions of a float32 model trained by Adam at ``lr`` on the
    next-token loss of random token batches (a real gradient each step), as the trainer pushes
    them (``model.dtype`` bfloat16, float32 master weights)."""
    import jax
    import optax

    from rlax_tasks.models import Policy
    from rlax_tasks.models.forward import token_logprobs
    from rlax_tasks.paramserver import flatten_named

    policy = Policy.init(config, seed=0)
    graphdef, params = policy.graphdef, policy.params
    opt = optax.adam(lr)
    state = opt.init(params)

    @jax.jit
    def step(params: object, state: object, ids: jax.Array) -> tuple:
        grads = jax.grad(lambda p: -token_logprobs(graphdef, p, ids).mean())(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    rng = np.random.default_rng(0)
    for _ in range(versions):
        yield {k: np.asarray(v, ml_dtypes.bfloat16) for k, v in flatten_named(params).items()}
        ids = rng.integers(0, config.vocab_size, (4, 64), dtype=np.int32)
        params, state = step(params, state, ids)


def run_delta(name: str, config: object, versions: int) -> dict:
    """One worker pulling every version over TCP as deltas, one pulling it whole (in turn, from
    `rlax ps serve`): bytes received and seconds per version."""
    from rlax_tasks.paramserver import ParameterServerClient

    env = dict(os.environ, RLAX_PS_TOKEN=TOKEN)
    server = subprocess.Popen(
        [sys.executable, "-m", "rlax_tasks.cli", "ps", "serve", "--port", "0", "--keep-versions",
         "4", "--run-root", tempfile.mkdtemp(prefix="weight-sync-"), "--mirror-every", "1000000"],
        stdout=subprocess.PIPE, env=env, text=True,
    )  # fmt: skip
    try:
        url = server.stdout.readline().strip()
        trainer = ParameterServerClient(url, token=TOKEN, timeout_s=300)
        pullers = {
            kind: ParameterServerClient(
                url, token=TOKEN, worker_id=kind, timeout_s=300, shared_memory=False, delta=delta
            )
            for kind, delta in (("delta", True), ("whole", False))
        }
        rows, prev = [], None
        for v, params in enumerate(adam_versions(config, versions), start=1):
            trainer.push(v, params)
            row = {"version": v}
            for kind, client in pullers.items():
                t0 = time.perf_counter()
                _, got = client.pull(min_version=v)
                row[f"{kind}_s"] = time.perf_counter() - t0
                row[f"{kind}_bytes"] = client.last_pull.nbytes
                row[f"{kind}_base"] = client.last_pull.base
                client.ack(v)
            for k, want in params.items():
                assert np.array_equal(got[k].view(np.uint16), want.view(np.uint16)), k
            row["changed"] = None if prev is None else sum(
                int((params[k].view(np.uint16) != prev[k].view(np.uint16)).sum()) for k in params
            ) / sum(a.size for a in params.values())  # fmt: skip
            prev = params
            rows.append(row)
            print(
                f"delta {name} v{v}: whole {row['whole_bytes'] / 1e6:.2f} MB in "
                f"{row['whole_s']:.3f}s, delta {row['delta_bytes'] / 1e6:.3f} MB "
                f"({row['delta_bytes'] / row['whole_bytes']:.1%}, base {row['delta_base']}) in "
                f"{row['delta_s']:.3f}s"
                + ("" if row["changed"] is None else f"; {row['changed']:.2%} of elements changed")
            )
        return {"model": name, "rows": rows}
    finally:
        server.terminate()
        server.wait(timeout=30)


def delta_summary(result: dict) -> dict:
    """Medians over the delta pulls (versions 2 on) and the memcpy floor of one whole version."""
    rows = [r for r in result["rows"] if r["delta_base"] is not None]
    whole = rows[0]["whole_bytes"]
    floor_s = memcpy_floor(whole, 1)
    out = {
        "model": result["model"],
        "whole_bytes": whole,
        "delta_bytes_ratio": statistics.median(r["delta_bytes"] / r["whole_bytes"] for r in rows),
        "changed_frac": statistics.median(r["changed"] for r in rows),
        "whole_s": statistics.median(r["whole_s"] for r in rows),
        "delta_s": statistics.median(r["delta_s"] for r in rows),
        "floor_s": floor_s,
    }
    print(
        f"delta {out['model']:<14} {fmt_si(whole, 'B')} a version, {out['changed_frac']:.2%} of "
        f"elements change a step: delta pulls {out['delta_bytes_ratio']:.1%} of the bytes; "
        f"pull {out['delta_s']:.3f}s vs whole {out['whole_s']:.3f}s "
        f"({out['whole_s'] / out['delta_s']:.1f}x); memcpy floor of a whole version "
        f"{floor_s:.4f}s (delta {out['delta_s'] / floor_s:.1f}x it, whole "
        f"{out['whole_s'] / floor_s:.1f}x)"
    )
    return out


def run_deltas(versions: int) -> list[dict]:
    from benchmarks._models import rlax_config
    from rlax_tasks.warmup import WarmupRecipe

    models = {"tiny-arith": WarmupRecipe().model_config(), "30M benchmark": rlax_config()}
    results = [run_delta(name, config, versions) for name, config in models.items()]
    return [delta_summary(r) for r in results]


# --------------------------------------------------------------------------- main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0, help="size of one version in GiB")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument(
        "--versions",
        type=int,
        default=8,
        help="versions pushed (the first two allocate memory: see the steady-state figure)",
    )
    ap.add_argument("--arrays", type=int, default=16, help="arrays per version")
    ap.add_argument("--no-flight", action="store_true", help="skip the Arrow Flight comparison")
    ap.add_argument("--no-tcp", action="store_true", help="skip the workers-over-TCP variant")
    ap.add_argument("--only-delta", action="store_true", help="only the delta-pull section")
    ap.add_argument("--delta-versions", type=int, default=5, help="versions of the delta section")
    args = ap.parse_args()
    nbytes = int(args.gib * 2**30) // (args.arrays * 4096) * (args.arrays * 4096)

    busy = busy_cores()
    load = os.getloadavg()
    contended = busy is not None and busy > CONTENDED_BUSY_CORES
    mark = f"  [CONTENDED: {busy:.2f} cores busy before start]" if contended else ""
    busy_text = "n/a" if busy is None else f"{busy:.2f}"
    print(
        f"machine load at start: {busy_text} of {os.cpu_count()} cores busy with other work; "
        f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (1, 5, 15 min)"
        + ("  -> CONTENDED: the figures below are low and noisy" if contended else "")
    )
    if args.only_delta:
        print(json.dumps({"delta": run_deltas(args.delta_versions), "load_avg_before": load}))
        return 0
    floor_s = memcpy_floor(nbytes, 1 + args.workers)
    floor_gbs = nbytes * (1 + args.workers) / floor_s / 1e9
    print(
        f"floor: memcpy of {fmt_si(nbytes, 'B')} x {1 + args.workers} = {floor_s:.3f}s "
        f"({floor_gbs:.2f} GB/s)"
    )
    rates = checksum_rates()
    print(
        "one core, 8 MiB blocks: "
        + ", ".join(f"{k} {v / 1e9:.2f} GB/s" for k, v in rates.items())
        + f" (sha256 is {rates['memcpy'] / rates['sha256']:.1f}x a memcpy, "
        f"CRC32C {rates['memcpy'] / rates['crc32c']:.2f}x)"
    )
    # the checksum is computed by the trainer and checked by the server and by every worker
    crc_s = nbytes * (2 + args.workers) / rates["crc32c"] / (os.cpu_count() or 1)

    http = run_http(args, nbytes, shared_memory=True)
    tcp = None if args.no_tcp else run_http(args, nbytes, shared_memory=False)
    flight = None if args.no_flight else run_flight(args, nbytes)
    deltas = run_deltas(args.delta_versions)

    med = http["sync_median_s"]
    steady = statistics.median(http["sync_s"][2:]) if args.versions >= 4 else None
    print()
    print(f"version size        {fmt_si(nbytes, 'B')}, {args.workers} workers, "
          f"{args.versions} versions")  # fmt: skip
    print(f"sync time (median)  {med:.3f}s  = {nbytes * (1 + args.workers) / med / 1e9:.2f} GB/s "
          f"moved; {nbytes / med / 1e9:.2f} GB/s per version{mark}")  # fmt: skip
    print(f"push time (median)  {http['push_median_s']:.3f}s "
          f"({nbytes / http['push_median_s'] / 1e9:.2f} GB/s){mark}")  # fmt: skip
    print(f"memcpy floor        {floor_s:.3f}s  = {floor_gbs:.2f} GB/s")
    print(f"ratio sync / floor  {med / floor_s:.2f}x  (target <= 3x){mark}")
    if steady is not None:
        print(f"  steady state       {steady / floor_s:.2f}x  (median from version 3 on: the "
              f"server's segments and the workers' arrays reused){mark}")  # fmt: skip
    if tcp is not None:
        tmed = tcp["sync_median_s"]
        print(f"workers over TCP    {tmed:.3f}s = {tmed / floor_s:.2f}x the floor{mark}")
    print(f"CRC32C lower bound  {crc_s:.3f}s = {crc_s / floor_s:.2f}x the floor on this machine")
    print(
        f"per-worker convergence after the push returns: p50 {http['converge_p50_s']:.3f}s, "
        f"p99 {http['converge_p99_s']:.3f}s (n={args.versions * args.workers}){mark}"
    )
    if flight is not None and tcp is not None:
        fmed, tmed = flight["sync_median_s"], tcp["sync_median_s"]
        print(
            f"over TCP, hand-written HTTP framing: {tmed:.3f} s ({tmed / floor_s:.2f} x floor) vs "
            f"Arrow Flight: {fmed:.3f} s ({fmed / floor_s:.2f} x floor){mark}"
        )
    print(
        json.dumps(
            {
                "bytes": nbytes,
                "workers": args.workers,
                "sync_s": http["sync_s"],
                "push_s": http["push_s"],
                "floor_s": floor_s,
                "crc32c_bound_s": crc_s,
                "checksum_rates_bytes_per_s": rates,
                "ratio": med / floor_s,
                "steady_ratio": None if steady is None else steady / floor_s,
                "tcp": tcp,
                "tcp_ratio": None if tcp is None else tcp["sync_median_s"] / floor_s,
                "converge_p50_s": http["converge_p50_s"],
                "converge_p99_s": http["converge_p99_s"],
                "flight": flight,
                "flight_ratio": None if flight is None else flight["sync_median_s"] / floor_s,
                "delta": deltas,
                "cpu_count": os.cpu_count(),
                "busy_cores_before": busy,
                "load_avg_before": load,
                "contended": contended,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
