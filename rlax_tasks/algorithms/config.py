"""Objective configuration: one validated frozen dataclass and the algorithm presets as data.

A preset is a named set of overrides of ``ObjectiveConfig``'s defaults; user overrides are
applied on top with ``dataclasses.replace`` and every field is validated in ``__post_init__``,
so an unknown name or a bad value raises ``ObjectiveConfigError`` (a ValueError) naming it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

AGG_MODES = ("individual", "group", "max_length", "sequence")
ADV_MODES = ("grpo", "dr_grpo", "rloo", "batch_norm", "group_batch_norm", "gae")
POLICY_TERMS = ("ppo_clip", "logp", "gspo")
RATIO_IS_MODES = ("none", "clip")
BEHAVIOR_IS_MODES = ("none", "token", "sequence")
KL_TERMS = ("none", "k3", "k2")


class ObjectiveConfigError(ValueError):
    """An unknown preset, an unknown field or an invalid value in an objective configuration."""


@dataclasses.dataclass(frozen=True)
class ObjectiveConfig:
    """Which component is used for each slot of the DESIGN §4 objective, and its parameters.

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
    # IS from the current/old ratio: "clip" = CISPO's sg[clip(r, 1−eps_low, 1+eps_high)].
    ratio_is: str = "none"
    # IS from old/behaviour log-probs (TIS): per token min(exp(old−beh), C), or per sequence
    # min(exp(Σ_t m·(old−beh)), C); C = behavior_is_cap.
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


# Presets as data: overrides of the ObjectiveConfig defaults (DESIGN §4).
PRESETS: dict[str, dict[str, Any]] = {
    # GRPO (DeepSeekMath): per-sequence token mean, PPO clip, group-normalized adv, k3 KL.
    "grpo": dict(agg="individual", adv="grpo", policy_term="ppo_clip", kl="k3", kl_beta=0.04),
    # DAPO: token mean over the batch, clip-higher, no KL, dynamic sampling, overlong shaping.
    "dapo": dict(
        agg="group",
        adv="grpo",
        policy_term="ppo_clip",
        eps_low=0.2,
        eps_high=0.28,
        dynamic_sampling=True,
        overlong_shaping=True,
    ),
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
    "ppo": dict(
        agg="group",
        adv="gae",
        policy_term="ppo_clip",
        gamma=1.0,
        gae_lambda=0.95,
        whiten_advantages=True,
        value_clip=0.2,
    ),
}

FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(ObjectiveConfig))


def preset_config(name: str, **overrides: Any) -> ObjectiveConfig:
    """The validated config of preset ``name`` with ``overrides`` applied on top."""
    if name not in PRESETS:
        raise ObjectiveConfigError(
            f"unknown objective preset {name!r}; valid presets: {', '.join(PRESETS)}"
        )
    return apply_overrides(ObjectiveConfig(**PRESETS[name]), overrides, context=f"preset {name!r}")


def apply_overrides(
    config: ObjectiveConfig, overrides: Mapping[str, Any], context: str = "objective"
) -> ObjectiveConfig:
    """``config`` with ``overrides`` replaced; unknown fields raise naming them."""
    unknown = sorted(set(overrides) - set(FIELD_NAMES))
    if unknown:
        raise ObjectiveConfigError(
            f"unknown objective field(s) {', '.join(map(repr, unknown))} for {context}; "
            f"valid fields: {', '.join(FIELD_NAMES)}"
        )
    return dataclasses.replace(config, **overrides)


def _choice(name: str, value: Any, options: tuple[str, ...]) -> None:
    if value not in options:
        raise ObjectiveConfigError(f"{name}={value!r} is not valid; choose one of {list(options)}")


def _number(name: str, value: Any, low: float, high: float = math.inf, *, open_low=False) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value > low if open_low else value >= low) and value <= high
    if not ok:
        bracket = "(" if open_low else "["
        raise ObjectiveConfigError(
            f"{name} must be a finite number in {bracket}{low}, {high}], got {value!r}"
        )


def _validate(c: ObjectiveConfig) -> None:
    """All field checks in one place; every message names the field."""
    _choice("agg", c.agg, AGG_MODES)
    _choice("adv", c.adv, ADV_MODES)
    _choice("policy_term", c.policy_term, POLICY_TERMS)
    _choice("ratio_is", c.ratio_is, RATIO_IS_MODES)
    _choice("behavior_is", c.behavior_is, BEHAVIOR_IS_MODES)
    _choice("kl", c.kl, KL_TERMS)
    if c.max_length is not None and (
        not isinstance(c.max_length, int) or isinstance(c.max_length, bool) or c.max_length <= 0
    ):
        raise ObjectiveConfigError(
            f"max_length must be a positive integer or None, got {c.max_length!r}"
        )
    _number("adv_eps", c.adv_eps, 0.0)
    _number("eps_low", c.eps_low, 0.0, 1.0)
    _number("eps_high", c.eps_high, 0.0)
    _number("behavior_is_cap", c.behavior_is_cap, 0.0, open_low=True)
    _number("kl_beta", c.kl_beta, 0.0)
    _number("gamma", c.gamma, 0.0, 1.0)
    _number("gae_lambda", c.gae_lambda, 0.0, 1.0)
    if c.value_clip is not None:
        _number("value_clip", c.value_clip, 0.0, open_low=True)
    _number("overlong_cache_fraction", c.overlong_cache_fraction, 0.0, 1.0)
    _number("overlong_factor", c.overlong_factor, 0.0)
    for name in ("whiten_advantages", "dynamic_sampling", "overlong_shaping"):
        if not isinstance(getattr(c, name), bool):
            raise ObjectiveConfigError(f"{name} must be true or false, got {getattr(c, name)!r}")
    if c.policy_term == "gspo" and c.adv == "gae":
        raise ObjectiveConfigError(
            "policy_term='gspo' needs a sequence-level advantage; adv='gae' is per token "
            "(choose adv in grpo, dr_grpo, rloo, batch_norm, group_batch_norm)"
        )
