"""Expert parallelism over 8 forced host devices: a tiny Qwen3-MoE on meshes expert 4 x fsdp 2,
expert 8 and expert 2 x tensor 2 x fsdp 2 computes what one device does (forward, the
sampler's greedy tokens and log-probs, the trainer's step), and no device holds an expert
weight whole."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from rlax_tasks.algorithms import make_objective
from rlax_tasks.models import ModelConfig, Policy, make_mesh
from rlax_tasks.rollout import Sampler
from rlax_tasks.trainer import Trainer, TrainerConfig
from tests.trainer.helpers import random_batch

pytestmark = pytest.mark.skipif(
    jax.device_count() < 8, reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8"
)
# every expert dimension divisible by 8: experts 8, hidden 32, expert width 16
CONFIG = ModelConfig(
    model_type="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=64,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, qk_norm=True,
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
)  # fmt: skip
MESHES = {"expert4-fsdp2": (1, 2, 4, 1), "expert8": (1, 1, 8, 1), "e2-t2-f2": (1, 2, 2, 2)}
PROMPTS = [[5, 17, 33, 3], [20, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [42] * 6]


def _mesh(name: str):  # noqa: ANN202
    data, fsdp, expert, tensor = MESHES[name]
    return make_mesh(data, fsdp, tensor, devices=jax.devices()[:8], expert=expert)


@pytest.fixture(scope="module")
def policy() -> Policy:
    """Peaked random weights: greedy choices and routes are not near-ties that a sharded
    product's reduction order could flip."""
    p = Policy.init(CONFIG, seed=0)
    return p.with_params(jax.tree.map(lambda a: a * 3.0, p.params))


@pytest.fixture(scope="module")
def single(policy):
    outs = Sampler(policy, max_slots=4, max_len=48).generate(
        PROMPTS, max_new_tokens=12, temperature=0.0, ignore_eos=True
    )
    return outs


def _expert_arrays(p: Policy) -> dict[str, jax.Array]:
    experts = p.params["layers"]["mlp"]["experts"]
    return {name: experts[name][...] for name in ("gate_proj", "up_proj", "down_proj")}


@pytest.mark.parametrize("name", sorted(MESHES))
def test_no_device_holds_an_expert_weight_whole(policy, name):
    sharded = policy.shard(_mesh(name))
    for key, array in _expert_arrays(sharded).items():
        assert array.sharding.spec[1] == "expert", (key, array.sharding.spec)
        for shard in array.addressable_shards:
            assert shard.data.size < array.size, (key, shard.device, shard.data.shape)
            # each device holds E / expert of the experts
            assert shard.data.shape[1] == CONFIG.num_experts // MESHES[name][2]


@pytest.mark.parametrize("name", sorted(MESHES))
def test_sharded_sampler_and_forward_equal_one_device(policy, single, name):
    sharded = policy.shard(_mesh(name))
    ids = np.array([p + o.tokens for p, o in zip(PROMPTS[:1], single[:1], strict=True)])
    np.testing.assert_allclose(np.asarray(sharded.token_logprobs(ids)),
                               np.asarray(policy.token_logprobs(ids)), atol=1e-5)  # fmt: skip
    outs = Sampler(sharded, max_slots=4, max_len=48).generate(
        PROMPTS, max_new_tokens=12, temperature=0.0, ignore_eos=True
    )
    for ref, out in zip(single, outs, strict=True):
        assert out.tokens == ref.tokens
        np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-5, rtol=0)
        np.testing.assert_array_equal(out.routed_experts, ref.routed_experts)


def _one_step(policy: Policy, mesh_shape: tuple, run_dir: str) -> tuple[dict, dict]:
    trainer = Trainer(policy, make_objective("grpo"), TrainerConfig(
        learning_rate=1e-4, mesh_shape=mesh_shape, micro_batch_size=4), run_dir)  # fmt: skip
    metrics = trainer.step(random_batch(0))
    params = {jax.tree_util.keystr(k): np.asarray(v)
              for k, v in jax.tree_util.tree_leaves_with_path(trainer.params)}  # fmt: skip
    trainer.close()
    return params, metrics


@pytest.mark.parametrize("name", ["expert4-fsdp2", "expert8"])
def test_the_trainer_step_on_an_expert_mesh_equals_one_devices(policy, name, tmp_path):
    want, want_metrics = _one_step(policy, (1, 1, 1), str(tmp_path / "one"))
    got, got_metrics = _one_step(policy, MESHES[name], str(tmp_path / name))
    for key in ("loss", "grad_norm", "entropy", "moe/router_entropy"):
        np.testing.assert_allclose(got_metrics[key], want_metrics[key], rtol=1e-5, atol=1e-5,
                                   err_msg=key)  # fmt: skip
    for k in want:
        np.testing.assert_allclose(got[k], want[k], atol=1e-5, err_msg=k)
