"""PNG plots of one run's series (matplotlib, Agg backend: no display needed on the api-server)."""

from __future__ import annotations

import io

from rlax_dashboard.runs import RunSeries

# plot name -> (title, x label, y label)
PLOTS = {
    "reward": ("Reward per step", "training step", "mean reward"),
    "pass_at_k": ("Held-out pass@k", "weight version", "pass@k"),
    "staleness": ("Rollout staleness", "training step", "v − u (mean)"),
    "weight_sync": ("Weight sync time", "version", "seconds"),
}


def render_png(series: RunSeries, name: str) -> bytes:
    """The PNG bytes of plot ``name`` (one of PLOTS); an empty series gives an empty, labelled
    plot saying "no data yet"; an unknown name is a KeyError."""
    title, xlabel, ylabel = PLOTS[name]
    import matplotlib  # lazily: every Airflow process imports plugins, few draw plots

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    lines = {
        "reward": {"reward": series.reward},
        "pass_at_k": series.pass_at,
        "staleness": {"staleness": series.staleness},
        "weight_sync": {"weight sync": series.weight_sync},
    }[name]
    fig, ax = plt.subplots(figsize=(6, 3.4))
    try:
        drawn = 0
        for label, points in lines.items():
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, ".-", label=label)
                drawn += 1
        if not drawn:
            ax.text(0.5, 0.5, "no data yet", ha="center", va="center", transform=ax.transAxes)
        if name == "pass_at_k":
            ax.set_ylim(0, 1)
            if drawn:
                ax.legend(fontsize=8)
        ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps and versions are integers
        ax.grid(alpha=0.3)
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=100)
        return buf.getvalue()
    finally:
        plt.close(fig)
