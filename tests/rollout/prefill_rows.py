"""A spy on a sampler's prefill calls, for the tests of shared prompt rows."""

from __future__ import annotations

from rlax_tasks.rollout import Sampler


def record_prefill_rows(sampler: Sampler) -> list[tuple[int, int | None]]:
    """From now on, each prefill ``sampler`` runs appends (prompt rows computed, admitted rows
    they fill, or None when every row is its own prompt) to the returned list."""
    rows: list[tuple[int, int | None]] = []
    prefill = sampler._prefill_fn

    def spy(*args: object) -> object:  # positional: 6 = ids [p, P], 8 = source [n] or None
        rows.append((args[6].shape[0], None if args[8] is None else args[8].shape[0]))
        return prefill(*args)

    sampler._prefill_fn = spy
    return rows
