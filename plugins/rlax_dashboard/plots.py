"""PNG plots of one run's series, or of several runs side by side (matplotlib, Agg backend: no
display needed on the api-server)."""

from __future__ import annotations

import io
import textwrap
from collections.abc import Sequence

from rlax_dashboard.runs import RunSeries

Points = Sequence[tuple[float, float]]
NO_DATA = "no data yet"

# plot name -> (title, x label, y label)
PLOTS = {
    "reward": ("Reward per step", "training step", "mean reward"),
    "pass_at_k": ("Held-out pass@k", "weight version", "pass@k"),
    "staleness": ("Rollout staleness", "training step", "v − u (mean)"),
    "weight_sync": ("Weight sync time", "version", "seconds"),
}
# the compare view: one plot per quantity, one line per run ("{k}": the pass@k shown)
COMPARE_PLOTS = {
    "reward": ("Reward per step", "training step", "mean reward"),
    "pass_at_k": ("Held-out {k} by step", "training step (weight version)", "{k}"),
    "pass_at_k_time": ("Held-out {k} by training time", "training time (s)", "{k}"),
    "staleness": ("Rollout staleness", "training step", "v − u (mean)"),
    "weight_sync": ("Weight sync time", "version", "seconds"),
}


def render_png(series: RunSeries, name: str, empty: str = NO_DATA) -> bytes:
    """The PNG bytes of plot ``name`` (one of PLOTS); an empty series gives an empty, labelled
    plot saying ``empty`` (why it is empty: ``empty.empty_reasons``); an unknown name is a
    KeyError."""
    lines = {
        "reward": {"reward": series.reward},
        "pass_at_k": series.pass_at,
        "staleness": {"staleness": series.staleness},
        "weight_sync": {"weight sync": series.weight_sync},
    }[name]
    title, xlabel, ylabel = PLOTS[name]
    return _draw(lines, title, xlabel, ylabel, name == "pass_at_k", integer_x=True, empty=empty)


def render_compare_png(runs: dict[str, RunSeries], name: str, k: str) -> bytes:
    """The PNG bytes of compare plot ``name`` (one of COMPARE_PLOTS): one line per run (``runs``:
    label -> series), pass@k plots showing ``k`` (e.g. "pass@1"); unknown name: KeyError."""
    pick = {
        "reward": lambda s: s.reward,
        "pass_at_k": lambda s: s.pass_at.get(k, []),
        "pass_at_k_time": lambda s: s.pass_at_time.get(k, []),
        "staleness": lambda s: s.staleness,
        "weight_sync": lambda s: s.weight_sync,
    }[name]
    title, xlabel, ylabel = (t.format(k=k) for t in COMPARE_PLOTS[name])
    lines = {label: pick(series) for label, series in runs.items()}
    probability = name.startswith("pass_at_k")
    return _draw(lines, title, xlabel, ylabel, probability, integer_x=name != "pass_at_k_time")


def _draw(
    lines: dict[str, Points],
    title: str,
    xlabel: str,
    ylabel: str,
    probability: bool,
    *,
    integer_x: bool,
    empty: str = NO_DATA,
) -> bytes:
    """One figure with a line per entry of ``lines`` (a legend when named lines are several or
    a probability is drawn); ``empty``, wrapped, when every line is empty."""
    import matplotlib  # lazily: every Airflow process imports plugins, few draw plots

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(6, 3.4))
    try:
        drawn = 0
        for label, points in lines.items():
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, ".-", label=label)
                drawn += 1
        if not drawn:
            text = "\n".join(textwrap.wrap(empty, 48))
            ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=9)
        if probability:
            ax.set_ylim(0, 1)
        if drawn and (probability or len(lines) > 1):
            ax.legend(fontsize=8)
        ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
        if integer_x:  # steps and versions are integers
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=100)
        return buf.getvalue()
    finally:
        plt.close(fig)
