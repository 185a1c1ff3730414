"""Recorded expert routes (docs/design.md §14) through the real hand-offs: a tiny Qwen3-MoE
sampler's completions go over the worker's JSON, into a scored group, the buffer's snapshot, the
trainer's batch (``routed_experts`` at the generated tokens' positions, -1 elsewhere), the
step's Parquet rows and a partial rollout's record, unchanged; the trainer takes the batch."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from rlax_tasks.algorithms import make_objective
from rlax_tasks.controller.buffer import Batch, ScoredGroup
from rlax_tasks.controller.mixture import Prompt
from rlax_tasks.controller.rollouts import read_step_batch, write_step
from rlax_tasks.controller.scoring import scored_group
from rlax_tasks.models import ModelConfig, Policy
from rlax_tasks.rollout import Sampler
from rlax_tasks.rollout.requests import GroupResult, SampleProgress
from rlax_tasks.trainer import Trainer, TrainerConfig
from tests.controller.fakes import settings

CONFIG = ModelConfig(
    model_type="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=64,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8, qk_norm=True,
    num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16,
)  # fmt: skip


@pytest.fixture(scope="module")
def policy() -> Policy:
    p = Policy.init(CONFIG, seed=0)
    return p.with_params(jax.tree.map(lambda a: a * 3.0, p.params))


def _groups(policy: Policy) -> list[GroupResult]:
    sampler = Sampler(policy, max_slots=8, max_len=40)
    out = []
    for g, prompt in enumerate(([5, 6, 7], [9, 10, 11, 12, 13])):
        comps = sampler.generate([prompt], max_new_tokens=6 + g, temperature=1.0, seed=g, n=4)
        out.append(GroupResult(f"d/{g}", 1, tuple(prompt), comps, None, 0.0))
    return out


def _prompt(g: int) -> Prompt:
    return Prompt(f"d/{g}", g, "d", g, 0, "q", "a", "task")


def test_routes_survive_every_hand_off_and_reach_the_trainer(policy, tmp_path):
    results = _groups(policy)
    wire = [GroupResult.from_dict(json.loads(json.dumps(r.to_dict()))) for r in results]
    for sent, got in zip(results, wire, strict=True):
        for a, b in zip(sent.completions, got.completions, strict=True):
            np.testing.assert_array_equal(b.routed_experts, a.routed_experts)
    groups = [scored_group(_prompt(g), r, [1.0, 0.0, 1.0, 0.0], settings())
              for g, r in enumerate(wire)]  # fmt: skip
    assert all(len(g.routed_experts) == 4 for g in groups)
    snapshot = [ScoredGroup.from_dict(json.loads(json.dumps(g.to_dict()))) for g in groups]
    assert snapshot == groups  # the buffer's snapshot keeps them

    batch = Batch(1, tuple(groups))
    arrays = batch.arrays()
    routes = arrays["routed_experts"]
    assert routes.shape == (*arrays["input_ids"].shape, 3, 2) and routes.dtype == np.int16
    r = 0
    for g, result in zip(groups, results, strict=True):
        p = len(g.prompt_tokens)
        for c in result.completions:
            n = len(c.tokens)
            assert (routes[r, :p] == -1).all() and (routes[r, p + n :] == -1).all()
            np.testing.assert_array_equal(routes[r, p : p + n], c.routed_experts)
            assert (routes[r, p : p + n - 1] >= 0).all()  # every token fed back is recorded
            r += 1

    write_step(str(tmp_path), 1, batch, {"d": "task"})
    again = read_step_batch(str(tmp_path), 1).arrays()
    np.testing.assert_array_equal(again["routed_experts"], routes)

    trainer = Trainer(policy, make_objective("grpo"), TrainerConfig(mesh_shape=(1, 1, 1)),
                      str(tmp_path / "run"))  # fmt: skip
    sent = batch.arrays()  # as the trainer service takes them (its mask: the completion's)
    sent["completion_mask"] = sent.pop("mask")
    metrics = trainer.step(sent)
    trainer.close()
    assert 0 < metrics["moe/recorded_routes_frac"] < 1
    assert metrics["moe/route_mismatch_frac"] == 0  # replayed (the default)


def test_a_partial_rollouts_record_keeps_its_routes(policy):
    sampler = Sampler(policy, max_slots=2, max_len=40)
    from rlax_tasks.rollout.requests import Request, SamplingParams

    sampler.add_request(Request((5, 6, 7), SamplingParams(max_new_tokens=30), 0, ("p", 0)))
    sampler.step()  # a prefill and one decode chunk: in flight
    (partial,) = sampler.in_progress()
    assert partial.routed_experts.shape == (len(partial.tokens), 3, 2)
    record = SampleProgress.from_dict(
        json.loads(json.dumps(SampleProgress.of(0, partial).to_dict())), 4, 30
    )
    np.testing.assert_array_equal(record.partial(partial.request).routed_experts,
                                  partial.routed_experts)  # fmt: skip


def test_a_malformed_route_record_is_refused_naming_the_completion(policy):
    (result, _) = _groups(policy)
    wire = result.to_dict()
    wire["completions"][2]["routed_experts"]["shape"][0] += 1
    with pytest.raises(ValueError, match=r"d/0 completion 2: routed_experts holds \d+ tokens"):
        GroupResult.from_dict(wire)
