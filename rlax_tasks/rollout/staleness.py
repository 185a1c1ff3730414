"""The two staleness rules of docs/design.md §3 as pure functions (j = reload_every,
k = max_staleness).

The inference worker reloads by the first, the controller's rollout buffer keeps rollouts by the
second; both import them from here (rollout sits below the controller)."""

from __future__ import annotations


def should_reload(held: int | None, latest: int | None, reload_every: int) -> bool:
    """Whether a worker holding version ``held`` pulls now that the PS has ``latest``.

    It reloads only when the PS is at least ``reload_every`` (j) versions ahead; a worker that
    holds nothing loads whatever exists; nothing to load (``latest`` None) means no reload.
    """
    if reload_every < 1:
        raise ValueError(f"reload_every must be >= 1, got {reload_every}")
    if latest is None:
        return False
    if held is None:
        return True
    return latest - held >= reload_every


def within_staleness(rollout_version: int, train_version: int, max_staleness: int | None) -> bool:
    """Whether a rollout of version u may train the step producing version v: v − u ≤ k
    (``max_staleness`` None = unbounded)."""
    if rollout_version >= train_version:
        raise ValueError(
            f"a rollout of version {rollout_version} cannot train the step producing version "
            f"{train_version}: it must come from an earlier version"
        )
    return max_staleness is None or train_version - rollout_version <= max_staleness
