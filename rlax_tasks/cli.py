"""The `rlax` command line: one sub-command per component."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from rlax_tasks.run.supervisor import ComponentFailed
from rlax_tasks.rundir.lock import RunLocked

# reported as one line, exit 2, never a traceback: user mistakes (the models' CheckpointError and
# ModelConfigError are ValueErrors), a run directory held by a live run, and a run component's
# own error (rlax run: the component and its log)
USER_ERRORS = (ValueError, FileNotFoundError, RunLocked, ComponentFailed)

# command: (its package's cli module, the function that registers it). A command's module is
# imported only when that command runs, and imports its heavy modules only inside the command,
# so the JAX-free services (ps, worker, controller, verify) start without JAX.
COMMANDS = {
    "verify": ("rlax_tasks.rewards.cli", "add_verify_parser"),
    "curate": ("rlax_tasks.curation.cli", "add_curate_parser"),
    "data": ("rlax_tasks.tools.cli", "add_data_parser"),
    "eval": ("rlax_tasks.evaluation.cli", "add_eval_parser"),
    "ps": ("rlax_tasks.paramserver.cli", "add_ps_parser"),
    "worker": ("rlax_tasks.rollout.cli", "add_worker_parser"),
    "trainer": ("rlax_tasks.run.cli", "add_trainer_parser"),
    "run": ("rlax_tasks.run.cli", "add_run_parser"),
    "controller": ("rlax_tasks.controller.cli", "add_controller_parser"),
    "colocated": ("rlax_tasks.run.cli", "add_colocated_parser"),
    "heldout": ("rlax_tasks.run.cli", "add_heldout_parser"),
    "export": ("rlax_tasks.tools.cli", "add_export_parser"),
    "import": ("rlax_tasks.models.cli", "add_import_parser"),
    "doctor": ("rlax_tasks.tools.cli", "add_doctor_parser"),
    "airflow": ("rlax_tasks.airflow.cli", "add_airflow_parser"),
}


def _command_of(argv: list[str]) -> str | None:
    """The sub-command named in ``argv`` (its first positional argument), if it is one."""
    positional = next((a for a in argv if not a.startswith("-")), None)
    return positional if positional in COMMANDS else None


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The argument parser with the sub-command named in ``argv`` registered, or every one
    (for `rlax --help`, a mistyped command, or no ``argv``)."""
    parser = argparse.ArgumentParser(prog="rlax", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    command = _command_of(argv) if argv is not None else None
    for name, (module, register) in COMMANDS.items():
        if command in (None, name):
            getattr(importlib.import_module(module), register)(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `rlax` console script."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        force=True,  # absl (imported by Orbax) installs a root handler at WARNING first
    )
    # JAX logs at INFO that it found no TPU on CPU-only machines: not news to the user
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
    try:
        return args.func(args)
    except USER_ERRORS as e:
        print(f"rlax {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
