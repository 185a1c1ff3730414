"""Exact and near-duplicate detection. Exact: equal dedup keys (casefolded, whitespace-collapsed
prompts). Near: MinHash signatures over character shingles, LSH banding for candidate pairs, and
signature agreement (an estimate of shingle Jaccard similarity) to confirm them; vectorized with
numpy, in chunks, so a million rows fit in a few hundred MiB."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator

import numpy as np
import pandas as pd

from rlax_tasks.utils.progress_meter import ProgressMeter
from rlax_tasks.utils.validation import check_int, check_number, field_error

_MIX = np.uint64(0x9E3779B97F4A7C15)  # 64-bit golden-ratio constant (Fibonacci hashing)
_POLY = np.uint64(0x100000001B3)  # FNV-1a 64-bit prime, as the rolling-hash base
_DIGITS_RE = re.compile(r"\d+")


def exact_duplicates(keys: list[str]) -> np.ndarray:
    """For each row, the index of the first row with the same key (itself when it is first)."""
    codes, _ = pd.factorize(pd.Series(keys, dtype=object))
    _, first = np.unique(codes, return_index=True)
    return first[codes]


@dataclasses.dataclass(frozen=True)
class MinHashConfig:
    """MinHash/LSH knobs: `num_perm` = bands * rows_per_band hash functions over character
    `shingle`-grams; a candidate pair is a duplicate when its signatures agree on at least
    `threshold` of the positions (estimated Jaccard similarity of the shingle sets)."""

    shingle: int = 5
    bands: int = 16
    rows_per_band: int = 8
    threshold: float = 0.8
    seed: int = 0
    chunk_rows: int = 256
    # prompts whose numbers differ ("2 + 3" vs "2 + 4") are different problems, not duplicates
    same_numbers: bool = True

    def __post_init__(self) -> None:
        error = field_error(ValueError)
        for name in ("shingle", "bands", "rows_per_band", "chunk_rows"):
            check_int(f"MinHashConfig.{name}", getattr(self, name), error, minimum=1)
        check_number("MinHashConfig.threshold", self.threshold, error, low=0, high=1, open_low=True)

    @property
    def num_perm(self) -> int:
        return self.bands * self.rows_per_band


def _hash_params(num_perm: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    a = rng.integers(1, 2**63, num_perm, dtype=np.uint64) * np.uint64(2) + np.uint64(1)  # odd
    b = rng.integers(0, 2**63, num_perm, dtype=np.uint64)
    return a, b


def _shingle_hashes(texts: list[str], k: int) -> tuple[np.ndarray, np.ndarray]:
    """32-bit hashes of every character k-gram of every text (a text shorter than k is one
    shingle), and the start offset of each text's run of shingles."""
    lengths = np.fromiter((len(t) for t in texts), np.int64, len(texts))
    sep = "\0" * (k - 1)  # padding so a short text's one shingle never reads the next text
    codes = np.frombuffer((sep.join(texts) + sep).encode("utf-32-le"), dtype=np.uint32)
    starts = np.zeros(len(texts), np.int64)
    np.cumsum(lengths[:-1] + (k - 1), out=starts[1:])
    counts = np.maximum(lengths - k + 1, 1)
    offsets = np.zeros(len(texts), np.int64)
    np.cumsum(counts[:-1], out=offsets[1:])
    total = int(counts.sum())
    pos = np.repeat(starts - offsets, counts) + np.arange(total, dtype=np.int64)
    h = np.zeros(total, np.uint64)
    for j in range(k):
        h *= _POLY
        h += codes[pos + j]
    h *= _MIX
    h >>= np.uint64(32)
    return h, offsets


def _signature_chunks(texts: list[str], config: MinHashConfig) -> Iterator[tuple[int, np.ndarray]]:
    """(first row, uint32 [rows, num_perm] signatures) for consecutive chunks of `texts`."""
    a, b = _hash_params(config.num_perm, config.seed)
    for lo in range(0, len(texts), config.chunk_rows):
        chunk = texts[lo : lo + config.chunk_rows]
        x, offsets = _shingle_hashes(chunk, config.shingle)
        tmp = np.empty_like(x)
        sig = np.empty((len(chunk), config.num_perm), np.uint32)
        for p in range(config.num_perm):
            # multiply-shift hashing: the top 32 bits of a*x + b (mod 2^64)
            np.multiply(x, a[p], out=tmp)
            tmp += b[p]
            tmp >>= np.uint64(32)
            sig[:, p] = np.minimum.reduceat(tmp, offsets)
        yield lo, sig


def minhash_signatures(texts: list[str], config: MinHashConfig) -> np.ndarray:
    """uint32 [len(texts), num_perm] MinHash signatures of the texts' character shingles."""
    out = np.empty((len(texts), config.num_perm), np.uint32)
    for lo, sig in _signature_chunks(texts, config):
        out[lo : lo + len(sig)] = sig
    return out


def _band_keys(sig: np.ndarray, band: int, rows: int) -> np.ndarray:
    """A 64-bit hash of each row's `rows` signature values in `band` (collisions between
    different bands' values only add candidates, which are checked afterwards)."""
    key = np.full(len(sig), np.uint64(band + 1), np.uint64)
    for col in range(band * rows, (band + 1) * rows):
        key ^= sig[:, col].astype(np.uint64)
        key *= _MIX
        key ^= key >> np.uint64(29)
    return key


def _find(parent: np.ndarray, i: int) -> int:
    root = i
    while parent[root] != root:
        root = parent[root]
    while parent[i] != root:
        parent[i], i = root, parent[i]
    return root


def number_keys(texts: list[str]) -> np.ndarray:
    """A hash per text of the sequence of numbers it contains."""
    return np.fromiter((hash(tuple(_DIGITS_RE.findall(t))) for t in texts), np.int64, len(texts))


def _agreement(sig: np.ndarray, a: np.ndarray, b: np.ndarray, chunk: int = 8192) -> np.ndarray:
    """Fraction of equal signature positions of rows a[k] and b[k], a chunk of pairs at a time
    (gathering all pairs at once would copy two [pairs, num_perm] arrays)."""
    out = np.empty(len(a))
    for lo in range(0, len(a), chunk):
        out[lo : lo + chunk] = (sig[a[lo : lo + chunk]] == sig[b[lo : lo + chunk]]).mean(axis=1)
    return out


def _candidate_pairs(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(i, j) with i < j for rows sharing a bucket in some band (i: the bucket's first row)."""
    n = len(keys)
    firsts, members = [], []
    for band in range(keys.shape[1]):
        order = np.argsort(keys[:, band], kind="stable")
        sorted_keys = keys[order, band]
        new_group = np.empty(n, bool)
        new_group[0] = True
        np.not_equal(sorted_keys[1:], sorted_keys[:-1], out=new_group[1:])
        group_of = np.cumsum(new_group) - 1
        first = order[np.flatnonzero(new_group)[group_of]]  # stable: the bucket's lowest index
        dup = first != order
        firsts.append(first[dup])
        members.append(order[dup])
    i, j = np.concatenate(firsts), np.concatenate(members)
    if len(i):
        pair = np.unique(i.astype(np.int64) * n + j)
        i, j = pair // n, pair % n
    return i, j


def near_duplicates(
    texts: list[str],
    config: MinHashConfig | None = None,
    progress: ProgressMeter | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(rep, similarity): per row, the earliest row of its near-duplicate cluster (itself when
    kept) and its estimated Jaccard similarity to it; clusters may chain (A~B, B~C). Only the LSH
    band keys of all rows are kept, and the signatures of rows in candidate pairs recomputed to
    confirm them. ``progress`` counts the rows signed (the long part)."""
    config = config or MinHashConfig()
    n = len(texts)
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0)
    keys = np.empty((n, config.bands), np.uint64)
    for lo, sig in _signature_chunks(texts, config):
        for band in range(config.bands):
            keys[lo : lo + len(sig), band] = _band_keys(sig, band, config.rows_per_band)
        if progress is not None:
            progress.update(len(sig))
    i, j = _candidate_pairs(keys)
    del keys
    parent = np.arange(n)
    rows = np.unique(np.concatenate([i, j]))
    sig = minhash_signatures([texts[r] for r in rows.tolist()], config)
    if len(i):
        si, sj = np.searchsorted(rows, i), np.searchsorted(rows, j)
        agree = _agreement(sig, si, sj)
        ok = agree >= config.threshold
        if config.same_numbers:
            numbers = number_keys([texts[r] for r in rows.tolist()])
            ok &= numbers[si] == numbers[sj]
        for a, b in zip(i[ok].tolist(), j[ok].tolist(), strict=True):
            ra, rb = _find(parent, a), _find(parent, b)
            if ra != rb:
                parent[max(ra, rb)] = min(ra, rb)
    while True:  # pointer jumping: every row points at its cluster's lowest index
        nxt = parent[parent]
        if np.array_equal(nxt, parent):
            break
        parent = nxt
    sim = np.ones(n)
    moved = np.flatnonzero(parent != np.arange(n))
    if len(moved):
        # moved rows and their representatives all belong to confirmed pairs, hence to `rows`
        a_rows, b_rows = np.searchsorted(rows, moved), np.searchsorted(rows, parent[moved])
        sim[moved] = _agreement(sig, a_rows, b_rows)
    return parent, sim
