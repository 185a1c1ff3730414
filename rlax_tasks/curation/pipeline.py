"""The curation pipeline: ingest -> validate -> normalize -> filters -> exact and near dedup ->
time split -> decontamination -> pass-rate filter. Every input row ends in the train or test
split, the quarantine (unreadable or invalid) or the removed log, with its stage and reason; the
counts per stage are checked to add up."""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import logging
from collections.abc import Callable, Sequence

import numpy as np
import pandas as pd

from rlax_tasks.curation import dedup, filters
from rlax_tasks.curation.decontam import NgramIndex
from rlax_tasks.curation.passrate import measure_pass_rates
from rlax_tasks.data.dataset import read_dataset
from rlax_tasks.data.files import expand_inputs
from rlax_tasks.data.formats import get_format
from rlax_tasks.data.normalize import dedup_key, normalize_prompt, normalize_text
from rlax_tasks.data.readers import Rejected, snippet
from rlax_tasks.data.schema import prompt_text
from rlax_tasks.evaluation.generation import GenerateFn
from rlax_tasks.utils.progress_meter import ProgressMeter

logger = logging.getLogger(__name__)

QUARANTINE_STAGES = ("ingest", "validate")


@dataclasses.dataclass(frozen=True)
class CurationConfig:
    """What to curate and how; `format` (and `columns` for the "columns" format) maps the input
    layout to rows; `split_date`: rows dated before it train, the rest test; `pass_rate_k` > 0
    turns on the pass-rate filter (needs a generator)."""

    inputs: tuple[str, ...]
    format: str = "rlax"
    columns: tuple[tuple[str, str], ...] = ()
    eval_sets: tuple[str, ...] = ()
    split_date: str | None = None
    ngram: int = 13
    near_dedup: bool = True
    minhash: dedup.MinHashConfig = dataclasses.field(default_factory=dedup.MinHashConfig)
    language_min_words: int = 6
    decontaminate_against_test: bool = True
    pass_rate_k: int = 0
    pass_rate_batch: int = 256

    def __post_init__(self) -> None:
        if isinstance(self.inputs, str) or not self.inputs:
            raise ValueError("inputs: give at least one input path (a list of paths)")
        if isinstance(self.eval_sets, str):
            raise ValueError("eval_sets must be a list of paths, not a string")
        get_format(self.format, dict(self.columns) or None)  # unknown names fail here
        if self.split_date is not None:
            try:
                dt.date.fromisoformat(self.split_date)
            except (TypeError, ValueError) as exc:
                raise ValueError(
                    f"split_date must be an ISO date (YYYY-MM-DD), got {self.split_date!r}"
                ) from exc
        if self.ngram < 1:
            raise ValueError(f"ngram must be >= 1, got {self.ngram}")
        if self.language_min_words < 1:
            raise ValueError(f"language_min_words must be >= 1, got {self.language_min_words}")
        if self.pass_rate_k < 0:
            raise ValueError(f"pass_rate_k must be >= 0 (0 = off), got {self.pass_rate_k}")
        if self.pass_rate_batch < 1:
            raise ValueError(f"pass_rate_batch must be >= 1, got {self.pass_rate_batch}")


@dataclasses.dataclass
class StageCount:
    """Rows entering a stage, rows it removed, rows leaving it."""

    stage: str
    rows_in: int
    removed: int
    note: str = ""

    @property
    def rows_out(self) -> int:
        return self.rows_in - self.removed

    def to_dict(self) -> dict:
        return {
            "stage": self.stage,
            "rows_in": self.rows_in,
            "removed": self.removed,
            "rows_out": self.rows_out,
            "note": self.note,
        }


@dataclasses.dataclass
class CurationResult:
    """The curated splits, every rejected row with its reason, and the counts per stage."""

    train: pd.DataFrame
    test: pd.DataFrame
    rejected: list[Rejected]
    stages: list[StageCount]
    rows_read: int
    files: list[str]
    pass_rate_k: int = 0

    @property
    def quarantined(self) -> list[Rejected]:
        return [r for r in self.rejected if r.stage in QUARANTINE_STAGES]

    @property
    def removed(self) -> list[Rejected]:
        return [r for r in self.rejected if r.stage not in QUARANTINE_STAGES]

    def counts(self) -> dict[str, int]:
        """Totals: read = train + test + quarantined + removed."""
        return {
            "rows_read": self.rows_read,
            "train": len(self.train),
            "test": len(self.test),
            "quarantined": len(self.quarantined),
            "removed": len(self.removed),
        }


class _Tracker:
    """Removes rows from the working frame stage by stage, logging each with its reason, and
    each stage's progress over the rows (one line every few seconds, one when done)."""

    def __init__(self, frame: pd.DataFrame) -> None:
        self.frame = frame
        self.rejected: list[Rejected] = []
        self.stages: list[StageCount] = []

    def meter(self, stage: str) -> ProgressMeter:
        """A progress meter over the working frame's rows, for ``stage``."""
        return ProgressMeter(stage, len(self.frame), logger=logger, unit="rows")

    def check(self, stage: str, field: str, rule: Callable[..., str | None], *columns: str) -> None:
        """Drops the rows for which ``rule(*values of columns)`` gives a reason."""
        meter = self.meter(stage)
        values = zip(*(self.frame[c].tolist() for c in columns), strict=True)
        self.drop(stage, field, [rule(*v) for v in meter.track(values)], meter)

    def drop(
        self,
        stage: str,
        field: str,
        reasons: Sequence[str | None],
        meter: ProgressMeter | None = None,
    ) -> None:
        """Drops the rows with a reason; ``meter`` (the stage's progress) is finished here."""
        frame = self.frame
        mask = np.fromiter((r is not None for r in reasons), bool, len(frame))
        files = frame["origin_file"].tolist()
        rows = frame["origin_row"].tolist()
        prompts = frame["prompt"].tolist()
        for i in np.flatnonzero(mask).tolist():
            self.rejected.append(
                Rejected(stage, files[i], int(rows[i]), field, str(reasons[i]), snippet(prompts[i]))
            )
        self.stages.append(StageCount(stage, len(frame), int(mask.sum())))
        self.frame = frame[~mask].reset_index(drop=True)
        if meter is None:
            logger.info("%s: removed %d of %d rows", stage, int(mask.sum()), len(frame))
        else:
            meter.finish(removed=int(mask.sum()))


def _where(frame: pd.DataFrame, i: int) -> str:
    return f"{frame['origin_file'].iat[i]}:{frame['origin_row'].iat[i]}"


def _exact_dedup(track: _Tracker) -> None:
    frame = track.frame
    keys = frame["_key"].tolist()
    first = dedup.exact_duplicates(keys)
    answers = frame["answer"].tolist()
    reasons: list[str | None] = [None] * len(frame)
    for i in np.flatnonzero(first != np.arange(len(frame))).tolist():
        f = int(first[i])
        reason = f"exact duplicate of {_where(frame, f)} (same prompt up to case/whitespace)"
        if answers[i] != answers[f]:
            reason += f"; answers differ: {answers[i]!r} here, {answers[f]!r} kept"
        reasons[i] = reason
    track.drop("exact_dedup", "prompt", reasons)


def _near_dedup(track: _Tracker, config: dedup.MinHashConfig) -> None:
    frame = track.frame
    meter = track.meter("near_dedup")
    rep, sim = dedup.near_duplicates(frame["_key"].tolist(), config, meter)
    reasons: list[str | None] = [None] * len(frame)
    for i in np.flatnonzero(rep != np.arange(len(frame))).tolist():
        reasons[i] = (
            f"near duplicate of {_where(frame, int(rep[i]))} (estimated Jaccard {sim[i]:.2f} "
            f"over {config.shingle}-character shingles; threshold {config.threshold})"
        )
    track.drop("near_dedup", "prompt", reasons, meter)


def _load_eval_prompts(path: str, config: CurationConfig) -> list[str]:
    """The problem texts of an evaluation set (read in the inputs' format when it fits, else
    as the row schema), normalized."""
    try:
        rows = read_dataset(path, config.format, dict(config.columns) or None)
        if not len(rows.frame):
            raise ValueError("no rows in the inputs' format")
    except ValueError:
        rows = read_dataset(path)
    if rows.rejected:
        logger.warning(
            "eval set %s: %d unreadable or invalid rows skipped (first: row %d: %s)",
            path,
            len(rows.rejected),
            rows.rejected[0].row,
            rows.rejected[0].reason,
        )
    return [normalize_text(prompt_text(p)) for p in rows.frame["prompt"].tolist()]


def run_curation(
    config: CurationConfig,
    generate: GenerateFn | None = None,
    unusable: Callable[[Sequence[str]], list[str | None]] | None = None,
) -> CurationResult:
    """Runs every stage; `generate` (and optionally `unusable`, a prompt screen) is required
    when `config.pass_rate_k` > 0."""
    if config.pass_rate_k and generate is None:
        raise ValueError("pass_rate_k > 0 needs a model to sample from (--model-dir)")
    files = [f for path in config.inputs for f in expand_inputs(path)]
    eval_index = NgramIndex(config.ngram)
    for path in config.eval_sets:  # load eval sets first: a bad path fails before the work
        eval_index.add(_load_eval_prompts(path, config), path)

    rows = read_dataset(files, config.format, dict(config.columns) or None)
    rows_read, frame, rejected = rows.rows_read, rows.frame, rows.rejected
    unreadable = sum(r.stage == "ingest" for r in rejected)
    stages = [
        StageCount("ingest", rows_read, unreadable),
        StageCount("validate", rows_read - unreadable, len(rejected) - unreadable),
    ]
    del rows
    if config.split_date is not None:
        undated = [i for i, d in enumerate(frame["date"].tolist()) if d is None]
        if undated:
            i = undated[0]
            raise ValueError(
                f"--split-date: {len(undated)} of {len(frame)} rows have no date (first: "
                f"{frame['origin_file'].iat[i]} row {frame['origin_row'].iat[i]}); a time split "
                "needs a date on every row: add a date column or leave out --split-date"
            )

    # object columns: Python strings are made once, not again at every .tolist()
    track = _Tracker(frame)
    meter = track.meter("normalize")
    prompts, texts, keys = [], [], []
    for prompt in meter.track(frame["prompt"].tolist()):
        prompts.append(normalize_prompt(prompt))
        texts.append(prompt_text(prompts[-1]))
        keys.append(dedup_key(texts[-1]))
    frame["prompt"] = pd.Series(prompts, dtype=object)
    frame["_text"] = pd.Series(texts, dtype=object)
    frame["_key"] = pd.Series(keys, dtype=object)
    del prompts, texts, keys, frame  # the tracker holds the only reference: rows can be freed
    track.drop(
        "normalize",
        "prompt",
        [None if t.strip() else "empty after normalization" for t in track.frame["_text"].tolist()],
        meter,
    )
    track.check("missing_reference", "answer,tests", filters.missing_reference, "answer", "tests")
    min_words = config.language_min_words
    track.check("non_english", "prompt", lambda t: filters.non_english(t, min_words), "_text")
    track.check("interactive", "prompt", filters.interactive, "_text", "metadata")
    _exact_dedup(track)
    if config.near_dedup:
        _near_dedup(track, config.minhash)
    frame = track.frame
    frame["id"] = pd.Series(
        [hashlib.sha1(k.encode("utf-8")).hexdigest()[:16] for k in frame["_key"].tolist()],
        dtype=object,
    )
    texts = frame["_text"]
    frame = frame.drop(columns=["_key", "_text"])

    if config.split_date is not None:
        is_test = (frame["date"] >= config.split_date).to_numpy(bool)
    else:
        is_test = np.zeros(len(frame), bool)
    train = frame[~is_test].reset_index(drop=True)
    test = frame[is_test].reset_index(drop=True)
    stages.extend(track.stages)
    rejected.extend(track.rejected)
    stages.append(
        StageCount(
            "time_split",
            len(frame),
            0,
            f"{len(train)} train (date < {config.split_date}), {len(test)} test; "
            "the stages below apply to train only"
            if config.split_date
            else "no split date: all rows train",
        )
    )
    logger.info("time split at %s: %d train, %d test", config.split_date, len(train), len(test))

    track = _Tracker(train)
    if config.decontaminate_against_test and len(test):
        eval_index.add(texts[is_test].tolist(), "test split")
    meter = track.meter("decontaminate") if len(eval_index) else None
    reasons = eval_index.match_many(texts[~is_test].tolist(), meter)
    track.drop("decontaminate", "prompt", reasons, meter)

    train = track.frame
    train["pass_rate"] = pd.Series([None] * len(train), dtype=object)
    test["pass_rate"] = pd.Series([None] * len(test), dtype=object)
    if config.pass_rate_k:
        meter = track.meter("pass_rate")
        rates, reasons = measure_pass_rates(
            train["prompt"].tolist(),
            train["answer"].tolist(),
            train["tests"].tolist(),
            generate,
            config.pass_rate_k,
            unusable=unusable,  # type: ignore[arg-type]
            batch_size=config.pass_rate_batch,
            progress=meter,
        )
        train["pass_rate"] = pd.Series(rates, dtype=object)
        track.frame = train
        track.drop("pass_rate", "prompt", reasons, meter)
        train = track.frame
    stages.extend(track.stages)
    rejected.extend(track.rejected)
    result = CurationResult(train, test, rejected, stages, rows_read, files, config.pass_rate_k)
    counts = result.counts()
    accounted = counts["train"] + counts["test"] + counts["quarantined"] + counts["removed"]
    if accounted != rows_read:
        raise RuntimeError(f"row accounting broken: read {rows_read}, accounted {accounted}")
    return result
