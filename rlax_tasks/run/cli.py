"""The runners' commands: `rlax run` (the main job), and the jobs it starts that belong to no
component package: `rlax trainer`, `rlax colocated` and `rlax heldout` (`rlax controller` and
`rlax worker` register in their packages). Light to import (no JAX): each command imports its
runner when it runs, after the process tuning."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import yaml

from rlax_tasks.process.garbage_collection import defer_full_collections
from rlax_tasks.process.host_malloc import tune_if_host_compute
from rlax_tasks.services.endpoints import add_address_args, add_url_arg
from rlax_tasks.services.http import service_token
from rlax_tasks.utils.byte_sizes import parse_bytes_arg


# ------------------------------------------------------------------------------------ rlax run
def _run_command(args: argparse.Namespace) -> int:
    if args.steps is not None and args.steps < 1:
        raise ValueError(f"--steps must be a positive number of training steps, got {args.steps}")
    from rlax_tasks.config import load_config
    from rlax_tasks.run.local_run import run_local  # the supervisors: when the run starts
    from rlax_tasks.run.supervisor import Interrupted

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
    from rlax_tasks.plan.memory_plan import dry_run_text, memory_plan
    from rlax_tasks.run.slice_supervisor import node_plan

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


# -------------------------------------------------------------------------------- rlax trainer
def _trainer_command(args: argparse.Namespace) -> int:
    defer_full_collections()  # before the imports: see rlax_tasks.process.garbage_collection
    tune_if_host_compute()  # before JAX starts its threads: see rlax_tasks.process.host_malloc
    # the run's token (RLAX_PS_TOKEN): the service needs it, and so do the pushes to the PS
    token = service_token()
    # after the two calls above: the heavy modules (JAX, the model) load tuned
    from rlax_tasks.config import load_config
    from rlax_tasks.run.trainer_process import serve_trainer

    cfg = load_config(args.config)
    return serve_trainer(cfg, token, args.ps_url, args.host, args.port, args.publish)


def add_trainer_parser(sub: argparse._SubParsersAction) -> None:
    """Registers `rlax trainer`."""
    p = sub.add_parser("trainer", help="the trainer service: applies the controller's batches")
    p.add_argument("--config", required=True, help="run config YAML (or a preset name)")
    add_url_arg(p, "--ps-url", "the parameter server's", note=" (token from RLAX_PS_TOKEN)")
    add_address_args(p)
    p.set_defaults(func=_trainer_command)


# ------------------------------------------------------------------------------ rlax colocated
def _colocated_command(args: argparse.Namespace) -> int:
    defer_full_collections()  # before the imports: see rlax_tasks.process.garbage_collection
    tune_if_host_compute()  # before JAX starts its threads: see rlax_tasks.process.host_malloc
    from rlax_tasks.config import load_config

    cfg = load_config(args.config)
    if cfg.placement.mode != "colocated":
        raise ValueError(
            f"placement.mode is {cfg.placement.mode!r}: `rlax colocated` runs a colocated "
            "run (use `rlax run`, which starts the jobs of a disaggregated one)"
        )
    steps = args.steps or cfg.trainer.total_steps
    if not steps or steps < 1:
        raise ValueError("--steps: give a positive number of training steps")
    from rlax_tasks.run.colocated import run_colocated  # JAX: after the tuning above

    return run_colocated(
        cfg,
        steps,
        host=args.host,
        port=args.port,
        publish=args.publish,
        ps_args={"keep_versions": args.keep_versions, "keep_bytes": args.keep_bytes},
        status_every_s=args.status_every_s,
    )


def add_colocated_parser(sub: argparse._SubParsersAction) -> None:
    """Registers `rlax colocated`."""
    p = sub.add_parser(
        "colocated",
        help="a colocated run in this process: trainer, sampler, parameter server, controller",
    )
    p.add_argument("--config", required=True, help="run config YAML (or a preset name)")
    p.add_argument("--steps", type=int, default=None, help="training steps (total, resumable)")
    add_address_args(p)  # the parameter server's
    p.add_argument("--keep-versions", type=int, default=2)
    p.add_argument("--keep-bytes", type=parse_bytes_arg, default=None, metavar="SIZE")
    p.add_argument("--status-every-s", type=float, default=10.0)
    p.set_defaults(func=_colocated_command)


# -------------------------------------------------------------------------------- rlax heldout
def _heldout_command(args: argparse.Namespace) -> int:
    from rlax_tasks.config import load_config
    from rlax_tasks.plan.compilation_cache import enable_in_process
    from rlax_tasks.process.device_check import check_job_devices
    from rlax_tasks.run.heldout import JOB, run_heldout

    cfg = load_config(args.config)
    if args.every < 0 or args.after < 0 or (args.last is not None and args.last < 1):
        raise ValueError("--every and --after: 0 or more; --last: a version of 1 or more")
    enable_in_process(cfg)
    check_job_devices(JOB)  # exit 2 when JAX's devices are not the placement's
    run_heldout(cfg, base=args.base, every=args.every, last=args.last, after=args.after)
    return 0


def add_heldout_parser(sub: argparse._SubParsersAction) -> None:
    """Registers `rlax heldout`."""
    p = sub.add_parser(
        "heldout", help="held-out pass@k of a run's weights as it mirrors them (a job of rlax run)"
    )
    p.add_argument("--config", required=True, help="the run's config.yaml")
    p.add_argument("--base", action="store_true", help="evaluate the starting weights first")
    p.add_argument(
        "--every", type=int, default=0, help="evaluate every N-th version as mirrored (0: none)"
    )
    p.add_argument(
        "--after", type=int, default=0, help="a resumed run's trained step: --every starts after"
    )
    p.add_argument(
        "--last", type=int, default=None, help="evaluate this version when mirrored, then end"
    )
    p.set_defaults(func=_heldout_command)
