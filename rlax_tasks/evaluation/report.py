"""Writing evaluation results: JSON, a Markdown summary (side by side when two models are
compared), per-sample JSONL, and PNG plots (pass@k / maj@k against k, pass@1 per source)."""

from __future__ import annotations

import io
import json
import logging
from typing import Any

from rlax_tasks.data.files import join, write_bytes
from rlax_tasks.evaluation.evaluator import EvalResult
from rlax_tasks.rundir.paths import EVAL_RESULTS

logger = logging.getLogger(__name__)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def results_dict(results: list[EvalResult], dataset: str) -> dict[str, Any]:
    """Every model's metrics; with two models, the difference (second minus first) too."""
    out: dict[str, Any] = {"dataset": dataset, "models": [r.to_dict() for r in results]}
    if len(results) == 2:
        a, b = results[0].overall, results[1].overall
        out["delta"] = {
            key: (b[key] - a[key])
            for key in a
            if key not in ("prompts", "maj_prompts", "skipped")
            and a[key] is not None
            and b[key] is not None
        }
    return out


def _metric_keys(result: EvalResult) -> list[str]:
    ks = result.config.ks
    return [*(f"pass@{k}" for k in ks), *(f"maj@{k}" for k in ks), "mean_reward"]


def summary_markdown(results: list[EvalResult], dataset: str) -> str:
    """A Markdown page: overall metrics (models side by side), then per source and difficulty."""
    keys = _metric_keys(results[0])
    first = results[0]
    lines = [
        "# Evaluation",
        "",
        f"Dataset `{dataset}`: {first.overall['prompts']} prompts, n={first.config.n} samples "
        f"each; maj@k over the {first.overall['maj_prompts']} prompts with an answer."
        + (
            f" {len(first.skipped)} prompt(s) skipped (first: {first.skipped[0]['reason']})."
            if first.skipped
            else ""
        ),
        "",
        "| metric | "
        + " | ".join(f"`{r.name}`" for r in results)
        + (" | delta |" if len(results) == 2 else " |"),
        "|---|" + "---:|" * (len(results) + (1 if len(results) == 2 else 0)),
    ]
    for key in keys:
        vals = [r.overall[key] for r in results]
        row = f"| {key} | " + " | ".join(_fmt(v) for v in vals)
        if len(results) == 2:
            delta = None if None in vals else vals[1] - vals[0]
            row += " | " + ("-" if delta is None else f"{delta:+.3f}")
        lines.append(row + " |")
    for title, attr in (("source", "by_source"), ("difficulty", "by_difficulty")):
        lines += [
            "",
            f"## By {title}",
            "",
            f"| {title} | prompts | "
            + " | ".join(f"pass@{first.config.ks[0]} `{r.name}`" for r in results)
            + " |",
            "|---|---:|" + "---:|" * len(results),
        ]
        for group, stats in getattr(first, attr).items():
            vals = [
                getattr(r, attr).get(group, {}).get(f"pass@{first.config.ks[0]}") for r in results
            ]
            lines.append(
                f"| {group} | {stats['prompts']} | " + " | ".join(_fmt(v) for v in vals) + " |"
            )
    return "\n".join(lines) + "\n"


def _plots(results: list[EvalResult]) -> dict[str, bytes]:
    import matplotlib  # lazy: heavy, only where plots are drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def png(fig: Any) -> bytes:
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
        plt.close(fig)
        return buf.getvalue()

    ks = list(results[0].config.ks)
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results:
        ax.plot(ks, [r.overall[f"pass@{k}"] for k in ks], marker="o", label=f"{r.name} pass@k")
        if r.overall["maj_prompts"]:
            ax.plot(
                ks,
                [r.overall[f"maj@{k}"] for k in ks],
                marker="s",
                linestyle="--",
                label=f"{r.name} maj@k",
            )
    ax.set_xscale("log", base=2)
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.set_ylim(0, 1)
    ax.set_xlabel("k")
    ax.set_ylabel("score")
    ax.set_title("pass@k and maj@k")
    ax.legend(fontsize=8)
    plots = {"pass_at_k.png": png(fig)}

    sources = list(results[0].by_source)
    k0 = ks[0]
    fig, ax = plt.subplots(figsize=(max(6, len(sources) * 0.8), 4))
    width = 0.8 / len(results)
    for j, r in enumerate(results):
        xs = [i + j * width for i in range(len(sources))]
        ax.bar(
            xs,
            [r.by_source.get(s, {}).get(f"pass@{k0}", 0.0) for s in sources],
            width,
            label=r.name,
        )
    ax.set_xticks(
        [i + 0.4 - width / 2 for i in range(len(sources))], sources, rotation=30, ha="right"
    )
    ax.set_ylim(0, 1)
    ax.set_ylabel(f"pass@{k0}")
    ax.set_title(f"pass@{k0} per source")
    ax.legend(fontsize=8)
    plots["by_source.png"] = png(fig)
    return plots


def write_eval_outputs(results: list[EvalResult], dataset: str, out_dir: str) -> dict[str, Any]:
    """Writes results.json, summary.md, samples.jsonl and the plots under `out_dir`."""
    if not results:
        raise ValueError("no evaluation results to write")
    data = results_dict(results, dataset)
    samples = "".join(
        json.dumps(
            {"model": r.name, **{k: v for k, v in row.items() if k != "has_answer"}},
            ensure_ascii=False,
        )
        + "\n"
        for r in results
        for row in r.rows
    )
    files = {
        EVAL_RESULTS: json.dumps(data, indent=2).encode("utf-8"),
        "summary.md": summary_markdown(results, dataset).encode("utf-8"),
        "samples.jsonl": samples.encode("utf-8"),
        **_plots(results),
    }
    for name, payload in files.items():
        write_bytes(join(out_dir, name), payload)
    logger.info("evaluation outputs written to %s", out_dir)
    return data
