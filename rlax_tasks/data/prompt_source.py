"""A dataset file as prompts (docs/design.md §11): the one reader of dataset rows for the
launcher's preflight, evaluation and the controller. It opens the file through its format, pairs
each usable row's prompt with what scores it, and turns every fault into a ``DatasetError``
naming the file, the row and what to do."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from rlax_tasks.data.code_tests import CodeTests

if TYPE_CHECKING:  # lazy: pandas loads only when a file is read
    from rlax_tasks.data.dataset import DatasetRows
    from rlax_tasks.data.readers import Rejected


class DatasetError(ValueError):
    """A dataset that cannot be used; the message names the file (and the row) and the fix."""

    def __init__(self, message: str, file: str = "", row: int | None = None) -> None:
        super().__init__(message)
        self.file, self.row = file, row


class FileSpec(Protocol):
    """Where a dataset is and how to read it (the run configuration's ``FileSource``)."""

    path: str
    format: str
    columns: Mapping[str, str] | None
    verifier: str


class PromptSource(Protocol):
    """A fixed, indexable list of (prompt, reference) pairs; a prompt is text or messages."""

    def __len__(self) -> int: ...

    def get(self, index: int) -> tuple[Any, str]: ...


def open_dataset(
    path: str,
    format: str = "rlax",  # noqa: A002 - the user-facing name
    columns: Mapping[str, str] | None = None,
    limit: int | None = None,
) -> DatasetRows:
    """The usable rows of the dataset at ``path`` (``load_dataset``), its faults as
    ``DatasetError``: missing, unreadable, or without a usable row."""
    from rlax_tasks.data.dataset import load_dataset  # lazy: pandas

    try:
        return load_dataset(path, format, columns, limit)
    except FileNotFoundError as e:
        raise DatasetError(f"{e}: fix the path", path) from None
    except ValueError as e:
        raise DatasetError(str(e), path) from None
    except OSError as e:
        raise DatasetError(f"cannot be read: {e}", path) from None


def rejected_note(rows: DatasetRows) -> str | None:
    """One line on the rows left out of ``rows`` (how many, the first with its file, row and
    reason); None when every row is used."""
    if not rows.rejected:
        return None
    first = rows.rejected[0]
    return (
        f"{len(rows.rejected)} dataset row(s) could not be read as {rows.format.name} and were "
        f"left out; first: {first.file} row {first.row}: {first.reason}"
    )


class FilePrompts:
    """The usable rows of a dataset file as (prompt, reference) pairs: the answer (math) or the
    test suite as JSON (code). Rows that cannot be used are in ``rejected``."""

    def __init__(self, spec: FileSpec) -> None:
        rows = open_dataset(spec.path, spec.format, spec.columns)
        frame = rows.frame
        self.spec, self.rejected = spec, list(rows.rejected)
        code = spec.verifier == "code"
        field = "tests" if code else "answer"
        values = frame[field].tolist()
        missing = [i for i, v in enumerate(values) if v is None]
        if missing:
            file, row = (
                frame["origin_file"].iat[missing[0]],
                int(frame["origin_row"].iat[missing[0]]),
            )
            raise DatasetError(
                f"dataset {spec.path}: {len(missing)} row(s) have no {field} for verifier "
                f"{spec.verifier!r}; first: {file} row {row} (set the dataset's verifier to match)",
                file,
                row,
            )
        self.prompts = frame["prompt"].tolist()
        self.references = [CodeTests.from_value(v).to_json() if code else str(v) for v in values]

    def __len__(self) -> int:
        return len(self.prompts)

    def get(self, index: int) -> tuple[Any, str]:
        return self.prompts[index], self.references[index]

    @property
    def damaged(self) -> list[Rejected]:
        """The records the reader could not read at all (broken JSON, bad bytes, a CSV record
        of the wrong width), as opposed to rows that only misfit the format."""
        return [r for r in self.rejected if r.stage == "ingest"]

    def check_intact(self) -> None:
        """DatasetError naming the first damaged record, when the file has any."""
        broken = self.damaged
        if broken:
            first = broken[0]
            raise DatasetError(
                f"{first.file} row {first.row} cannot be read: {first.reason} "
                f"({len(broken)} such row(s)); the file is damaged: repair or remove those rows "
                "(`rlax data preview` lists them, `rlax curate` writes a clean copy)",
                first.file,
                first.row,
            )


def episode_row(prompt: Any, reference: Any, verifier: str) -> dict[str, Any]:
    """The row an episode resets from: the prompt and what scores it, under "tests" for the
    code verifier (a test suite), else under "answer"."""
    return {"prompt": prompt, "tests" if verifier == "code" else "answer": reference}


__all__ = [
    "DatasetError",
    "FilePrompts",
    "FileSpec",
    "PromptSource",
    "episode_row",
    "open_dataset",
    "rejected_note",
]
