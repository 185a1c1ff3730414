"""Writing a curation result: Parquet splits, quarantine and removed logs, a report with the
counts per stage (JSON and Markdown) and length / difficulty histograms (PNG)."""

from __future__ import annotations

import io
import json
import logging
from collections import Counter
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from rlax_tasks.curation.pipeline import CurationConfig, CurationResult
from rlax_tasks.data.files import join, write_bytes
from rlax_tasks.data.schema import prompt_text

logger = logging.getLogger(__name__)

# chat prompts go to `messages` (prompt is null there); text prompts to `prompt`
MESSAGES_TYPE = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
# a code test suite (rlax_tasks.data.code_tests)
TESTS_TYPE = pa.struct(
    [
        (
            "cases",
            pa.list_(
                pa.struct([("input", pa.string()), ("output", pa.string()), ("public", pa.bool_())])
            ),
        ),
        ("fn_name", pa.string()),
        ("time_limit_s", pa.float64()),
        ("memory_mb", pa.int64()),
    ]
)
PARQUET_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("prompt", pa.string()),
        ("messages", MESSAGES_TYPE),
        ("answer", pa.string()),
        ("tests", TESTS_TYPE),
        ("source", pa.string()),
        ("date", pa.date32()),
        ("metadata", pa.string()),
        ("origin_file", pa.string()),
        ("origin_row", pa.int64()),
        ("pass_rate", pa.float64()),
    ]
)


def to_arrow(frame: pd.DataFrame) -> pa.Table:
    """A curated split as an Arrow table with the fixed schema (metadata as a JSON string)."""
    n = len(frame)

    def col(name: str) -> list:
        return frame[name].tolist() if n else []

    prompts = col("prompt")
    arrays = {
        "id": pa.array(col("id"), pa.string()),
        "prompt": pa.array([p if isinstance(p, str) else None for p in prompts], pa.string()),
        "messages": pa.array([None if isinstance(p, str) else p for p in prompts], MESSAGES_TYPE),
        "answer": pa.array(col("answer"), pa.string()),
        "tests": pa.array(col("tests"), TESTS_TYPE),
        "source": pa.array(col("source"), pa.string()),
        "date": pa.array(col("date"), pa.string()).cast(pa.date32()),
        "metadata": pa.array(
            [json.dumps(m, ensure_ascii=False) for m in col("metadata")], pa.string()
        ),
        "origin_file": pa.array(col("origin_file"), pa.string()),
        "origin_row": pa.array(col("origin_row"), pa.int64()),
        "pass_rate": pa.array(
            [None if r is None or r != r else float(r) for r in col("pass_rate")], pa.float64()
        ),
    }
    return pa.table(arrays, schema=PARQUET_SCHEMA)


def _parquet_bytes(frame: pd.DataFrame) -> bytes:
    sink = io.BytesIO()
    pq.write_table(to_arrow(frame), sink)
    return sink.getvalue()


def _jsonl_bytes(records: list[dict]) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")


def _difficulty(frame: pd.DataFrame) -> tuple[str, list[float]] | None:
    """(label, values) for the difficulty histogram: 1 - pass rate when measured, else a
    numeric metadata "difficulty" or "level"."""
    rates = (
        [r for r in frame["pass_rate"].tolist() if r is not None and r == r] if len(frame) else []
    )
    if rates:
        return "difficulty = 1 - pass rate", [1.0 - r for r in rates]
    for key in ("difficulty", "level"):
        values = []
        for meta in frame["metadata"].tolist() if len(frame) else []:
            v = meta.get(key)
            if isinstance(v, int | float) and not isinstance(v, bool):
                values.append(float(v))
        if values:
            return f"metadata.{key}", values
    return None


def _histograms(result: CurationResult) -> dict[str, bytes]:
    import matplotlib  # lazy: heavy, only where plots are drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pngs: dict[str, bytes] = {}

    def save(fig: Any, name: str) -> None:
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
        plt.close(fig)
        pngs[name] = buf.getvalue()

    fig, ax = plt.subplots(figsize=(7, 4))
    for split, frame in (("train", result.train), ("test", result.test)):
        if len(frame):
            lengths = np.fromiter(
                (len(prompt_text(p)) for p in frame["prompt"]), np.int64, len(frame)
            )
            ax.hist(lengths, bins=50, alpha=0.6, label=f"{split} (n={len(frame)})")
    ax.set_xlabel("prompt length (characters)")
    ax.set_ylabel("rows")
    ax.set_title("Prompt lengths")
    if len(result.train) or len(result.test):
        ax.legend()
    save(fig, "lengths.png")

    diffs = {s: _difficulty(f) for s, f in (("train", result.train), ("test", result.test))}
    if any(d is not None for d in diffs.values()):
        fig, ax = plt.subplots(figsize=(7, 4))
        label = ""
        for split, d in diffs.items():
            if d is not None:
                label = d[0]
                ax.hist(d[1], bins=20, alpha=0.6, label=f"{split} (n={len(d[1])})")
        ax.set_xlabel(label)
        ax.set_ylabel("rows")
        ax.set_title("Difficulty")
        ax.legend()
        save(fig, "difficulty.png")
    return pngs


def report_dict(result: CurationResult, config: CurationConfig) -> dict[str, Any]:
    """The curation report: totals, counts per stage, reasons per field, settings."""
    quarantine_fields = Counter(
        f for r in result.quarantined for f in (r.field.split(",") if r.field else ["(record)"])
    )
    report: dict[str, Any] = {
        "totals": result.counts(),
        "stages": [s.to_dict() for s in result.stages],
        "quarantine_by_field": dict(sorted(quarantine_fields.items())),
        "removed_by_stage": dict(Counter(r.stage for r in result.removed)),
        "files": result.files,
        "config": {
            "eval_sets": list(config.eval_sets),
            "split_date": config.split_date,
            "ngram": config.ngram,
            "near_dedup": config.near_dedup,
            "minhash": {
                "shingle": config.minhash.shingle,
                "bands": config.minhash.bands,
                "rows_per_band": config.minhash.rows_per_band,
                "threshold": config.minhash.threshold,
                "same_numbers": config.minhash.same_numbers,
            },
            "pass_rate_k": config.pass_rate_k,
        },
    }
    if len(result.train) and result.pass_rate_k:
        rates = [r for r in result.train["pass_rate"].tolist() if r is not None]
        report["train_pass_rate_mean"] = float(np.mean(rates)) if rates else None
    return report


def report_markdown(report: dict[str, Any]) -> str:
    """The report as a Markdown page."""
    t = report["totals"]
    lines = [
        "# Curation report",
        "",
        f"Read {t['rows_read']} rows from {len(report['files'])} file(s): **{t['train']} train**, "
        f"**{t['test']} test**, {t['quarantined']} quarantined, {t['removed']} removed.",
        "",
        "| stage | rows in | removed | rows out | note |",
        "|---|---:|---:|---:|---|",
    ]
    for s in report["stages"]:
        lines.append(
            f"| {s['stage']} | {s['rows_in']} | {s['removed']} | {s['rows_out']} | {s['note']} |"
        )
    if report["quarantine_by_field"]:
        lines += ["", "Quarantined rows by field (a row may have several):", ""]
        lines += [f"- {f}: {c}" for f, c in report["quarantine_by_field"].items()]
    if report.get("train_pass_rate_mean") is not None:
        lines += [
            "",
            f"Mean pass rate of kept training prompts: {report['train_pass_rate_mean']:.3f}",
        ]
    lines += [
        "",
        "Files: `train.parquet`, `test.parquet`, `quarantine.jsonl` (unreadable or "
        "invalid rows), `removed.jsonl` (filtered rows), `lengths.png`"
        + (", `difficulty.png`" if report.get("plots", {}).get("difficulty") else "")
        + ".",
    ]
    return "\n".join(lines) + "\n"


def write_outputs(result: CurationResult, config: CurationConfig, out_dir: str) -> dict:
    """Write everything under `out_dir` (local or gs://); returns the report dict."""
    report = report_dict(result, config)
    pngs = _histograms(result)
    report["plots"] = {name.removesuffix(".png"): name for name in pngs}
    if "difficulty.png" not in pngs:
        report["plots_note"] = (
            "no difficulty histogram: no pass rates measured and no numeric "
            "metadata.difficulty / metadata.level"
        )
    files = {
        "train.parquet": _parquet_bytes(result.train),
        "test.parquet": _parquet_bytes(result.test),
        "quarantine.jsonl": _jsonl_bytes([r.to_dict() for r in result.quarantined]),
        "removed.jsonl": _jsonl_bytes([r.to_dict() for r in result.removed]),
        **pngs,
        "report.json": json.dumps(report, indent=2).encode("utf-8"),
        "report.md": report_markdown(report).encode("utf-8"),
    }
    for name, data in files.items():
        write_bytes(join(out_dir, name), data)
    logger.info("curation outputs written to %s", out_dir)
    return report
