"""Decontamination: drop training rows that share a word n-gram with an evaluation set.

Texts are lowercased alphanumeric words; one shorter than n words is one n-gram of all its words,
so a short evaluation prompt matches only an identical one. The index keeps sorted 64-bit n-gram
hashes (8 bytes each: a whole test split fits); a collision could flag a clean row (~2^-64)."""

from __future__ import annotations

import re
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rlax_tasks.utils.progress_meter import ProgressMeter

_WORD_RE = re.compile(r"\w+")


def words(text: str) -> list[str]:
    """Lowercased alphanumeric words."""
    return _WORD_RE.findall(text.lower())


_POLY = np.uint64(0x100000001B3)
_MIX = np.uint64(0x9E3779B97F4A7C15)


@dataclass
class _Grams:
    """Every n-gram of a batch of texts: its text (row), first word, length and hash."""

    rows: np.ndarray
    starts: np.ndarray
    spans: np.ndarray
    hashes: np.ndarray


def _grams(texts: Sequence[str], n: int, progress: ProgressMeter | None = None) -> _Grams:
    """The n-grams of every text (a text shorter than n words is one n-gram of all its words),
    hashed with numpy from per-word hashes: Python touches each word once."""
    word_hashes, lengths = array("q"), array("q")
    for text in texts if progress is None else progress.track(texts):
        ws = words(text)
        word_hashes.extend(map(hash, ws))
        lengths.append(len(ws))
    h = np.concatenate([np.frombuffer(word_hashes, np.int64), np.zeros(n, np.int64)]).view(
        np.uint64
    )
    lens = np.frombuffer(lengths, np.int64)
    first_word = np.zeros(len(lens), np.int64)
    np.cumsum(lens[:-1], out=first_word[1:])
    counts = np.where(lens >= n, lens - n + 1, np.minimum(lens, 1))
    first_gram = np.zeros(len(lens), np.int64)
    np.cumsum(counts[:-1], out=first_gram[1:])
    rows = np.repeat(np.arange(len(lens)), counts)
    starts = np.arange(int(counts.sum()), dtype=np.int64) - first_gram[rows]  # within the text
    spans = np.minimum(lens, n)[rows]
    pos = first_word[rows] + starts
    acc = spans.astype(np.uint64)
    for j in range(n):
        step = acc * _POLY + h[pos + j]
        acc = np.where(j < spans, step, acc)
    acc *= _MIX
    return _Grams(rows, starts, spans, acc.view(np.int64))


class NgramIndex:
    """Hashed n-grams of evaluation prompts, each remembered with the set it came from."""

    def __init__(self, n: int = 13) -> None:
        if n < 1:
            raise ValueError(f"n-gram size must be >= 1, got {n}")
        self.n = n
        self.names: list[str] = []
        self.texts = 0
        self._parts: list[tuple[np.ndarray, int]] = []
        self._sorted: np.ndarray = np.zeros(0, np.int64)
        self._source: np.ndarray = np.zeros(0, np.int32)

    def add(self, texts: Sequence[str], name: str) -> None:
        """Index the prompts of evaluation set `name`."""
        hashes = _grams(texts, self.n).hashes
        self.texts += len(texts)
        self.names.append(name)
        self._parts.append((hashes, len(self.names) - 1))
        all_hashes = np.concatenate([h for h, _ in self._parts])
        sources = np.concatenate([np.full(len(h), s, np.int32) for h, s in self._parts])
        # sorted unique hashes; a hash seen in several sets keeps the first set added
        order = np.lexsort((sources, all_hashes))
        keep = np.ones(len(order), bool)
        keep[1:] = all_hashes[order][1:] != all_hashes[order][:-1]
        self._sorted = all_hashes[order][keep]
        self._source = sources[order][keep]

    def __len__(self) -> int:
        return len(self._sorted)

    def _lookup(self, hashes: np.ndarray) -> np.ndarray:
        """Index into `_source` of each hash, or -1 when the hash is not indexed."""
        if not len(self._sorted):
            return np.full(len(hashes), -1)
        pos = np.minimum(np.searchsorted(self._sorted, hashes), len(self._sorted) - 1)
        return np.where(self._sorted[pos] == hashes, pos, -1)

    def match_many(
        self, texts: Sequence[str], progress: ProgressMeter | None = None
    ) -> list[str | None]:
        """Per text, the reason naming the evaluation set and the shared n-gram, or None
        (``progress`` counts the texts read)."""
        out: list[str | None] = [None] * len(texts)
        if not len(self._sorted) or not len(texts):
            return out
        grams = _grams(texts, self.n, progress)
        hits = self._lookup(grams.hashes)
        found = np.flatnonzero(hits >= 0)
        hit_rows, first = np.unique(grams.rows[found], return_index=True)
        for r, g in zip(hit_rows.tolist(), found[first].tolist(), strict=True):
            start, span = int(grams.starts[g]), int(grams.spans[g])
            shown = " ".join(words(texts[r])[start : start + span])
            shown = shown if len(shown) <= 120 else shown[:117] + "..."
            name = self.names[int(self._source[hits[g]])]
            out[r] = f"shares a {span}-word n-gram with eval set {name!r}: {shown!r}"
        return out

    def match(self, text: str) -> str | None:
        """The reason for one text (see `match_many`)."""
        return self.match_many([text])[0]
