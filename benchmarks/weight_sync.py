"""Weight sync through the parameter server vs the memcpy floor, in one run.

A trainer (this process) pushes a ``--gib`` GiB version to a parameter server (`rlax ps serve`,
its own process) while ``--workers`` worker processes wait in ``pull(min_version=v)``. Measured
per version: the time from the start of the push until every worker holds the version (pulled,
sha256-verified, in its memory) -- vs the floor: the time this machine needs to memcpy the same
bytes (1 + workers) times with numpy (one push + one pull per worker), measured in the same run.
Also: each worker's time to converge on a new version (p50, p99 over versions x workers).

    .venv/bin/python benchmarks/weight_sync.py [--gib 1] [--workers 4] [--versions 5]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

from benchmarks._timing import busy_cores, fmt_si  # noqa: E402

TOKEN = "weight-sync-benchmark"


def _worker(url: str, worker_id: str, versions: int, results: mp.Queue) -> None:
    """Pulls each new version as soon as it appears; reports when it holds it."""
    from rlax_tasks.paramserver import ParameterServerClient

    client = ParameterServerClient(url, token=TOKEN, worker_id=worker_id, timeout_s=300)
    client.register()
    held = None
    for v in range(1, versions + 1):
        held = None  # drop the old version before receiving the new one
        version, held = client.pull(min_version=v)
        done = time.time()
        nbytes = sum(a.nbytes for a in held.values())
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


def sha256_rate(nbytes: int = 256 * 2**20) -> float:
    """Bytes per second one core hashes with sha256 (every byte is hashed once per receiver)."""
    import hashlib

    data = np.ones(nbytes, np.uint8)
    t0 = time.perf_counter()
    for i in range(0, nbytes, 8 * 2**20):
        hashlib.sha256(data[i : i + 8 * 2**20]).digest()
    return nbytes / (time.perf_counter() - t0)


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0, help="size of one version in GiB")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--versions", type=int, default=5)
    ap.add_argument("--arrays", type=int, default=16, help="arrays per version")
    args = ap.parse_args()
    nbytes = int(args.gib * 2**30) // (args.arrays * 4096) * (args.arrays * 4096)

    print(f"busy cores before start: {busy_cores()} (other work shares the machine when > 0.1)")
    floor_s = memcpy_floor(nbytes, 1 + args.workers)
    floor_gbs = nbytes * (1 + args.workers) / floor_s / 1e9
    print(
        f"floor: memcpy of {fmt_si(nbytes, 'B')} x {1 + args.workers} = {floor_s:.3f}s "
        f"({floor_gbs:.2f} GB/s)"
    )

    # sha256 is computed by the trainer and checked by the server and by every worker
    hash_s = nbytes * (2 + args.workers) / sha256_rate() / (os.cpu_count() or 1)
    print(f"sha256 alone on all {os.cpu_count()} cores: >= {hash_s:.3f}s per version")

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
        workers = [
            ctx.Process(target=_worker, args=(url, f"w{i}", args.versions, results))
            for i in range(args.workers)
        ]
        for w in workers:
            w.start()

        from rlax_tasks.paramserver import ParameterServerClient

        trainer = ParameterServerClient(url, token=TOKEN, timeout_s=300)
        deadline = time.time() + 120
        while len(trainer.status()["workers"]) < args.workers and time.time() < deadline:
            time.sleep(0.1)
        sync_s, converge_s, push_s = [], [], []
        for v in range(1, args.versions + 1):
            params = make_params(nbytes, args.arrays, v)
            t0 = time.time()
            trainer.push(v, params)
            pushed = time.time()
            dones = [results.get(timeout=600) for _ in range(args.workers)]
            assert all(d["version"] == v and d["bytes"] == nbytes for d in dones), dones
            end = max(d["done"] for d in dones)
            sync_s.append(end - t0)
            push_s.append(pushed - t0)
            converge_s.extend(d["done"] - pushed for d in dones)
            print(
                f"version {v}: push {pushed - t0:.2f}s, held by all {args.workers} workers after "
                f"{end - t0:.2f}s ({nbytes * (1 + args.workers) / (end - t0) / 1e9:.2f} GB/s moved)"
            )
            del params
        for w in workers:
            w.join(timeout=120)
    finally:
        server.terminate()
        server.wait(timeout=30)

    med = statistics.median(sync_s)
    conv = np.asarray(converge_s)
    print()
    print(f"version size        {fmt_si(nbytes, 'B')}, {args.workers} workers, "
          f"{args.versions} versions")  # fmt: skip
    print(f"sync time (median)  {med:.3f}s  = {nbytes * (1 + args.workers) / med / 1e9:.2f} GB/s "
          f"moved; {nbytes / med / 1e9:.2f} GB/s per version")  # fmt: skip
    print(f"push time (median)  {statistics.median(push_s):.3f}s "
          f"({nbytes / statistics.median(push_s) / 1e9:.2f} GB/s)")  # fmt: skip
    print(f"memcpy floor        {floor_s:.3f}s  = {floor_gbs:.2f} GB/s")
    print(f"ratio sync / floor  {med / floor_s:.2f}x  (target <= 3x)")
    print(f"sha256 lower bound  {hash_s:.3f}s = {hash_s / floor_s:.2f}x the floor on this machine")
    print(
        f"per-worker convergence after the push returns: p50 {np.percentile(conv, 50):.3f}s, "
        f"p99 {np.percentile(conv, 99):.3f}s (n={conv.size})"
    )
    print(
        json.dumps(
            {
                "bytes": nbytes,
                "workers": args.workers,
                "sync_s": sync_s,
                "push_s": push_s,
                "floor_s": floor_s,
                "sha256_bound_s": hash_s,
                "ratio": med / floor_s,
                "converge_p50_s": float(np.percentile(conv, 50)),
                "converge_p99_s": float(np.percentile(conv, 99)),
                "cpu_count": os.cpu_count(),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
