"""Checks a run's datasets before anything starts: `rlax run` and the training DAG's plan task.

``check_datasets(cfg)`` opens every dataset file the configuration names (the training mixture
and the held-out ``eval.dataset``) with the readers the controller and the evaluator use
(``rlax_tasks.controller.mixture.FilePrompts`` over ``rlax_tasks.data``) and raises
``DatasetError`` naming the dataset, the file, the row and what is wrong: a path that does not
exist, a file that cannot be read, a row that cannot be read at all (broken JSON, bytes that are
not UTF-8, a CSV record with the wrong number of fields: the file is damaged), a file without a
usable row, rows without the reference their verifier needs. Rows that read fine but do not fit
the dataset's format (a GSM8K row without ``####``) are skipped and counted, as in training
(DESIGN §11; the reader logs them). Synthetic tasks were checked when the config was loaded.
"""

from __future__ import annotations

from typing import Any


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


def check_dataset(field: str, spec: Any) -> None:
    """Opens one dataset spec's file as training would; DatasetError when it cannot be used."""
    from rlax_tasks.config import FileSource
    from rlax_tasks.controller.mixture import FilePrompts

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
