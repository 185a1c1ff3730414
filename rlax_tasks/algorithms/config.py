"""Objective configuration: one validated frozen dataclass and the algorithm presets as data.

A preset is a named set of overrides of ``ObjectiveConfig``'s defaults; user overrides go on top
(``dataclasses.replace``) and ``__post_init__`` validates every field, so an unknown name or a bad
value raises ``ObjectiveConfigError`` (a ValueError) naming it."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from rlax_tasks.algorithms import names
from rlax_tasks.utils.validation import (
    check_bool,
    check_choice,
    check_int,
    check_known,
    check_number,
    field_error,
)


class ObjectiveConfigError(ValueError):
    """An unknown preset, an unknown field or an invalid value in an objective configuration."""


@dataclasses.dataclass(frozen=True)
class ObjectiveConfig:
    """Which component is used for each slot of the docs/design.md §4 objective, and its parameters.

    J = Σ_b Σ_t m·sg[Agg·IS]·(sg[Adv]·GradTerm1 + GradTerm2), loss = −J.
    """

    # Agg: token weight. individual 1/(B·|o_b|); group 1/Σ_b|o_b|; max_length 1/(B·L_max);
    # sequence 1/B (token sum per sequence, mean over sequences: A_b·log π(o_b) for REINFORCE).
    agg: str = "individual"
    # L_max of agg="max_length"; None = the padded width T of the token arrays.
    max_length: int | None = None
    # Adv: outcome advantages from rewards and groups, or GAE from a value head (ppo).
    adv: str = "grpo"
    adv_eps: float = 1e-6
    # GradTerm1: ppo_clip (M·r), logp (REINFORCE/CISPO), gspo (masked sequence ratio).
    policy_term: str = "ppo_clip"
    # Clip range [1 − eps_low, 1 + eps_high] of the PPO/GSPO mask and of CISPO's IS clip.
    eps_low: float = 0.2
    eps_high: float = 0.2
    # ppo_clip's dual clip (verl): a token with Adv < 0 and r > clip_ratio_c contributes the
    # constant −Adv·c to the loss (no gradient); None = off; must be > 1.
    clip_ratio_c: float | None = None
    # IS from the current/old ratio: "clip" = CISPO's sg[clip(r, 1−eps_low, 1+eps_high)].
    ratio_is: str = "none"
    # IS from old/behaviour log-probs: TIS per token min(exp(old−beh), C) ("token") or per
    # sequence min(exp(Σ_t m·(old−beh)), C) ("sequence"); MIS keeps the same ratio where it lies
    # in [1/C, C] and masks the token ("token_mis") or sequence ("sequence_mis") to weight 0
    # outside. C = behavior_is_cap (> 1 for MIS).
    behavior_is: str = "none"
    behavior_is_cap: float = 2.0
    # GradTerm2: KL to the reference policy, k3 or k2 estimator, coefficient kl_beta.
    kl: str = "none"
    kl_beta: float = 0.0
    # GAE (adv="gae"): discount, lambda, whitening over completion tokens, value-loss clip.
    gamma: float = 1.0
    gae_lambda: float = 0.95
    whiten_advantages: bool = True
    value_clip: float | None = 0.2
    # Read by the controller: drop zero-variance groups; DAPO overlong reward shaping, whose
    # cache length is overlong_cache_fraction·max_len (DAPO: 4096 of 20480 = 0.2).
    dynamic_sampling: bool = False
    overlong_shaping: bool = False
    overlong_cache_fraction: float = 0.2
    overlong_factor: float = 1.0

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def needs_reference(self) -> bool:
        """True when the loss has a KL term with β > 0 (the trainer must supply ref_logprobs)."""
        return self.kl != "none" and self.kl_beta > 0

    @property
    def needs_values(self) -> bool:
        """True for GAE advantages (the trainer must supply value-head outputs as "values")."""
        return self.adv == "gae"

    def overlong_cache_len(self, max_len: int) -> int:
        """The DAPO cache length for a generation budget of ``max_len`` tokens."""
        return int(round(self.overlong_cache_fraction * max_len))


# Presets as data: overrides of the ObjectiveConfig defaults (docs/design.md §4), one entry per
# objective
# fmt: off
PRESETS: dict[str, dict[str, Any]] = {
    # GRPO (DeepSeekMath): per-sequence token mean, PPO clip, group-normalized adv, k3 KL.
    "grpo": dict(agg="individual", adv="grpo", policy_term="ppo_clip", kl="k3", kl_beta=0.04),
    # DAPO: token mean over the batch, clip-higher, no KL, dynamic sampling, overlong shaping.
    "dapo": dict(agg="group", adv="grpo", policy_term="ppo_clip", eps_low=0.2, eps_high=0.28,
                 dynamic_sampling=True, overlong_shaping=True),
    # Dr. GRPO: constant length normalizer, no std normalization, no KL.
    "dr_grpo": dict(agg="max_length", adv="dr_grpo", policy_term="ppo_clip"),
    # RLOO (Ahmadian et al. 2024): REINFORCE on whole sequences with a leave-one-out baseline.
    "rloo": dict(agg="sequence", adv="rloo", policy_term="logp"),
    # REINFORCE with a group-mean baseline: sequence log-likelihood vs token-mean aggregation.
    "reinforce_seq": dict(agg="sequence", adv="dr_grpo", policy_term="logp"),
    "reinforce_token": dict(agg="group", adv="dr_grpo", policy_term="logp"),
    # REINFORCE++: batch-normalized advantages, PPO clip, k2 KL in the loss.
    "reinforce_pp": dict(
        agg="group", adv="batch_norm", policy_term="ppo_clip", kl="k2", kl_beta=0.01
    ),
    # CISPO (MiniMax-M1): stop-gradient clipped IS weight on a REINFORCE term; no lower bound.
    "cispo": dict(
        agg="group", adv="grpo", policy_term="logp", ratio_is="clip", eps_low=1.0, eps_high=0.28
    ),
    # GSPO (Qwen): length-normalized sequence ratio with PPO masking per sequence.
    "gspo": dict(agg="individual", adv="grpo", policy_term="gspo", eps_low=3e-4, eps_high=4e-4),
    # PPO with a value head: GAE over completion tokens, whitened, clipped value loss.
    "ppo": dict(agg="group", adv="gae", policy_term="ppo_clip", gamma=1.0, gae_lambda=0.95,
                whiten_advantages=True, value_clip=0.2),
}
# fmt: on

FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(ObjectiveConfig))
_error = field_error(ObjectiveConfigError)


def preset_config(name: str, **overrides: Any) -> ObjectiveConfig:
    """The validated config of preset ``name`` with ``overrides`` applied on top."""
    check_choice("preset", name, PRESETS, _error)
    config = ObjectiveConfig(**PRESETS[name])
    return apply_overrides(config, overrides, context=f"objective preset {name!r}")


def apply_overrides(
    config: ObjectiveConfig, overrides: Mapping[str, Any], context: str = "the objective"
) -> ObjectiveConfig:
    """``config`` with ``overrides`` replaced; unknown fields raise naming them."""
    check_known(
        overrides, FIELD_NAMES, field_error(ObjectiveConfigError, ": "), f"field of {context}"
    )
    return dataclasses.replace(config, **overrides)


def _validate(c: ObjectiveConfig) -> None:
    """All field checks in one place; every message names the field."""
    check_choice("agg", c.agg, names.AGG_MODES, _error)
    check_choice("adv", c.adv, names.ADV_MODES, _error)
    check_choice("policy_term", c.policy_term, names.POLICY_TERMS, _error)
    check_choice("ratio_is", c.ratio_is, names.RATIO_IS_MODES, _error)
    check_choice("behavior_is", c.behavior_is, names.BEHAVIOR_IS_MODES, _error)
    check_choice("kl", c.kl, names.KL_TERMS, _error)
    check_int("max_length", c.max_length, _error, minimum=1, optional=True)
    for name, low, high in _RANGES:
        check_number(name, getattr(c, name), _error, low=low, high=high)
    check_number("behavior_is_cap", c.behavior_is_cap, _error, low=0.0, open_low=True)
    if c.behavior_is in names.MIS_MODES and c.behavior_is_cap <= 1.0:
        raise ObjectiveConfigError(
            f"behavior_is_cap must be > 1 with behavior_is={c.behavior_is!r} (MIS keeps ratios "
            f"in [1/cap, cap]), got {c.behavior_is_cap!r}"
        )
    if c.value_clip is not None:
        check_number("value_clip", c.value_clip, _error, low=0.0, open_low=True)
    if c.clip_ratio_c is not None:
        check_number("clip_ratio_c", c.clip_ratio_c, _error, low=1.0, open_low=True)
    for name in ("whiten_advantages", "dynamic_sampling", "overlong_shaping"):
        check_bool(name, getattr(c, name), _error)
    if c.clip_ratio_c is not None and c.policy_term != "ppo_clip":
        raise ObjectiveConfigError(
            f"clip_ratio_c is the dual clip of policy_term='ppo_clip', not of "
            f"{c.policy_term!r}: leave it null"
        )
    if c.policy_term == "gspo" and c.adv == "gae":
        raise ObjectiveConfigError(
            "policy_term='gspo' needs a sequence-level advantage; adv='gae' is per token "
            "(choose adv in grpo, dr_grpo, rloo, batch_norm, group_batch_norm)"
        )


# (field, low, high) of the closed-interval number fields
_RANGES: tuple[tuple[str, float, float], ...] = (
    ("adv_eps", 0.0, math.inf),
    ("eps_low", 0.0, 1.0),
    ("eps_high", 0.0, math.inf),
    ("kl_beta", 0.0, math.inf),
    ("gamma", 0.0, 1.0),
    ("gae_lambda", 0.0, 1.0),
    ("overlong_cache_fraction", 0.0, 1.0),
    ("overlong_factor", 0.0, math.inf),
)
