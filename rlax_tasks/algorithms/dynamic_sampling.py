"""Dynamic sampling (DAPO), host side: groups whose rewards are all equal carry no signal.

Their group-relative advantage is 0 for every row, so the controller drops them (and counts
them) before they reach a batch. A group of size 1 is zero-variance too and is dropped.
"""

from __future__ import annotations

import numpy as np


def filter_groups(rewards: np.ndarray, group_ids: np.ndarray) -> tuple[np.ndarray, int]:
    """(keep mask [B] bool, number of dropped groups): keep the rows of groups whose rewards
    are not all equal."""
    rewards = np.asarray(rewards, dtype=np.float64)
    group_ids = np.asarray(group_ids)
    if rewards.ndim != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            f"rewards and group_ids must be 1-D of the same length, got shapes "
            f"{rewards.shape} and {group_ids.shape}"
        )
    if not np.all(np.isfinite(rewards)):
        raise ValueError("rewards contain NaN or inf; fix the verifier output before filtering")
    if rewards.size == 0:
        return np.zeros(0, bool), 0
    groups, inverse = np.unique(group_ids, return_inverse=True)
    low = np.full(groups.size, np.inf)
    high = np.full(groups.size, -np.inf)
    np.minimum.at(low, inverse, rewards)
    np.maximum.at(high, inverse, rewards)
    informative = high > low
    return informative[inverse], int(np.sum(~informative))
