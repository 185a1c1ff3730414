"""The valid names of each slot of the docs/design.md §4 objective, JAX-free.

Each tuple is the key list of a table of small JAX functions: ``config.py`` validates against
them without JAX, and each table module calls ``check_table`` on import so the two never drift.
Adding a component: one function, one entry in its table, its name here."""

from __future__ import annotations

from collections.abc import Mapping

AGG_MODES = ("individual", "group", "max_length", "sequence")  # aggregation.AGG
OUTCOME_ADV_MODES = ("grpo", "dr_grpo", "rloo", "batch_norm", "group_batch_norm")  # advantages
ADV_MODES = (*OUTCOME_ADV_MODES, "gae")  # + GAE from a value head (gae.py)
POLICY_TERMS = ("ppo_clip", "logp", "gspo")  # policy_terms.POLICY_TERMS
RATIO_IS_MODES = ("none", "clip")  # importance.RATIO_IS
BEHAVIOR_IS_MODES = (
    "none",
    "token",
    "sequence",
    "token_mis",
    "sequence_mis",
)  # importance.BEHAVIOR_IS
MIS_MODES = ("token_mis", "sequence_mis")  # behaviour IS whose 0/1 output is "masked"
KL_TERMS = ("none", "k3", "k2")  # policy_terms.KL_TERMS


def check_table(table: Mapping[str, object], names: tuple[str, ...], slot: str) -> None:
    """Raises at import when ``table``'s keys are not exactly ``names`` (in that order)."""
    if tuple(table) != names:
        raise RuntimeError(
            f"the {slot} table has {list(table)} but algorithms/names.py lists {list(names)}: "
            "add the name there (or the function to the table)"
        )
