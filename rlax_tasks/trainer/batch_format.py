"""The training batch a trainer takes (``train_step.BATCH_KEYS``, optionally the replayed sampling
support): validated on the host, every error naming the key, and padded to the step's width."""

from __future__ import annotations

from typing import Any

import numpy as np

from rlax_tasks.trainer.train_step import BATCH_KEYS, ROUTES_KEY, SUPPORT_KEY

DTYPES = {
    "input_ids": np.int32,
    "attention_mask": np.int32,
    "completion_mask": np.int32,
    "behavior_logprobs": np.float32,
    "rewards": np.float32,
    "group_ids": np.int32,
}


class BatchFormatError(ValueError):
    """A training batch is missing a key or has a wrong shape / dtype / value."""


def checked_ids(batch: dict[str, Any], vocab: int) -> np.ndarray:
    """The batch's ``input_ids`` [B, T], once every BATCH_KEYS is there and they are token ids."""
    missing = [k for k in BATCH_KEYS if k not in batch]
    if missing:
        raise BatchFormatError(f"training batch has no {missing}; it needs {list(BATCH_KEYS)}")
    ids = np.asarray(batch["input_ids"])
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
        raise BatchFormatError(
            f"batch['input_ids'] must be an integer [B, T] array, got {ids.dtype} {ids.shape}"
        )
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
        raise BatchFormatError(
            f"batch['input_ids'] must lie in [0, {vocab}), got [{ids.min()}, {ids.max()}]"
        )
    return ids


def host_batch(
    batch: dict[str, Any],
    ids: np.ndarray,
    vocab: int,
    width: int,
    experts: tuple[int, int, int] | None = None,
) -> dict[str, np.ndarray]:
    """The batch's arrays in the step's dtypes, token arrays right-padded to ``width`` (masked-out
    columns: no token, no loss); the support and the recorded routes too when the batch carries
    them. ``ids``: its ``checked_ids``; ``experts``: a mixture-of-experts model's (layers,
    experts, experts per token), None for a dense one."""
    b = ids.shape[0]
    host = {}
    for key, dtype in DTYPES.items():
        x = np.asarray(batch[key])
        want = (b,) if key in ("rewards", "group_ids") else ids.shape
        if x.shape != want:
            raise BatchFormatError(f"batch[{key!r}] has shape {x.shape}, expected {want}")
        if key == "group_ids" and not np.issubdtype(x.dtype, np.integer):
            raise BatchFormatError(f"batch['group_ids'] must be integers, got {x.dtype}")
        if x.ndim == 2 and width > x.shape[1]:
            x = np.pad(x, ((0, 0), (0, width - x.shape[1])))
        host[key] = x.astype(dtype)
    if batch.get(SUPPORT_KEY) is not None:
        host[SUPPORT_KEY] = checked_support(np.asarray(batch[SUPPORT_KEY]), ids.shape, vocab, width)
    if batch.get(ROUTES_KEY) is not None:
        host[ROUTES_KEY] = checked_routes(np.asarray(batch[ROUTES_KEY]), ids.shape, experts, width)
    return host


def checked_routes(
    routes: np.ndarray,
    shape: tuple[int, ...],
    experts: tuple[int, int, int] | None,
    width: int,
) -> np.ndarray:
    """The recorded routes [B, T, L, k]: expert ids or -1 per token (-1 on every layer and slot
    of a token without a record), padded to ``width`` with -1; a route that does not fit the
    model is refused naming the row."""
    if experts is None:
        raise BatchFormatError(
            f"batch[{ROUTES_KEY!r}] holds recorded expert routes but the model is dense: "
            "drop them or train the mixture-of-experts model they were sampled with"
        )
    layers, num_experts, k = experts
    want = (*shape, layers, k)
    if routes.shape != want:
        raise BatchFormatError(
            f"batch[{ROUTES_KEY!r}] has shape {routes.shape}, expected {want} (rows, tokens, "
            "the model's layers, its experts per token)"
        )
    if not np.issubdtype(routes.dtype, np.integer):
        raise BatchFormatError(f"batch[{ROUTES_KEY!r}] must be integers, got {routes.dtype}")
    bad = (routes < -1) | (routes >= num_experts)
    recorded = routes >= 0
    partial = recorded.any(axis=(2, 3)) != recorded.all(axis=(2, 3))
    problems = (
        (bad.any(axis=(1, 2, 3)), f"expert ids outside [0, {num_experts})"),
        (partial.any(axis=1), "a token recorded on some layers only"),
    )
    for problem, what in problems:
        if problem.any():
            row = int(np.argmax(problem))
            raise BatchFormatError(f"batch[{ROUTES_KEY!r}] row {row} holds {what}")
    pad = ((0, 0), (0, width - shape[1]), (0, 0), (0, 0))
    return np.pad(routes.astype(np.int32), pad, constant_values=-1)


def checked_support(
    support: np.ndarray, shape: tuple[int, ...], vocab: int, width: int
) -> np.ndarray:
    """The replayed sampling support [B, T, R]: token ids or -1, padded to ``width`` with -1 (no
    entries: the whole vocabulary)."""
    if support.ndim != 3 or support.shape[:2] != shape:
        raise BatchFormatError(
            f"batch[{SUPPORT_KEY!r}] has shape {support.shape}, expected {shape} + (R,)"
        )
    if not np.issubdtype(support.dtype, np.integer):
        raise BatchFormatError(f"batch[{SUPPORT_KEY!r}] must be integers, got {support.dtype}")
    if support.size and (support.min() < -1 or support.max() >= vocab):
        raise BatchFormatError(
            f"batch[{SUPPORT_KEY!r}] must hold token ids in [0, {vocab}) or -1, got "
            f"[{support.min()}, {support.max()}]"
        )
    pad = ((0, 0), (0, width - shape[1]), (0, 0))
    return np.pad(support.astype(np.int32), pad, constant_values=-1)
