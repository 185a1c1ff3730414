"""Where a decode chunk's and a train step's time goes: profiles one of each (jax.profiler) and
reduces the trace to a table per program: the top operations by time, with the bytes and FLOPs
XLA's optimized program gives each (``_hlo_traffic``, read from the programs XLA dumps) and the
GB/s and FLOP/s they achieved. A device run's ``profile`` part; ``--shape small`` on the CPU.
``.venv/bin/python benchmarks/profile_steps.py --trace-dir DIR [--json-out FILE]``"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import logging
import os
import re
import shutil
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _hlo_traffic  # noqa: E402
import _timing  # noqa: E402

log = logging.getLogger("benchmarks.profile_steps")
# the programs profiled, by the module name XLA gives them
PROGRAMS = {"decode": "jit__decode", "train": "jit_train_step"}
_CONTAINER = re.compile(r"^(while|conditional|call)(\.\d+)?$")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=("qwen2.5-1.5b", "small"), default="qwen2.5-1.5b")
    p.add_argument("--slots", type=int, default=None, help="decode slots (default 256; small 4)")
    p.add_argument("--trace-dir", required=True, help="where the traces and HLO dumps go")
    p.add_argument("--top", type=int, default=10, help="operations listed per program")
    p.add_argument("--json-out", default=None)
    return p.parse_args(argv)


def trace_events(trace_dir: str) -> tuple[list[dict[str, Any]], str]:
    """(the timed events of every ``*.trace.json.gz`` under ``trace_dir`` that name an HLO
    operation, where they come from): the device's own where some name one (a GPU's kernels:
    "device"), else the host's ("host": on a CPU the operations themselves)."""
    events, devices = [], set()
    for path in glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True):
        with gzip.open(path, "rt") as f:
            data = json.load(f)
        rows = data.get("traceEvents", []) if isinstance(data, dict) else data
        for e in rows:
            if e.get("ph") == "M" and e.get("name") == "process_name":
                if str(e.get("args", {}).get("name", "")).startswith("/device:"):
                    devices.add((path, e.get("pid")))
        events += [(path, e) for e in rows if e.get("ph") == "X" and "hlo_op" in e.get("args", {})]
    on_device = [e for p, e in events if (p, e.get("pid")) in devices]
    if on_device:
        return on_device, "device"
    return [e for _, e in events], "host"


def dumped_programs(dump_dir: str, module: str) -> list[str]:
    """The optimized HLO texts XLA dumped for programs named ``module``."""
    out = []
    for path in sorted(glob.glob(os.path.join(dump_dir, f"*.{module}.*after_optimizations.txt"))):
        with open(path) as f:
            out.append(f.read())
    return out


def reduce_profile(
    events: list[dict[str, Any]], module: str, hlo_texts: list[str], top: int
) -> dict[str, Any]:
    """One program's table: time per operation (the trace's events of ``module``), joined by name
    with the operations of its dumped HLO (the one sharing the most names) for bytes and FLOPs."""
    time_us: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    for e in events:
        # (a loop's or a call's own event spans its body's operations: counted through them)
        if e["args"].get("hlo_module") == module and not _CONTAINER.match(e["args"]["hlo_op"]):
            time_us[e["args"]["hlo_op"]] += float(e.get("dur", 0))
            calls[e["args"]["hlo_op"]] += 1
    best: dict[str, _hlo_traffic.Operation] = {}
    for text in hlo_texts:
        ops = {o.name: o for o in _hlo_traffic.operations(text)}
        if len(set(ops) & set(time_us)) > len(set(best) & set(time_us)):
            best = ops
    total_us = sum(time_us.values())
    rows = []
    for name, us in time_us.most_common(top):
        row: dict[str, Any] = {
            "op": name,
            "time_us": round(us, 1),
            "share": us / total_us,
            "calls": calls[name],
        }
        op = best.get(name)
        if op is not None:
            per_call_bytes, per_call_flops = op.bytes / op.count, op.flops / op.count
            seconds = us / 1e6
            row.update(
                kind=op.kind,
                source=op.op_name[-80:],
                bytes_per_call=per_call_bytes,
                gb_per_s=per_call_bytes * calls[name] / seconds / 1e9 if seconds else None,
                tflop_per_s=per_call_flops * calls[name] / seconds / 1e12
                if seconds and per_call_flops
                else None,
            )
        rows.append(row)
    return {
        "module": module,
        "total_us": round(total_us, 1),
        "operations": len(time_us),
        "matched_hlo": bool(best),
        "top": rows,
    }


def profile(args: argparse.Namespace) -> None:
    """Runs one decode chunk and one train step under the profiler (each compiled first)."""
    import jax
    import numpy as np
    from accelerator import model_config  # the same shapes as the device run's figures
    from train_step import random_batch

    from rlax_tasks.algorithms import make_objective
    from rlax_tasks.models import Policy
    from rlax_tasks.rollout import Sampler
    from rlax_tasks.trainer import Trainer, TrainerConfig

    small = args.shape == "small"
    config = model_config(args.shape)
    slots = args.slots or (4 if small else 256)
    prompt, chunk = (16, 8) if small else (256, 32)
    policy = Policy.init(config, dtype="bfloat16", param_dtype="bfloat16")
    sampler = Sampler(
        policy,
        max_slots=slots,
        max_len=prompt + 2 * chunk + 1,
        precompile=False,
        decode_chunk=chunk,
    )
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(3, config.vocab_size, prompt)) for _ in range(slots)]

    def generate(s: Sampler) -> None:  # a prefill and one decode chunk
        s.generate(prompts, max_new_tokens=chunk + 1, temperature=1.0, ignore_eos=True)

    generate(sampler)  # compiles
    with jax.profiler.trace(os.path.join(args.trace_dir, "decode")):
        generate(sampler)
    del sampler, policy
    batch, seq = (4, 32) if small else (8, 1024)
    data = random_batch(rng, batch, seq, config.vocab_size)
    policy = Policy.init(config, dtype="bfloat16", param_dtype="float32")
    with tempfile.TemporaryDirectory(prefix="rlax_profile_") as run_dir:
        trainer = Trainer(
            policy,
            make_objective("dapo"),
            TrainerConfig(
                learning_rate=1e-6, micro_batch_size=batch // 2, remat="full", mesh_shape=(1, 1, 1)
            ),
            run_dir,
        )
        trainer.step(data)  # compiles
        with jax.profiler.trace(os.path.join(args.trace_dir, "train")):
            trainer.step(data)
        trainer.close()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    _timing.setup_logging()
    dump_dir = os.path.join(args.trace_dir, "hlo")
    os.makedirs(dump_dir, exist_ok=True)
    # XLA dumps the profiled programs' optimized HLO (read before JAX starts its backend)
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump_dir} --xla_dump_hlo_as_text"
    ).strip()
    profile(args)
    results: dict[str, Any] = {"benchmark": "profile_steps", "shape": args.shape, "programs": {}}
    for name, module in PROGRAMS.items():
        events, source = trace_events(os.path.join(args.trace_dir, name))
        table = reduce_profile(events, module, dumped_programs(dump_dir, module), args.top)
        table["events_from"] = source
        results["programs"][name] = table
        print(
            f"{name}: {table['total_us'] / 1e3:.2f} ms in {table['operations']} operations"
            f" ({module})"
        )
        for row in table["top"]:
            rate = "" if row.get("gb_per_s") is None else f"  {row['gb_per_s']:8.1f} GB/s"
            flops = "" if row.get("tflop_per_s") is None else f"  {row['tflop_per_s']:7.2f} TFLOP/s"
            print(
                f"  {row['share']:6.1%} {row['time_us'] / 1e3:9.3f} ms x{row['calls']:<4}"
                f" {row.get('kind', '?'):<13} {row['op'][:40]:<40}{rate}{flops}"
            )
    keep = tuple(f".{m}." for m in PROGRAMS.values())
    for path in glob.glob(os.path.join(dump_dir, "*")):  # the archive keeps the profiled ones
        name = os.path.basename(path)
        if not (any(k in name for k in keep) and name.endswith("after_optimizations.txt")):
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    _timing.write_json(args.json_out, results, log)
    return results


if __name__ == "__main__":
    main()
