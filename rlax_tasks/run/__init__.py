"""`rlax run`: the whole system as local processes under a supervisor, and its report."""

from rlax_tasks.run.cli import add_run_parser

__all__ = ["add_run_parser"]
