"""The padded shapes of the sampler's programs: admission rows, prompt buckets, decode windows.

Each is one of a few sizes, so a sampler compiles a handful of prefill and decode programs and
pays for the padding only up to a bounded fraction."""

from __future__ import annotations

# the smallest prefill bucket: short prompts (tiny-arith's 5-7 tokens) padded to 16 ran twice
# the rows they needed
MIN_BUCKET = 8
# the smallest attention window of a decode chunk: windows grow by 1.5x or 4/3 (at most max_len),
# so a sampler compiles a handful of decode programs
MIN_WINDOW = 64
# a window of w entries moves w x this (its copy written, then read, besides the read it copies):
# a decode reads every entry in place rather than a window past max_len / this
WINDOW_COPY_FACTOR = 3


def decode_window(end: int, max_len: int) -> int:
    """The cache entries a decode chunk attends over when its slots' tokens end before ``end``:
    the smallest of MIN_WINDOW times 1, 1.5, 2, 3, 4, 6, 8, ... covering it, or max_len (every
    entry) once the window passes a third of it. A window is read through a copy of each
    layer's first entries (XLA reads no slice in place: written once, read twice), so from a
    third of max_len on, reading every entry in place moves fewer bytes (benchmarks/traffic.py).
    Two windows per octave rather than one leave less slack, for twice the decode programs."""
    octave = 1 << (max(end, MIN_WINDOW) - 1).bit_length()  # a power of two >= end
    half_step = max(octave * 3 // 4, MIN_WINDOW)  # the window between octave / 2 and octave
    window = min(half_step if end <= half_step else octave, max_len)
    return window if WINDOW_COPY_FACTOR * window <= max_len else max_len


def admission_sizes(max_slots: int) -> list[int]:
    """The row counts an admission is padded to: powers of two from ``max_slots / 16`` (so the
    padding of a small admission costs at most a sixteenth of a full one) to ``max_slots``'s."""
    top = 1 << (max_slots - 1).bit_length()
    smallest = max(1, top // 16)
    return [1 << i for i in range(smallest.bit_length() - 1, top.bit_length())]


def admission_rows(n: int, max_slots: int) -> int:
    """The padded row count of an admission of ``n`` requests (see ``admission_sizes``)."""
    return next(size for size in admission_sizes(max_slots) if size >= n)


def shared_prompt_rows(rows: int, distinct: int, max_slots: int) -> int | None:
    """The padded prompt rows of an admission of ``rows`` whose requests hold ``distinct``
    prompts, or None when sharing would not compute fewer rows (each row its own prompt)."""
    shared = admission_rows(distinct, max_slots)
    return shared if shared < rows else None


def prompt_bucket(length: int, max_len: int) -> int:
    """The padded prefill length of a prompt: the next power of two (>= MIN_BUCKET), at most
    max_len."""
    return min(max(MIN_BUCKET, 1 << (length - 1).bit_length()), max_len)
