"""The `rlax` command line: one sub-command per component."""

from __future__ import annotations

import argparse
import logging
import sys

from rlax_tasks.airflow.local_dag_run import add_airflow_parser
from rlax_tasks.curation.cli import add_curate_parser
from rlax_tasks.data.cli import add_data_parser
from rlax_tasks.evaluation.cli import add_eval_parser
from rlax_tasks.models import CheckpointError, ModelConfigError
from rlax_tasks.paramserver import add_ps_parser
from rlax_tasks.rewards.service import add_verify_parser
from rlax_tasks.rollout.service import add_worker_parser
from rlax_tasks.run.cli import add_run_parser
from rlax_tasks.run.export import add_export_parser
from rlax_tasks.run.supervisor import ComponentFailed
from rlax_tasks.run.trainer_process import add_trainer_parser
from rlax_tasks.rundir.lock import RunLocked

# reported as one line, exit 2, never a traceback: user mistakes, a run directory held by a live
# run, and a run component's own error (rlax run: the component and its log)
USER_ERRORS = (
    CheckpointError,
    ModelConfigError,
    ValueError,
    FileNotFoundError,
    RunLocked,
    ComponentFailed,
)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every sub-command registered."""
    parser = argparse.ArgumentParser(prog="rlax", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    add_verify_parser(sub)
    add_curate_parser(sub)
    add_data_parser(sub)
    add_eval_parser(sub)
    add_ps_parser(sub)
    add_worker_parser(sub)
    add_trainer_parser(sub)
    add_run_parser(sub)
    add_export_parser(sub)
    add_airflow_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `rlax` console script."""
    args = build_parser().parse_args(argv)
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
