"""Swapping a sampler's weights in place (docs/design.md §6): new arrays of the same shapes,
placed as the old ones, each old array freed before its replacement is placed."""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx


def check_same_layout(old: nnx.State, new: nnx.State) -> None:
    """ValueError naming the first array where ``new`` differs from ``old`` in path or shape."""
    old_leaves = jax.tree_util.tree_leaves_with_path(old)
    new_leaves = jax.tree_util.tree_leaves_with_path(new)
    if len(old_leaves) != len(new_leaves):
        raise ValueError(
            f"new weights have {len(new_leaves)} arrays, the policy has {len(old_leaves)}"
        )
    for (path, a), (new_path, b) in zip(old_leaves, new_leaves, strict=True):
        if path != new_path or a.shape != b.shape:
            raise ValueError(
                f"new weights do not match the policy at {jax.tree_util.keystr(path)}: "
                f"{jax.tree_util.keystr(new_path)} {tuple(b.shape)} vs {tuple(a.shape)}"
            )


def place_like(old: nnx.State, new: nnx.State, *, free_old: bool, donate: bool) -> nnx.State:
    """``new`` in ``old``'s dtypes and placements (check ``check_same_layout`` first).

    Args:
      old: the weights held now.
      new: their replacement, on the host or on devices.
      free_old: each old array is deleted before its replacement is placed (the sampler owns
        them): never two full copies on the device.
      donate: device arrays of ``new`` already in the right dtype and placement are taken over
        as they are (the caller must not use them again).

    Returns:
      The placed weights, with ``old``'s tree structure.
    """
    placed = []
    for a, b in zip(jax.tree.leaves(old), jax.tree.leaves(new), strict=True):
        sharding, dtype = a.sharding, a.dtype
        if free_old:
            a.delete()
        if donate and isinstance(b, jax.Array) and b.sharding == sharding and b.dtype == dtype:
            # already placed as the sampler holds it (a colocated run's trainer weights,
            # cast and copied device to device): taken over as is, no host round trip
            placed.append(b)
            continue
        host = np.asarray(b)  # a host copy (device inputs: fetched before being cast)
        placed.append(jax.device_put(host.astype(dtype, copy=False), sharding))
        jax.block_until_ready(placed[-1])
    return jax.tree.unflatten(jax.tree.structure(old), placed)
