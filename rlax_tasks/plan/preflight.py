"""Checks a run's datasets before anything starts: `rlax run` and the training DAG's plan task.

``check_datasets(cfg)`` opens every dataset file with the prompt source training and evaluation
read it with (``rlax_tasks.data.prompt_source``) and raises ``DatasetError`` naming dataset, file,
row and fault (missing, unreadable, damaged, no usable row, no reference); rows that only misfit
the format are skipped and counted (docs/design.md §11)."""

from __future__ import annotations

from typing import Any

from rlax_tasks.config import FileSource
from rlax_tasks.data.prompt_source import DatasetError, FilePrompts


def _named(cfg: Any) -> list[tuple[str, Any]]:
    """(config field, DatasetSpec) of every dataset the run reads."""
    specs = [(f"datasets[{i}]", spec) for i, spec in enumerate(cfg.datasets)]
    if cfg.eval.dataset is not None:
        specs.append(("eval.dataset", cfg.eval.dataset))
    return specs


def check_environment(field: str, spec: Any) -> None:
    """DatasetError naming ``<field>.environment`` when the dataset's environment is not
    registered (nor installed by a package's entry point) or its settings do not make one."""
    if getattr(spec, "environment", None) is None:
        return
    from rlax_tasks.environments import check_environment as registered
    from rlax_tasks.environments import make_environment

    where = f"{field}.environment"
    try:
        registered(spec.environment)
    except ValueError as e:
        raise DatasetError(f"{where}.{e}") from None
    try:
        make_environment(spec.environment)
    except (TypeError, ValueError) as e:
        raise DatasetError(f"{where}: {e}") from None


def check_dataset(field: str, spec: Any) -> None:
    """Opens one dataset spec's file as training would; DatasetError when it cannot be used."""
    check_environment(field, spec)
    source = spec.source
    if not isinstance(source, FileSource):
        return
    where = f"{field} ({spec.name!r}, {source.path}, format {source.format})"
    try:
        FilePrompts(source).check_intact()
    except DatasetError as e:
        raise DatasetError(f"{where}: {e}", e.file, e.row) from None


def check_datasets(cfg: Any) -> None:
    """Opens every dataset ``cfg`` names; raises DatasetError (a ValueError) on the first that
    cannot be used, before any process starts."""
    for field, spec in _named(cfg):
        check_dataset(field, spec)


__all__ = ["DatasetError", "check_dataset", "check_datasets"]
