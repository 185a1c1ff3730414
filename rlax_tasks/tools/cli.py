"""The tools' commands: `rlax data` (data/cli.py's `preview`, and `episodes` of a run),
`rlax export` and `rlax doctor`. Light to import (no JAX, no numpy): each tool's module loads
when its command is registered (`rlax data`) or runs."""

from __future__ import annotations

import argparse
import logging
import sys

from rlax_tasks.models.config import SUPPORTED_DTYPES


# ------------------------------------------------------------------------------------ rlax data
def add_data_parser(sub: argparse._SubParsersAction) -> None:
    """Registers `rlax data preview` and `rlax data episodes`."""
    # numpy and the data readers: only for `rlax data`
    from rlax_tasks.data.cli import add_data_parser as add_preview_parser
    from rlax_tasks.tools.episode_preview import preview_episodes

    data_sub = add_preview_parser(sub)  # data/cli.py: `rlax data preview`
    p = data_sub.add_parser(
        "episodes", help="print a run's trained episodes, model turns and masked observations"
    )
    p.add_argument("run_dir", help="a run directory (local or gs://)")
    p.add_argument("--step", type=int, default=None, help="only this training step's")
    p.add_argument("-n", type=int, default=2, help="episodes to show (default 2)")
    p.add_argument("--model-dir", default=None, help="its tokenizer (default: the run's model)")
    p.set_defaults(func=preview_episodes)


# ---------------------------------------------------------------------------------- rlax export
def _export_command(args: argparse.Namespace) -> int:
    import jax  # loads JAX: only when the command runs

    from rlax_tasks.tools.export import export_checkpoint, parse_run_spec

    # the export only reads arrays on the host: never take accelerators a trainer may hold
    jax.config.update("jax_platforms", "cpu")
    if not args.verbose:  # Orbax logs every handler it builds at INFO (through absl)
        logging.getLogger("absl").setLevel(logging.WARNING)
    run_dir, step = parse_run_spec(args.run)
    result = export_checkpoint(run_dir, args.out_dir, step, args.dtype, args.overwrite)
    print(f"exported step {result.step} of {run_dir} to {result.out_dir} ({result.dtype})")
    return 0


def add_export_parser(sub: argparse._SubParsersAction) -> None:
    """Registers `rlax export`."""
    p = sub.add_parser(
        "export",
        help="write a run's trained policy (a trainer checkpoint) as a Hugging Face directory",
    )
    p.add_argument(
        "run",
        metavar="RUN_DIR[@STEP]",
        help="the run directory (run_root/<run_id>); @STEP picks a checkpoint step "
        "(default: the newest complete one)",
    )
    p.add_argument("out_dir", metavar="OUT_DIR", help="the HF directory to write")
    p.add_argument(
        "--dtype",
        choices=SUPPORTED_DTYPES,
        default=None,
        help="dtype of the written tensors (default: the checkpoint's, i.e. model.param_dtype)",
    )
    p.add_argument(
        "--overwrite", action="store_true", help="replace OUT_DIR when it exists and is not empty"
    )
    p.set_defaults(func=_export_command)


# ---------------------------------------------------------------------------------- rlax doctor
def _doctor_command(args: argparse.Namespace) -> int:
    from rlax_tasks.config import load_config
    from rlax_tasks.tools.doctor import device_lines, job_lines, self_check  # JAX: when it runs

    cfg = load_config(args.config or args.preset)
    print("\n".join(device_lines() + job_lines(cfg)), flush=True)
    if args.no_self_check:
        return 0
    print("self-check:", flush=True)
    checks = self_check()
    for c in checks:
        print(f"  {c.name:<12} {'ok' if c.ok else 'FAILED':<7} {c.detail}", flush=True)
    failed = [c.name for c in checks if not c.ok]
    if failed:
        print(f"rlax doctor: failed: {', '.join(failed)}", file=sys.stderr)
        return 2
    return 0


def add_doctor_parser(sub: argparse._SubParsersAction) -> None:
    """Registers `rlax doctor`."""
    p = sub.add_parser(
        "doctor", help="this host's devices, each job's devices and kernels, and a self-check"
    )
    p.add_argument("--preset", default="tiny-arith", help="a preset name (default tiny-arith)")
    p.add_argument("--config", help="a run config YAML instead of a preset")
    p.add_argument("--no-self-check", action="store_true", help="print the devices and jobs only")
    p.set_defaults(func=_doctor_command)
