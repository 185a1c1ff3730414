"""Routing replay (docs/design.md §14) on a tiny Qwen3-MoE: the sampler records each generated
token's experts per layer; the trainer's log-probs through those experts equal the sampler's,
where its own routes (flipped by numerics) do not; bad records are refused naming the row."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlax_tasks.algorithms import make_objective
from rlax_tasks.models import LogProbOptions, ModelConfig, Policy, forward
from rlax_tasks.models.policy import abstract_model, cast_params
from rlax_tasks.rollout import Sampler
from rlax_tasks.trainer import Trainer, TrainerConfig
from rlax_tasks.trainer.batch_format import BatchFormatError

CONFIG = ModelConfig(
    model_type="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=64,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, qk_norm=True,
    num_experts=4, num_experts_per_tok=1, moe_intermediate_size=32, norm_topk_prob=True,
)  # fmt: skip
NEW = 24


def _near_tie_policy(eps: float) -> Policy:
    """Peaked random weights whose router scores experts 0 and 1 within ``eps`` of each other:
    the float noise between the cached decode and the trainer's full pass flips some routes."""
    policy = Policy.init(CONFIG, seed=0)
    params = jax.tree.map(lambda a: a * 3.0, policy.params)
    pure = nnx.to_pure_dict(params)
    gate = np.asarray(pure["layers"]["mlp"]["gate"]["kernel"]).copy()  # [L, D, E]
    noise = np.random.default_rng(1).normal(size=gate[..., 0].shape)
    gate[..., 1] = gate[..., 0] + eps * noise
    pure["layers"]["mlp"]["gate"]["kernel"] = jnp.asarray(gate)
    nnx.replace_by_pure_dict(params, pure)
    return policy.with_params(params)


def _rollouts(sampler_policy: Policy, prompt_len: int) -> tuple[list, list]:
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(3, 64, prompt_len)] for _ in range(8)]
    outs = Sampler(sampler_policy, max_slots=8, max_len=48).generate(
        prompts, max_new_tokens=NEW, temperature=1.0, seed=1, ignore_eos=True
    )
    return prompts, outs


def _batch(prompts: list, outs: list) -> dict[str, np.ndarray]:
    """The trainer batch of the rollouts, their recorded routes on the generated tokens."""
    p = len(prompts[0])
    ids = np.array([prompt + out.tokens for prompt, out in zip(prompts, outs, strict=True)])
    routes = np.full((*ids.shape, CONFIG.num_hidden_layers, 1), -1, np.int16)
    behavior = np.zeros(ids.shape, np.float32)
    for b, out in enumerate(outs):
        routes[b, p:] = out.routed_experts
        behavior[b, p:] = out.logprobs
    completion = np.zeros(ids.shape, np.int32)
    completion[:, p:] = 1
    return {
        "input_ids": ids, "attention_mask": np.ones_like(ids), "completion_mask": completion,
        "behavior_logprobs": behavior, "rewards": np.arange(8, dtype=np.float32) % 2,
        "group_ids": np.arange(8, dtype=np.int32) // 4, "routed_experts": routes,
    }  # fmt: skip


def test_the_sampler_records_each_generated_tokens_experts():
    policy = _near_tie_policy(0.0)
    _, outs = _rollouts(policy, 6)
    for out in outs:
        routes = out.routed_experts
        assert routes.shape == (NEW, CONFIG.num_hidden_layers, 1) and routes.dtype == np.int16
        assert (routes[:-1] >= 0).all() and (routes[:-1] < CONFIG.num_experts).all()
        assert (routes[-1] == -1).all()  # the last token was never fed back: unrouted


def test_replay_makes_the_trainers_logprobs_the_samplers_where_its_own_routes_differ():
    """float32 on both sides, one-token prompts (the prompt is routed by the trainer), a router
    near a tie: without replay some routes flip and the log-probs part; with replay they agree
    within 1e-5 and no recorded token goes through other experts."""
    policy = _near_tie_policy(1e-7)
    prompts, outs = _rollouts(policy, 1)
    batch = _batch(prompts, outs)
    completion = batch["completion_mask"] > 0
    gaps, stats = {}, {}
    for replay in (False, True):
        lp, st = forward.token_logprobs(
            policy.graphdef, policy.params, batch["input_ids"], None,
            LogProbOptions(replay_routes=replay), routes=jnp.asarray(batch["routed_experts"]),
            with_route_stats=True,
        )  # fmt: skip
        gaps[replay] = np.abs(np.asarray(lp) - batch["behavior_logprobs"])[completion].max()
        stats[replay] = st
    assert float(stats[False].own_mismatch.sum()) > 0  # the flips this test is about
    assert float(stats[False].mismatch.sum()) > 0 and gaps[False] > 1e-2
    assert float(stats[True].mismatch.sum()) == 0 and gaps[True] < 1e-5


@pytest.fixture(scope="module")
def bfloat16_rollouts():
    """A bfloat16 sampler's rollouts of the float32 trainer's weights: its routes differ."""
    policy = _near_tie_policy(1e-3)
    graphdef, _ = abstract_model(CONFIG, "bfloat16", "bfloat16")
    sampler = dataclasses.replace(policy, graphdef=graphdef, dtype="bfloat16",
                                  params=cast_params(policy.params, "bfloat16"),
                                  param_dtype="bfloat16")  # fmt: skip
    prompts, outs = _rollouts(sampler, 6)
    return policy, _batch(prompts, outs)


@pytest.mark.parametrize("mode", ["off", "replay"])
def test_the_trainer_step_reports_the_route_mismatch_and_replays_it_away(
    bfloat16_rollouts, mode, tmp_path
):
    policy, batch = bfloat16_rollouts
    trainer = Trainer(policy, make_objective("grpo"), TrainerConfig(
        learning_rate=1e-4, mesh_shape=(1, 1, 1), routing_replay=mode), str(tmp_path))  # fmt: skip
    metrics = trainer.step(batch)
    trainer.close()
    assert metrics["moe/own_route_mismatch_frac"] > 0  # bfloat16 sampling flips some routes
    if mode == "off":
        assert metrics["moe/route_mismatch_frac"] > 0
    else:
        assert metrics["moe/route_mismatch_frac"] == 0
    assert 0 < metrics["moe/recorded_routes_frac"] < 1  # generated tokens only
    for layer in range(CONFIG.num_hidden_layers):
        assert metrics[f"moe/expert_load_max_over_mean/layer_{layer}"] >= 1
        assert 0 < metrics[f"moe/router_entropy/layer_{layer}"] <= np.log(CONFIG.num_experts)


def test_replay_lowers_the_sampler_trainer_kl(bfloat16_rollouts, tmp_path):
    policy, batch = bfloat16_rollouts
    kl = {}
    for mode in ("off", "replay"):
        trainer = Trainer(policy, make_objective("grpo"), TrainerConfig(
            learning_rate=1e-4, mesh_shape=(1, 1, 1), routing_replay=mode),
            str(tmp_path / mode))  # fmt: skip
        kl[mode] = trainer.step(batch)["logprob_mismatch_kl"]
        trainer.close()
    assert kl["replay"] < kl["off"], kl


@pytest.mark.parametrize(
    "change, message",
    [(lambda r: r.__setitem__((3, 10, 1, 0), 7), "row 3 holds expert ids outside [0, 4)"),
     (lambda r: r.__setitem__((5, 9, 0, 0), -1), "row 5 holds a token recorded on some layers")],
)  # fmt: skip
def test_a_recorded_route_that_does_not_fit_the_model_is_refused_naming_the_row(
    bfloat16_rollouts, change, message, tmp_path
):
    policy, batch = bfloat16_rollouts
    batch = {**batch, "routed_experts": batch["routed_experts"].copy()}
    change(batch["routed_experts"])
    trainer = Trainer(policy, make_objective("grpo"), TrainerConfig(mesh_shape=(1, 1, 1)),
                      str(tmp_path))  # fmt: skip
    with pytest.raises(BatchFormatError, match=re.escape(message)):
        trainer.step(batch)
    trainer.close()
