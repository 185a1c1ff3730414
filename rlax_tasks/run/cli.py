"""`rlax run --preset NAME [--run-root DIR] [--steps N] [--allow-config-change] [--dry-run]`:
the main job (the jobs it starts register `rlax controller` and `rlax colocated` themselves)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import yaml

from rlax_tasks.config import load_config
from rlax_tasks.plan.memory_plan import dry_run_text, memory_plan
from rlax_tasks.run.local_run import run_local
from rlax_tasks.run.slice_supervisor import node_plan
from rlax_tasks.run.supervisor import Interrupted


def _run_command(args: argparse.Namespace) -> int:
    if args.steps is not None and args.steps < 1:
        raise ValueError(f"--steps must be a positive number of training steps, got {args.steps}")
    overrides = {}
    if args.run_root:
        overrides["run_root"] = args.run_root
    if args.run_id:
        overrides["run_id"] = args.run_id
    for item in args.set or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: expected dotted.key=value")
        overrides[key] = yaml.safe_load(value)
    cfg = load_config(args.config or args.preset, overrides)
    if args.address and args.backend != "ray":
        raise ValueError("--address: the Ray cluster's address goes with --backend ray")
    if args.dry_run:
        return _dry_run(cfg, args.model_config, args.backend)
    steps = args.steps if args.steps is not None else cfg.trainer.total_steps
    if not steps:
        raise ValueError("give --steps (the run config has no trainer.total_steps)")
    backend = None
    if args.backend == "ray":
        from rlax_tasks.compute import get_backend  # (Ray itself is imported when it connects)

        backend = get_backend("ray", run_root=cfg.run_root, address=args.address or "")
    try:
        report = run_local(
            cfg,
            steps,
            evaluate=not args.no_eval,
            allow_config_change=args.allow_config_change,
            backend=backend,
        )
    except Interrupted as e:
        print(
            f"rlax run: stopped by {e}: every component stopped; run the same command again to "
            "resume",
            file=sys.stderr,
        )
        return 128 + e.signum
    if "already_at" in report:  # done already: exit 0, as a finished command run again should
        print(
            f"rlax run: run {report['run_dir']} is already at step {report['already_at']} of "
            f"{steps}: nothing to train (give --steps above {report['already_at']} to go on)",
            flush=True,
        )
    return 0


def _dry_run(cfg: Any, model_config: str | None, backend: str) -> int:
    """Prints the placement and the memory plan (on ray: what runs on each node first); starts
    nothing, reads nothing remote. A plan that does not fit raises PlanDoesNotFit (exit 2, the
    message says what to change)."""
    plan = memory_plan(cfg, model_config, offline=True)
    if backend == "ray":
        print("Ray nodes (one per host of a slice; each slice a placement group):", flush=True)
        for line in node_plan(cfg):
            print(f"  {line}", flush=True)
    print(dry_run_text(cfg, plan), flush=True)
    plan.check()
    return 0


def add_run_parser(sub: argparse._SubParsersAction) -> None:
    """Registers `rlax run`."""
    p = sub.add_parser("run", help="run the whole RL loop locally (the main job)")
    p.add_argument("--preset", default="tiny-arith", help="a preset name (default tiny-arith)")
    p.add_argument("--config", help="a run config YAML instead of a preset")
    p.add_argument("--run-root", help="where runs live (local directory)")
    p.add_argument("--run-id", help="run name (default: the preset name); same id = resume")
    p.add_argument("--steps", type=int, help="training steps (default trainer.total_steps)")
    p.add_argument("--set", action="append", help="override a config field: dotted.key=value")
    p.add_argument(
        "--backend",
        choices=("local", "ray"),
        default="local",
        help="local: every job a process on this machine (default); ray: every job on a Ray "
        "cluster's nodes (slices as placement groups; the run root a path every node mounts)",
    )
    p.add_argument(
        "--address",
        help="with --backend ray: the cluster's address (host:port of its head, ray://host:port "
        "or auto; default RAY_ADDRESS, else auto)",
    )
    p.add_argument("--no-eval", action="store_true", help="skip the before/after evaluation")
    p.add_argument(
        "--allow-config-change",
        action="store_true",
        help="let a resume change training settings (learning rate, group size, datasets...); "
        "each change is recorded in the run's config_changes.jsonl with its step",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print each job's devices and the memory per device, start nothing "
        "(exit 2 when the plan does not fit placement.accelerator)",
    )
    p.add_argument(
        "--model-config",
        help="the model's config.json for the memory plan when model.path cannot be read here",
    )
    p.set_defaults(func=_run_command)
