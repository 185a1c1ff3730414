"""Checks a run's datasets before anything starts: `rlax run` and the training DAG's plan task.

``check_datasets(cfg)`` opens every dataset file with the controller's and evaluator's readers
and raises ``DatasetError`` naming dataset, file, row and fault (missing, unreadable, damaged, no
usable row, no reference); rows that only misfit the format are skipped and counted (docs/design.md
§11)."""

from __future__ import annotations

from typing import Any

from rlax_tasks.config import FileSource
from rlax_tasks.controller.mixture import FilePrompts


class DatasetError(ValueError):
    """A dataset of the run configuration cannot be used; the message names the file and row."""

    def __init__(self, message: str, file: str = "", row: int | None = None) -> None:
        super().__init__(message)
        self.file, self.row = file, row


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
        prompts = FilePrompts(source)
    except FileNotFoundError as e:
        raise DatasetError(f"{where}: {e}: fix the path", source.path) from None
    except ValueError as e:
        raise DatasetError(f"{where}: {e}", source.path) from None
    except OSError as e:
        raise DatasetError(f"{where}: cannot be read: {e}", source.path) from None
    broken = [r for r in prompts.rejected if r.stage == "ingest"]
    if broken:
        first = broken[0]
        raise DatasetError(
            f"{where}: {first.file} row {first.row} cannot be read: {first.reason} "
            f"({len(broken)} such row(s)); the file is damaged: repair or remove those rows "
            "(`rlax data preview` lists them, `rlax curate` writes a clean copy)",
            first.file,
            first.row,
        )


def check_datasets(cfg: Any) -> None:
    """Opens every dataset ``cfg`` names; raises DatasetError (a ValueError) on the first that
    cannot be used, before any process starts."""
    for field, spec in _named(cfg):
        check_dataset(field, spec)


__all__ = ["DatasetError", "check_dataset", "check_datasets"]
