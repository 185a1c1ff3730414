"""Presets, overrides and the errors users see for bad names, values and batches."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from rlax_tasks.algorithms import (
    PRESETS,
    BatchError,
    ObjectiveConfig,
    ObjectiveConfigError,
    make_objective,
)
from tests.algorithms.batches import jax_batch, make_batch

ALL_PRESETS = [
    "grpo", "dapo", "dr_grpo", "rloo", "reinforce_seq", "reinforce_token",
    "reinforce_pp", "cispo", "gspo", "ppo",
]  # fmt: skip


def test_every_issue_preset_exists_and_is_valid():
    assert sorted(PRESETS) == sorted(ALL_PRESETS)
    for name in ALL_PRESETS:
        obj = make_objective(name)
        assert obj.name == name and isinstance(obj.config, ObjectiveConfig)


def test_preset_defaults_follow_design():
    grpo = make_objective("grpo").config
    assert (grpo.agg, grpo.adv, grpo.policy_term, grpo.kl, grpo.kl_beta) == (
        "individual", "grpo", "ppo_clip", "k3", 0.04,
    )  # fmt: skip
    dapo = make_objective("dapo").config
    assert (dapo.agg, dapo.eps_low, dapo.eps_high, dapo.kl) == ("group", 0.2, 0.28, "none")
    assert dapo.dynamic_sampling and dapo.overlong_shaping
    assert make_objective("dr_grpo").config.agg == "max_length"
    assert make_objective("dr_grpo").config.adv == "dr_grpo"
    assert make_objective("reinforce_pp").config.kl == "k2"
    assert make_objective("reinforce_pp").config.adv == "batch_norm"
    cispo = make_objective("cispo").config
    assert (cispo.agg, cispo.ratio_is, cispo.policy_term) == ("group", "clip", "logp")
    assert make_objective("gspo").config.policy_term == "gspo"
    for name in ALL_PRESETS:
        cfg = make_objective(name).config
        assert cfg.dynamic_sampling == (name == "dapo")
        assert cfg.overlong_shaping == (name == "dapo")


def test_needs_reference_and_values():
    assert make_objective("grpo").needs_reference
    assert not make_objective("grpo", kl_beta=0.0).needs_reference
    assert not make_objective("grpo", kl="none").needs_reference
    assert make_objective("dapo", kl="k2", kl_beta=0.1).needs_reference
    assert not make_objective("dapo").needs_reference
    assert make_objective("ppo").needs_values
    assert not any(make_objective(n).needs_values for n in ALL_PRESETS if n != "ppo")


def test_overrides_replace_fields_and_leave_presets_untouched():
    obj = make_objective("dapo", eps_high=0.3, behavior_is="sequence", behavior_is_cap=3.0)
    assert obj.config.eps_high == 0.3 and obj.config.behavior_is == "sequence"
    assert make_objective("dapo").config.eps_high == 0.28
    with pytest.raises(dataclasses.FrozenInstanceError):
        obj.config.eps_high = 1.0  # type: ignore[misc]


def test_overlong_cache_len_scales_with_budget():
    cfg = make_objective("dapo").config
    assert cfg.overlong_cache_len(20480) == 4096
    assert cfg.overlong_cache_len(100) == 20


def test_unknown_preset_names_it_and_lists_valid_ones():
    with pytest.raises(ValueError, match="'grpoo'") as err:
        make_objective("grpoo")
    assert isinstance(err.value, ObjectiveConfigError)
    for name in ALL_PRESETS:
        assert name in str(err.value)


def test_unknown_field_names_it_and_lists_valid_ones():
    with pytest.raises(ObjectiveConfigError, match="^eps_hihg: unknown field") as err:
        make_objective("dapo", eps_hihg=0.3)
    assert "did you mean 'eps_high'?" in str(err.value) and "behavior_is_cap" in str(err.value)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("agg", "token"),
        ("adv", "ppo"),
        ("policy_term", "clip"),
        ("ratio_is", "tis"),
        ("behavior_is", "yes"),
        ("kl", "k1"),
        ("eps_low", 1.5),
        ("eps_high", -0.1),
        ("eps_high", "0.3"),
        ("eps_high", float("nan")),
        ("behavior_is_cap", 0.0),
        ("kl_beta", -0.01),
        ("gamma", 1.1),
        ("gae_lambda", True),
        ("value_clip", 0.0),
        ("max_length", 0),
        ("max_length", 12.5),
        ("adv_eps", -1.0),
        ("dynamic_sampling", 1),
        ("overlong_cache_fraction", 2.0),
        ("overlong_factor", -1.0),
    ],
)
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(ObjectiveConfigError, match=field):
        make_objective("grpo", **{field: value})


@pytest.mark.parametrize("mode", ["token_mis", "sequence_mis"])
def test_masked_is_needs_a_cap_above_one(mode):
    """MIS keeps ratios in [1/C, C]: C <= 1 would mask every token (or all but ratio 1)."""
    with pytest.raises(ObjectiveConfigError, match=r"behavior_is_cap must be > 1 .*1\.0"):
        make_objective("grpo", behavior_is=mode, behavior_is_cap=1.0)
    assert make_objective("grpo", behavior_is=mode, behavior_is_cap=1.5).config.behavior_is == mode


def test_gspo_with_token_level_advantages_is_rejected():
    with pytest.raises(ObjectiveConfigError, match="policy_term='gspo'"):
        make_objective("ppo", policy_term="gspo")


@pytest.mark.parametrize(
    ("name", "overrides", "missing", "needle"),
    [
        ("grpo", {}, "ref_logprobs", "ref_logprobs"),
        ("dapo", {"behavior_is": "token"}, "behavior_logprobs", "behavior_logprobs"),
        ("ppo", {}, "values", "values"),
        ("dapo", {}, "old_logprobs", "old_logprobs"),
        ("dapo", {}, "group_ids", "group_ids"),
    ],
)
def test_missing_batch_keys_are_named(name, overrides, missing, needle):
    logp, batch = make_batch(0)
    batch = jax_batch(batch)
    del batch[missing]
    with pytest.raises(BatchError, match=needle):
        make_objective(name, **overrides).loss(jnp.asarray(logp), batch)


def test_wrong_shapes_and_dtypes_are_named():
    logp, batch = make_batch(0)
    batch = jax_batch(batch)
    obj = make_objective("dapo")
    with pytest.raises(BatchError, match="rewards"):
        obj.loss(jnp.asarray(logp), batch | {"rewards": batch["rewards"][:3]})
    with pytest.raises(BatchError, match="old_logprobs"):
        obj.loss(jnp.asarray(logp), batch | {"old_logprobs": batch["old_logprobs"][:, :5]})
    with pytest.raises(BatchError, match="group_ids"):
        obj.loss(jnp.asarray(logp), batch | {"group_ids": batch["group_ids"].astype(np.float32)})
    with pytest.raises(BatchError, match="advantages"):
        obj.loss(jnp.asarray(logp), batch | {"advantages": np.zeros(3, np.float32)})


def test_component_names_come_from_the_tables():
    """Each slot's valid names are its table's keys; a wrong name gets a did-you-mean."""
    from rlax_tasks.algorithms import advantages, aggregation, importance, names, policy_terms

    assert tuple(policy_terms.POLICY_TERMS) == names.POLICY_TERMS
    assert tuple(policy_terms.KL_TERMS) == names.KL_TERMS
    assert tuple(importance.RATIO_IS) == names.RATIO_IS_MODES
    assert tuple(importance.BEHAVIOR_IS) == names.BEHAVIOR_IS_MODES
    assert tuple(aggregation.AGG) == names.AGG_MODES
    assert (*advantages.OUTCOME, "gae") == names.ADV_MODES
    with pytest.raises(RuntimeError, match="'gspo'"):
        names.check_table({"ppo_clip": None, "logp": None}, names.POLICY_TERMS, "policy term")
    with pytest.raises(ObjectiveConfigError, match="did you mean 'ppo_clip'"):
        make_objective("grpo", policy_term="ppo_clp")
    with pytest.raises(ObjectiveConfigError, match="^preset must be one of .*did you mean 'dapo'"):
        make_objective("dapoo")
