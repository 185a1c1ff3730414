"""Ours (`rlax run`, tiny-arith; colocated and disaggregated) vs TRL's ``GRPOTrainer`` (PyTorch
CPU): wall-clock time to the same held-out pass@1 target, from the same base model, prompts,
reward and mapped hyper-parameters, evaluated by the same evaluator with both clocks paused
(benchmarks/README.md: what each clock counts). ``--rounds N`` alternates the order and reports
the median ratio; ``--model-size 30m``: rl_throughput.py. Needs ``scripts/setup.sh --bench``."""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _setup  # noqa: E402, F401  (the repository root on sys.path; JAX on the CPU by default)

from benchmarks import _timing, rl_throughput  # noqa: E402
from benchmarks._trl_side import base_checks, preset_config, run_trl_fresh  # noqa: E402
from benchmarks.async_vs_sync import (  # noqa: E402
    after_first_step,
    base_model_dir,
    fmt_value,
    print_curves,
    print_table,
    run_ours,
    time_to_target,
)

log = logging.getLogger("benchmarks.vs_trl")

# ours' layouts (placement.mode): the preset's own (colocated) and the paper's separate jobs
LAYOUTS: dict[str, dict[str, Any]] = {
    "colocated": {"placement.mode": "colocated", "workers.count": 1, "workers.slots": 256},
    "disaggregated": {"placement.mode": "disaggregated", "workers.count": 2, "workers.slots": 128},
}


# ------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--gain", type=float, default=0.15, help="target = base pass@1 + gain")
    ap.add_argument("--target", type=float, default=None, help="absolute held-out pass@1 target")
    ap.add_argument("--eval-every", type=int, default=10, help="held-out pass@k every N steps")
    ap.add_argument("--max-steps", type=int, default=300, help="cap on training steps (each)")
    ap.add_argument(
        "--max-seconds", type=float, default=900.0, help="cap on training seconds (each)"
    )
    ap.add_argument("--no-early-stop", action="store_true", help="run on to the caps")
    ap.add_argument("--reload-every", type=int, default=None, help="ours: j (default: preset)")
    ap.add_argument("--max-staleness", type=int, default=None, help="ours: k (default: preset)")
    ap.add_argument("--only", choices=("ours", "trl"), default=None, help="run one side only")
    ap.add_argument(
        "--trl-eval",
        choices=("rlax", "torch"),
        default="rlax",
        help="how TRL's held-out pass@k is measured: rlax = the evaluator ours uses, on TRL's\n"
        "weights (same sampler and seeds); torch = transformers generate on the torch model",
    )
    ap.add_argument("--torch-threads", type=int, default=None, help="TRL: torch.set_num_threads")
    ap.add_argument(
        "--compilation-cache",
        default=None,
        help="ours: JAX compilation cache directory kept across invocations (a second run\n"
        "starts warm); default: a fresh one per run, i.e. a first run's compile times",
    )
    ap.add_argument(
        "--eval-beside-training",
        action="store_true",
        help="ours: keep training while the held-out evaluation samples (competing for the\n"
        "CPU) instead of holding the run still and taking the pauses off its clock",
    )
    _timing.add_rounds_option(ap)
    ap.add_argument(
        "--layouts",
        default="colocated,disaggregated",
        help="ours: the placement modes to run, side by side (comma-separated)",
    )
    ap.add_argument(
        "--model-size",
        choices=("tiny", "30m"),
        default="tiny",
        help="tiny: time to the held-out target on the preset's model; 30m: RL steps per\n"
        "second on a 30M-parameter Qwen2-shaped model (benchmarks/rl_throughput.py)",
    )
    rl_throughput.add_args(ap.add_argument_group("--model-size 30m"))
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    unknown = sorted(set(layouts) - set(LAYOUTS))
    if unknown or not layouts:
        ap.error(f"--layouts: {unknown or 'none'}; choose from {', '.join(LAYOUTS)}")
    if args.only != "ours" and (missing := rl_throughput.trl_missing()):
        print(missing, file=sys.stderr)
        return 2
    _timing.setup_logging()
    if args.model_size == "30m":
        out = rl_throughput.run(args, layouts, args.only)
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump(out, f, indent=2)
        return 0
    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
    load_before = _timing.machine_load(log)
    busy = load_before["busy_cores"]
    model_dir = base_model_dir()
    cache_state = "cold (a fresh cache per run)"
    if args.compilation_cache:
        from rlax_tasks.plan.compilation_cache import DIR_ENV

        os.makedirs(args.compilation_cache, exist_ok=True)
        entries = len(os.listdir(args.compilation_cache))
        cache_state = f"{args.compilation_cache}: {entries} entries at start"
        os.environ[DIR_ENV] = os.path.abspath(args.compilation_cache)
    ours_overrides: dict[str, Any] = {"eval.every_steps": args.eval_every}
    if args.reload_every is not None:
        ours_overrides["staleness.reload_every"] = args.reload_every
    if args.max_staleness is not None:
        ours_overrides["staleness.max_staleness"] = args.max_staleness
    # the learning-rate schedule decays to its end over trainer.total_steps (the preset's run
    # length): a longer cap stretches it, on both sides
    if args.max_steps > (preset_config(model_dir).trainer.total_steps or 0):
        ours_overrides["trainer.total_steps"] = args.max_steps
    cfg = preset_config(model_dir, ours_overrides)

    # one target for both sides, from the base model's held-out pass@1 measured by the evaluator
    # of the run report; beside it, two checks of that estimate on the same base weights
    from rlax_tasks.run.report import HeldOutEvaluator

    base = HeldOutEvaluator(cfg).evaluate()["pass@1"]
    target = args.target if args.target is not None else base + args.gain
    checks = base_checks(cfg, model_dir)
    log.info(
        "base held-out pass@1: %.3f (rlax evaluator), %.3f (torch generate), %.3f (exact); "
        "target %.3f",
        base,
        checks["torch_sampled"],
        checks["exact"],
        target,
    )
    early = not args.no_early_stop

    def stop_when(rows: list[dict[str, Any]], elapsed: float) -> str | None:
        if early and time_to_target(rows, target) is not None:
            return "target"
        if elapsed > args.max_seconds:
            return "max-seconds"
        return None

    def run_side(label: str) -> dict[str, Any]:
        if label == "trl":
            result = run_trl_fresh(
                model_dir,
                ours_overrides,
                torch_threads=args.torch_threads,
                max_steps=args.max_steps,
                max_seconds=args.max_seconds,
                eval_every=args.eval_every,
                target=target,
                early_stop=early,
                evaluation=args.trl_eval,
            )
        else:
            result = run_ours(
                label,
                {**ours_overrides, **LAYOUTS[label.removeprefix("ours-")]},
                args.max_steps,
                model_dir=model_dir,
                stop_when=stop_when,
                pause_for_eval=not args.eval_beside_training,
            )
        result["time_to_target"] = time_to_target(result["curve"], target)
        return result

    sides = [f"ours-{layout}" for layout in layouts] if args.only != "trl" else []
    sides += ["trl"] if args.only != "ours" else []
    orders = _timing.round_orders(sides, args.rounds)
    rounds: list[dict[str, dict[str, Any]]] = []
    for i, order in enumerate(orders):
        if args.rounds > 1:
            log.info("round %d of %d: %s", i + 1, args.rounds, ", ".join(order))
        done = {label: run_side(label) for label in order}
        rounds.append({label: done[label] for label in sides})

    s = cfg.staleness
    print()
    print(
        f"tiny-arith: ours (rlax run, j={s.reload_every}, k={s.max_staleness}; "
        f"{', '.join(layouts)}) vs TRL GRPOTrainer (PyTorch CPU), {os.cpu_count()} CPUs "
        f"(before start: {_timing.describe_load(load_before)}); "
        f"ours' JAX compilation cache: {cache_state}"
    )
    print(
        f"target held-out pass@1 {target:.3f}"
        + (f" (base {base:.3f} + {args.gain})" if args.target is None else "")
        + f", eval every {args.eval_every} steps ({args.trl_eval} evaluator for TRL), caps "
        f"{args.max_steps} steps / {args.max_seconds:.0f}s"
    )
    print(
        f"base pass@1 check: rlax evaluator {base:.3f}, torch generate "
        f"{checks['torch_sampled']:.3f}, exact P(answer<eos>) {checks['exact']:.3f} (a gap "
        "beyond ~0.03 means an evaluator's samples are not independent)"
    )
    lines = [
        ("time to target", lambda r: _ttt(r["time_to_target"])),
        ("  of which after 1st step", lambda r: _ttt(after_first_step(r))),
        ("steps to target", lambda r: fmt_value((r["time_to_target"] or {}).get("step"), "{}")),
        ("steps run", lambda r: str(r["steps"])),
        ("stopped by", lambda r: r["stopped"]),
        ("training seconds", lambda r: fmt_value(r["train_seconds"], "{:.1f}")),
        ("first step done at s", lambda r: fmt_value(r["first_step_seconds"], "{:.1f}")),
        (
            "evaluation s, off the clock",
            lambda r: fmt_value(
                r.get("eval_pause_seconds") or r.get("eval_seconds_total"), "{:.1f}"
            ),
        ),
        (
            "save_pretrained for eval s, on the clock",
            lambda r: fmt_value(r.get("handover_seconds_total"), "{:.2f}"),
        ),
        ("s/step (median interval)", lambda r: fmt_value(r["step_interval_median"])),
        ("s/step (mean interval)", lambda r: fmt_value(r["step_interval_mean"])),
        ("pass@1 at step 0", lambda r: fmt_value(r["curve"][0]["pass@1"] if r["curve"] else None)),
        ("best pass@1", lambda r: fmt_value(max((c["pass@1"] for c in r["curve"]), default=None))),
        ("mean reward, last 10 steps", lambda r: fmt_value(r["reward_last10"])),
    ]
    for i, results in enumerate(rounds):
        if len(rounds) > 1:
            print()
            print(f"round {i + 1} of {len(rounds)} (in this order: {', '.join(orders[i])}):")
        print_table(list(results.items()), lines)
        print()
        print_curves(
            results,
            "held-out pass@1 by step (seconds of training when that step's weights existed):",
        )
    load_after = _timing.machine_load(log, when="after")
    print()
    print(f"ratios{_timing.contended_mark(load_before, load_after) or ' (quiet machine)'}:")
    per_round: list[dict[str, dict[str, float | None]]] = []
    for i, results in enumerate(rounds):
        if len(rounds) > 1:
            print(f"round {i + 1}:")
        per_round.append({k: _ratios(results, k) for k in results if k.startswith("ours")})
    ratios = median_ratios(per_round)
    if len(rounds) > 1:
        print(f"median over {len(rounds)} rounds:")
        for label, r in ratios.items():
            print(f"  {label}: TRL / ours = {_times(r['end_to_end'])} end to end, "
                  f"{_times(r['from_first_step'])} from each side's first step")  # fmt: skip
    print(f"peak RSS of this process: {_timing.peak_rss_bytes() / 2**20:.0f} MiB")
    ratio = (ratios.get("ours-colocated") or next(iter(ratios.values()), {})).get("end_to_end")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(
                {
                    "target": target,
                    "base_pass@1": base,
                    "base_checks": checks,
                    "trl_eval": args.trl_eval,
                    "eval_every": args.eval_every,
                    "max_steps": args.max_steps,
                    "max_seconds": args.max_seconds,
                    "cpu_count": os.cpu_count(),
                    "busy_cores_before": busy,
                    "results": rounds[0],
                    "ratio_trl_over_ours": ratio,
                    "ratios_trl_over_ours": ratios,
                    "rounds": [
                        {"results": r, "ratios_trl_over_ours": q}
                        for r, q in zip(rounds, per_round, strict=True)
                    ],
                    "layouts": layouts,
                    "machine_load": {"before": load_before, "after": load_after},
                    "compilation_cache": cache_state,
                },
                f,
                indent=2,
            )
        log.info("wrote %s", args.json_out)
    return 0


def median_ratios(
    per_round: list[dict[str, dict[str, float | None]]],
) -> dict[str, dict[str, float | None]]:
    """Each layout's ratios (end to end, from the first step) as the median over the rounds that
    have one (None when none has)."""
    out: dict[str, dict[str, float | None]] = {}
    for label in per_round[0] if per_round else {}:
        out[label] = {}
        for kind in ("end_to_end", "from_first_step"):
            values = [r[label][kind] for r in per_round if r[label][kind] is not None]
            out[label][kind] = statistics.median(values) if values else None
    return out


def _times(ratio: float | None) -> str:
    return "n/a" if ratio is None else f"{ratio:.2f}x"


def _ttt(t: dict[str, Any] | None) -> str:
    return "not reached" if t is None else f"{t['seconds']:.1f}s"


def _ratios(results: dict[str, dict[str, Any]], label: str) -> dict[str, float | None]:
    """Prints and returns TRL's time to target over ``label``'s: end to end and counted from
    each side's first training step."""
    out: dict[str, float | None] = {"end_to_end": None, "from_first_step": None}
    ours_t = results[label]["time_to_target"]
    trl_t = (results.get("trl") or {}).get("time_to_target")
    if "trl" not in results:
        return out
    if ours_t and trl_t:
        out["end_to_end"] = trl_t["seconds"] / ours_t["seconds"]
        print(f"{label}: TRL time / ours = {out['end_to_end']:.2f}x end to end")
        steady = [after_first_step(results[k]) for k in (label, "trl")]
        if all(steady):
            out["from_first_step"] = steady[1]["seconds"] / steady[0]["seconds"]
            print(
                f"  counted from each side's first training step (start-up and first compile "
                f"excluded): TRL / ours = {out['from_first_step']:.2f}x"
            )
        return out
    bound = _lower_bound(results, label)
    print(
        f"{label}: TRL time / ours: n/a, the target was not reached by "
        + " and ".join(k for k in (label, "trl") if results[k]["time_to_target"] is None)
        + (f" (a lower bound: {bound})" if bound else "")
    )
    return out


def _lower_bound(results: dict[str, dict[str, Any]], label: str) -> str:
    """When only ours reached the target: TRL's training time so far over ours (a lower bound)."""
    ours, trl_r = results[label], results["trl"]
    if ours["time_to_target"] and not trl_r["time_to_target"] and trl_r["train_seconds"]:
        return f"TRL / ours > {trl_r['train_seconds'] / ours['time_to_target']['seconds']:.2f}x"
    if trl_r["time_to_target"] and not ours["time_to_target"] and ours["train_seconds"]:
        return f"TRL / ours < {trl_r['time_to_target']['seconds'] / ours['train_seconds']:.2f}x"
    return ""


if __name__ == "__main__":
    sys.exit(main())
