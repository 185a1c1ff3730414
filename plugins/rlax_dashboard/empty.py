"""Why a run's plot has no points, said where the plot would be: the run has not started, its
placement has nothing to show (a colocated run syncs no weights), or its configuration does not
write the metric yet, naming the setting (docs/design.md §7: what a run directory holds)."""

from __future__ import annotations

from typing import Any

from rlax_dashboard.runs import RunSeries, flatten

RUNNING = ("provisioning", "running", "pending")  # states a run may still write from


def empty_reasons(
    series: RunSeries, config: dict[str, Any] | None, state: str, step: int | None
) -> dict[str, str]:
    """{plot name: why it has no points} for each empty plot of the run page.

    Args:
        series: the run's series (``runs.read_series``).
        config: its config.yaml as plain data (None when missing).
        state: its state in the runs table (``runs.summarize``).
        step: its last training step (None before the first).

    Returns:
        One line per empty plot ("reward", "pass_at_k", "staleness", "weight_sync").
    """
    settings = flatten(config or {})
    points = {
        "reward": series.reward,
        "pass_at_k": [p for pts in series.pass_at.values() for p in pts],
        "staleness": series.staleness,
        "weight_sync": series.weight_sync,
    }
    out = {}
    for name, pts in points.items():
        if pts:
            continue
        if name == "weight_sync" and settings.get("placement.mode") == "colocated":
            out[name] = (
                "colocated run: the trainer and the sampler share one copy of the weights, "
                "nothing is synced (placement.mode: colocated)"
            )
        elif step is None:
            out[name] = f"run not started: no training step yet ({state})"
        elif name == "pass_at_k":
            out[name] = _why_no_pass_at_k(settings, state, step)
        else:
            out[name] = _why_not_recorded(name, state)
    return out


def _why_no_pass_at_k(settings: dict[str, Any], state: str, step: int) -> str:
    every = settings.get("eval.every_steps") or 0
    if not every:
        if state in RUNNING:
            return "held-out pass@k comes before and after the run only (eval.every_steps: 0)"
        return (
            "no held-out evaluation written: eval.every_steps is 0 and the before/after "
            "evaluation did not run (rlax run --no-eval)"
        )
    if step < every:
        return f"first held-out evaluation at step {every} (eval.every_steps: {every})"
    return f"no held-out evaluation written yet (eval.every_steps: {every})"


_FILES = {
    "reward": "reward_mean in metrics.jsonl",
    "staleness": "rollout versions in lineage.jsonl",
    "weight_sync": "pushed versions in weight_sync.jsonl",
}


def _why_not_recorded(name: str, state: str) -> str:
    what = _FILES[name]
    return f"no {what} yet" if state in RUNNING else f"this run recorded no {what} ({state})"
