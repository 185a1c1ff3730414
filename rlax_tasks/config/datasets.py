"""The prompt mixture's datasets: a synthetic task or a dataset file, named and weighted
(docs/design.md §11)."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any

from rlax_tasks.config.checks import (
    NAME_RE,
    ConfigError,
    build,
    check_float,
    check_int,
    check_str,
    set_field,
)
from rlax_tasks.config.environment import EnvironmentSpec
from rlax_tasks.data.files import file_format
from rlax_tasks.data.formats import FORMAT_NAMES, get_format
from rlax_tasks.rewards.tasks import TASKS, make_task
from rlax_tasks.utils import validation

FILE_VERIFIERS = ("math", "code")


@dataclasses.dataclass(frozen=True)
class SyntheticSource:
    """A synthetic task of ``rlax_tasks.rewards.tasks`` (make_task(task, **knobs)): the first
    ``size`` problems of its stream for ``seed``. ``prompt_format`` "compact" renders arithmetic
    as "12+34=" (the tiny-arith models' format, rlax_tasks.warmup.TinyArith)."""

    task: str
    knobs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    size: int = 10_000
    seed: int = 0
    prompt_format: str = "task"
    # leave out every problem of another stream's first exclude_size problems (the held-out
    # evaluation set: small tasks repeat problems across streams)
    exclude_seed: int | None = None
    exclude_size: int = 0

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ConfigError(
                "task",
                f"unknown task {self.task!r}{validation.did_you_mean(self.task, TASKS)}; "
                f"valid: {', '.join(sorted(TASKS))}",
            )
        if not isinstance(self.knobs, Mapping):
            raise ConfigError("knobs", f"must be a mapping, got {self.knobs!r}")
        set_field(self, "knobs", dict(self.knobs))
        check_int(self, "size", low=1)
        check_int(self, "seed")
        check_str(self, "prompt_format", ("task", "compact"))
        check_int(self, "exclude_seed", optional=True)
        check_int(self, "exclude_size", low=0)
        if self.exclude_seed is not None and self.exclude_seed == self.seed:
            raise ConfigError("exclude_seed", f"must differ from seed ({self.seed})")
        if self.prompt_format == "compact" and self.task != "arithmetic":
            raise ConfigError(
                "prompt_format", f"'compact' is for the arithmetic task, not {self.task!r}"
            )
        try:
            make_task(self.task, **copy.deepcopy(dict(self.knobs)))
        except (ValueError, TypeError) as e:
            raise ConfigError("knobs", str(e)) from None


@dataclasses.dataclass(frozen=True)
class FileSource:
    """A dataset file (JSONL/Parquet/CSV, local or gs://) in a layout ``format`` reads
    (docs/design.md §11: rlax, gsm8k, math, dapo, messages, code, or columns with ``columns``);
    ``verifier`` defaults to the format's (code for code, else math)."""

    path: str
    verifier: str | None = None
    format: str = "rlax"
    columns: Mapping[str, str] | None = None

    def __post_init__(self) -> None:
        check_str(self, "path")
        if not self.path.endswith("/"):
            try:
                file_format(self.path)
            except ValueError as e:
                raise ConfigError("path", str(e)) from None
        check_str(self, "format", FORMAT_NAMES)
        if self.columns is not None and not isinstance(self.columns, Mapping):
            raise ConfigError(
                "columns", f"must be a mapping of fields to columns, got {self.columns!r}"
            )
        try:
            fmt = get_format(self.format, self.columns)
        except ValueError as e:
            raise ConfigError("columns", str(e).removeprefix("columns: ")) from None
        if self.columns is not None:
            set_field(self, "columns", dict(self.columns))
        if self.verifier is None:
            set_field(self, "verifier", fmt.verifier)
        check_str(self, "verifier", FILE_VERIFIERS)


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    """One component of the prompt mixture; ``name`` becomes the prefix of its prompt ids."""

    name: str
    source: SyntheticSource | FileSource
    weight: float = 1.0
    # its prompts are multi-turn episodes in this environment (docs/design.md §15); without
    # one, each is a single completion (an environment of one step)
    environment: EnvironmentSpec | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not NAME_RE.match(self.name):
            raise ConfigError(
                "name",
                f"must be letters, digits, '_', '.', '-' (it prefixes prompt ids), "
                f"got {self.name!r}",
            )
        if isinstance(self.source, Mapping):
            set_field(self, "source", _source_from(self.source))
        if not isinstance(self.source, SyntheticSource | FileSource):
            raise ConfigError("source", f"must be a synthetic task or a file, got {self.source!r}")
        check_float(self, "weight", low=0.0, open_low=True)
        if self.environment is not None and not isinstance(self.environment, EnvironmentSpec):
            try:
                set_field(self, "environment", EnvironmentSpec.from_dict(self.environment))
            except ConfigError as e:
                raise e.under("environment") from None

    @property
    def verifier(self) -> str:
        """How responses are scored: "task" (the synthetic task's scorer), "math" or "code"."""
        return "task" if isinstance(self.source, SyntheticSource) else self.source.verifier


def _source_from(raw: Mapping[str, Any]) -> SyntheticSource | FileSource:
    if "task" in raw and "path" in raw:
        raise ConfigError("", "give either task (synthetic) or path (a file), not both").under(
            "source"
        )
    if "task" in raw:
        return build(SyntheticSource, raw, "source")
    if "path" in raw:
        return build(FileSource, raw, "source")
    raise ConfigError(
        "source",
        "needs task: <arithmetic|countdown> (synthetic) or path: <file.parquet|.jsonl> "
        "(with format: gsm8k, math, dapo, messages, code, columns or rlax)",
    )
