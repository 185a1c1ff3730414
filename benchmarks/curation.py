"""Curation benchmark: rows/s and peak memory of `rlax curate` on ``--rows`` (1M) synthetic rows
with planted duplicates, near duplicates, invalid, French and interactive rows, and a partly
copied evaluation set. The pipeline runs in a fresh child process, timed per stage against the
4 GiB target; the numpy MinHash is compared with a pure-Python one (same signatures, the ratio).
``.venv/bin/python benchmarks/curation.py [--rows 200000] [--json-out FILE]``"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _timing  # noqa: E402  (the benchmarks' shared helper module, next to this file)

log = logging.getLogger("benchmarks.curation")
TARGET_RSS = 4 * 1024**3
WORDS = (
    "find the value of each integer such that triangle circle area sum product prime divisor "
    "probability expected number sequence real roots polynomial equation square cube digit "
    "remainder modulo largest smallest positive negative rational function graph"
).split()
FRENCH = "Trouvez le nombre de entiers positifs qui sont dans la liste et pour le cas {} et {}"
INTERACTIVE = "This is an interactive problem. Guess the hidden number {} with at most {} queries."


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--baseline-rows", type=int, default=2000, help="rows for the MinHash race")
    p.add_argument("--workdir", default=None, help="where data and outputs go (default: tmp)")
    p.add_argument("--json-out", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def make_rows(n: int, seed: int = 0) -> list[dict]:
    """Synthetic rows in the curation schema with known fractions of problems."""
    rng = random.Random(seed)
    rows: list[dict] = []
    base_dates = np.datetime64("2023-01-01") + np.random.default_rng(seed).integers(0, 1000, n)
    for i in range(n):
        kind = rng.random()
        a, b = rng.randint(1, 10**6), rng.randint(1, 10**6)
        date = str(base_dates[i])
        if kind < 0.04 and rows:  # exact duplicate up to case and whitespace
            src = rows[rng.randrange(len(rows))]
            prompt = "  " + src["prompt"].upper().replace(" ", "  ") + " "
            rows.append(dict(src, prompt=prompt, date=date))
            continue
        if kind < 0.08 and rows:  # near duplicate: one word changed, same numbers
            src = rows[rng.randrange(len(rows))]
            words = src["prompt"].split(" ")
            words[rng.randrange(min(len(words), 10))] = rng.choice(WORDS)
            rows.append(dict(src, prompt=" ".join(words), date=date))
            continue
        if kind < 0.085:
            prompt = FRENCH.format(a, b)
        elif kind < 0.087:
            prompt = INTERACTIVE.format(a, b % 50)
        else:
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(14, 24)))
            prompt = f"Let x = {a} and y = {b}. {words.capitalize()} of x + y?"
        if 0.087 <= kind < 0.092:
            date = "not a date"
        rows.append(
            {
                "prompt": prompt,
                "answer": str(a + b),
                "source": f"synthetic-{i % 7}",
                "date": date,
                "metadata": json.dumps({"level": 1 + i % 5}),
            }
        )
    return rows


def write_data(workdir: str, n: int) -> tuple[list[str], str, float]:
    """4 Parquet input files and a JSONL eval set; returns (paths, eval path, seconds)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    t0 = time.perf_counter()
    rows = make_rows(n)
    paths = []
    parts = 4
    for p in range(parts):
        chunk = rows[p * n // parts : (p + 1) * n // parts]
        table = pa.table({k: [r[k] for r in chunk] for k in rows[0]})
        path = os.path.join(workdir, f"part-{p}.parquet")
        pq.write_table(table, path)
        paths.append(path)
    rng = random.Random(1)
    eval_path = os.path.join(workdir, "eval.jsonl")
    with open(eval_path, "w") as fh:
        for i in range(2000):
            if i % 4 == 0:
                prompt = rows[rng.randrange(n)]["prompt"]
            else:
                words = " ".join(rng.choice(WORDS) for _ in range(20))
                prompt = f"Eval {i}: {words} {rng.randint(0, 10**9)}"
            fh.write(json.dumps({"prompt": prompt}) + "\n")
    return paths, eval_path, time.perf_counter() - t0


def run_child(spec_path: str) -> None:
    """The measured process: the full pipeline, stage timings to a JSON file."""
    _timing.setup_logging()
    from rlax_tasks.curation import CurationConfig, run_curation, write_outputs

    spec = json.loads(open(spec_path).read())
    config = CurationConfig(
        inputs=tuple(spec["inputs"]), eval_sets=(spec["eval"],), split_date="2025-01-01"
    )
    t0 = time.perf_counter()
    result = run_curation(config)
    t1 = time.perf_counter()
    report = write_outputs(result, config, spec["out"])
    t2 = time.perf_counter()
    json.dump(
        {
            "curate_s": t1 - t0,
            "write_s": t2 - t1,
            "totals": report["totals"],
            "stages": report["stages"],
            "peak_rss_bytes": _timing.peak_rss_bytes(),
        },
        open(spec["result"], "w"),
    )


def python_minhash(texts: list[str], config) -> np.ndarray:  # noqa: ANN001
    """Pure-Python MinHash with the same shingles and hash family as the numpy version."""
    from rlax_tasks.curation.dedup import _hash_params

    mask64 = (1 << 64) - 1
    a, b = _hash_params(config.num_perm, config.seed)
    a, b = [int(x) for x in a], [int(x) for x in b]
    poly, mix, k = 0x100000001B3, 0x9E3779B97F4A7C15, config.shingle
    out = np.empty((len(texts), config.num_perm), np.uint32)
    for r, text in enumerate(texts):
        padded = text + "\0" * (k - 1)
        hashes = []
        for i in range(max(len(text) - k + 1, 1)):
            h = 0
            for ch in padded[i : i + k]:
                h = (h * poly + ord(ch)) & mask64
            hashes.append(((h * mix) & mask64) >> 32)
        for p in range(config.num_perm):
            out[r, p] = min((((a[p] * x + b[p]) & mask64) >> 32) for x in hashes)
    return out


def minhash_race(n: int) -> dict:
    from rlax_tasks.curation.dedup import MinHashConfig, minhash_signatures
    from rlax_tasks.data.normalize import dedup_key

    texts = [dedup_key(r["prompt"]) for r in make_rows(n, seed=5)]
    config = MinHashConfig()
    fast = _timing.median_time(lambda: minhash_signatures(texts, config), repeats=3, sync=id)
    t0 = time.perf_counter()
    slow_sig = python_minhash(texts, config)
    slow_s = time.perf_counter() - t0
    same = bool(np.array_equal(slow_sig, minhash_signatures(texts, config)))
    return {
        "rows": n,
        "numpy_rows_per_s": n / fast.median_s,
        "python_rows_per_s": n / slow_s,
        "speedup": slow_s / fast.median_s,
        "identical_signatures": same,
        "other_cores": fast.other_cores,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        run_child(args.child)
        return 0
    before = _timing.machine_load(log)
    with tempfile.TemporaryDirectory(dir=args.workdir) as workdir:
        print(f"generating {args.rows:,} synthetic rows ...", flush=True)
        inputs, eval_path, gen_s = write_data(workdir, args.rows)
        print(f"  written in {gen_s:.1f} s", flush=True)
        spec = {
            "inputs": inputs,
            "eval": eval_path,
            "out": os.path.join(workdir, "out"),
            "result": os.path.join(workdir, "result.json"),
        }
        spec_path = os.path.join(workdir, "spec.json")
        with open(spec_path, "w") as fh:
            json.dump(spec, fh)
        t0 = time.perf_counter()
        subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--child", spec_path], check=True
        )
        wall = time.perf_counter() - t0
        child = json.load(open(spec["result"]))
        child_peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    race = minhash_race(args.baseline_rows)
    after = _timing.machine_load(log, when="after")
    mark = _timing.contended_mark(before, after)

    peak = max(child["peak_rss_bytes"], child_peak)
    rows_per_s = args.rows / (child["curate_s"] + child["write_s"])
    t = child["totals"]
    print()
    print(
        f"machine before the run: {_timing.describe_load(before)}; after: "
        f"{_timing.describe_load(after)}{mark}"
    )
    print(
        f"rows: {args.rows:,} -> {t['train']:,} train, {t['test']:,} test, "
        f"{t['quarantined']:,} quarantined, {t['removed']:,} removed"
    )
    for s in child["stages"]:
        print(f"  {s['stage']:<18} in {s['rows_in']:>9,}  removed {s['removed']:>8,}")
    print(
        f"pipeline: {child['curate_s']:.1f} s curate + {child['write_s']:.1f} s writing "
        f"(child wall {wall:.1f} s incl. interpreter start){mark}"
    )
    print(f"throughput: {rows_per_s:,.0f} rows/s (exact + near dedup included){mark}")
    print(
        f"peak RSS: {peak / 1024**3:.2f} GiB vs target 4 GiB -> "
        f"{peak / TARGET_RSS:.2f}x of the target ({'OK' if peak < TARGET_RSS else 'OVER'})"
    )
    print(
        f"MinHash on {race['rows']:,} rows: numpy {race['numpy_rows_per_s']:,.0f} rows/s vs "
        f"pure Python {race['python_rows_per_s']:,.0f} rows/s -> {race['speedup']:.0f}x "
        f"(identical signatures: {race['identical_signatures']}){mark}"
    )
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump(
                {
                    "rows": args.rows,
                    "rows_per_s": rows_per_s,
                    "peak_rss_bytes": peak,
                    "target_rss_bytes": TARGET_RSS,
                    "child": child,
                    "minhash_race": race,
                    "busy_cores_before": before["busy_cores"],
                    "machine_load": {"before": before, "after": after},
                },
                fh,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
