"""Sequence packing: a training batch's sequences laid end to end in fewer, fuller rows. RL
batches are mostly padding when completion lengths vary, and the step's work grows with rows x
width; each sequence keeps its own attention segment and positions, and ``token_index`` gathers
the outputs back to [B, T], so the objective, masks and metrics are unchanged.
"""

from __future__ import annotations

import bisect
import dataclasses
import math

import numpy as np

from rlax_tasks.models.attention import MAX_PACKED_SEGMENTS

# packed row counts are rounded up to a multiple of 1 / ROW_BUCKETS of the padded batch's tokens
# (and of what the mesh and the micro-batches need): a run compiles the step for at most about
# this many row counts per width; each new count costs a trace and a compile, against at most
# 1/8 of the padded tokens spent on padding rows
ROW_BUCKETS = 8
# the narrowest packed row: narrow batches pack into rows this wide (short sequences fill
# narrower rows poorly, and wider rows cost attention over the whole row; benchmarks/README)
MIN_ROW_WIDTH = 32


@dataclasses.dataclass(frozen=True)
class PackedBatch:
    """The packed rows of a [B, T] batch and the map back: ``input_ids`` and ``segment_ids``
    [R, L] int32 (segments 1, 2, ... along a row, 0 on padding); ``token_index`` [B, T] int32,
    the index of token (b, t) in the flattened [R * L] outputs, or R * L (a slot held at 0) where
    there is nothing to read: padding, and each sequence's first token (nothing predicts it)."""

    input_ids: np.ndarray
    segment_ids: np.ndarray
    token_index: np.ndarray

    @property
    def rows(self) -> int:
        return self.input_ids.shape[0]


def row_width(width: int) -> int:
    """The width L of packed rows for a batch ``width`` (T) wide: T, at least MIN_ROW_WIDTH."""
    return max(width, MIN_ROW_WIDTH)


def row_multiple(batch_size: int, width: int, packed_width: int, divisor: int = 1) -> int:
    """The multiple packed row counts are rounded to: B * T / ROW_BUCKETS tokens of rows
    ``packed_width`` wide (at least 1 row), made a multiple of ``divisor`` (data-parallel devices
    x micro-batches: each gets whole rows)."""
    return math.lcm(max(1, batch_size * width // ROW_BUCKETS // packed_width), divisor)


def assign_rows(
    lengths: np.ndarray, width: int, max_segments: int = MAX_PACKED_SEGMENTS
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Best-fit decreasing bin packing of sequence lengths into rows of ``width`` tokens and at
    most ``max_segments`` sequences (the attention kernels' bound): (row, offset, segment) per
    sequence and the number of rows. Longest first, each into the fullest row it still fits
    (ties: the oldest row), so the result is deterministic; segments are numbered 1, 2, ...
    along a row; zero-length sequences take no space (row 0, offset 0, 0)."""
    lengths = np.asarray(lengths, np.int64)
    if lengths.size and lengths.max() > width:
        raise ValueError(f"a sequence of {int(lengths.max())} tokens does not fit width {width}")
    row = np.zeros(lengths.size, np.int64)
    offset = np.zeros(lengths.size, np.int64)
    segment = np.zeros(lengths.size, np.int64)
    free: list[tuple[int, int]] = []  # (free tokens, row), sorted
    used: list[int] = []  # tokens placed per row
    count: list[int] = []  # sequences placed per row
    for i in np.argsort(-lengths, kind="stable"):
        n = int(lengths[i])
        if n == 0:
            continue
        j = bisect.bisect_left(free, (n, -1))
        if j == len(free):
            r = len(used)
            used.append(0)
            count.append(0)
        else:
            _, r = free.pop(j)
        count[r] += 1
        row[i], offset[i], segment[i] = r, used[r], count[r]
        used[r] += n
        if used[r] < width and count[r] < max_segments:
            bisect.insort(free, (width - used[r], r))
    return row, offset, segment, len(used)


def pack_batch(
    input_ids: np.ndarray,
    attention_mask: np.ndarray,
    packed_width: int | None = None,
    multiple: int = 1,
) -> PackedBatch | None:
    """The packed form of a [B, T] batch (its tokens: where ``attention_mask`` is 1, in order)
    in rows ``packed_width`` wide (L >= T; default ``row_width(T)``), R a multiple of
    ``multiple``; None when that saves nothing (R * L >= B * T)."""
    ids = np.asarray(input_ids)
    valid = np.asarray(attention_mask).astype(bool)
    b, t = ids.shape
    width = packed_width or row_width(t)
    if width < t:
        raise ValueError(f"packed rows {width} wide cannot hold sequences of up to {t} tokens")
    lengths = valid.sum(axis=1)
    row, offset, segment, n_rows = assign_rows(lengths, width)
    n_rows = -(-max(n_rows, 1) // multiple) * multiple
    if n_rows * width >= b * t:
        return None
    packed_ids = np.zeros((n_rows, width), np.int32)
    segments = np.zeros((n_rows, width), np.int32)
    # every token of row b goes to packed row row[b], column offset[b] + its rank in the row
    rank = np.cumsum(valid, axis=1) - 1
    src_b, src_t = np.nonzero(valid)
    dst_r = row[src_b]
    dst_c = offset[src_b] + rank[src_b, src_t]
    packed_ids[dst_r, dst_c] = ids[src_b, src_t]
    segments[dst_r, dst_c] = segment[src_b]
    index = np.full((b, t), n_rows * width, np.int32)
    not_first = rank[src_b, src_t] > 0
    index[src_b[not_first], src_t[not_first]] = (dst_r * width + dst_c)[not_first]
    return PackedBatch(packed_ids, segments, index)
