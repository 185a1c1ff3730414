"""The forward pass sharded over a (data, fsdp, tensor) mesh of 8 host devices equals unsharded."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from rlax_tasks.models import LogProbOptions, load_pretrained, make_mesh
from rlax_tasks.models.sharding import fit_spec
from tests.models.hf_models import left_padded_batch, tiny_hf_model

pytestmark = pytest.mark.skipif(
    jax.device_count() < 8, reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8"
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3")
    # dims divisible by the mesh axes so that every rule really shards
    tiny_hf_model("qwen3", num_key_value_heads=2, head_dim=16, vocab_size=96).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("axes", [(2, 2, 2), (1, 4, 2), (1, 1, 8), (8, 1, 1)])
def test_sharded_forward_equals_unsharded(checkpoint, axes):
    data, fsdp, tensor = axes
    mesh = make_mesh(data=data, fsdp=fsdp, tensor=tensor)
    single = load_pretrained(checkpoint)
    sharded = load_pretrained(checkpoint, mesh=mesh)
    ids, mask = left_padded_batch(np.random.default_rng(0), 96, [16, 9, 16, 3, 12, 16, 1, 5])
    expected = np.asarray(single.logits(ids, mask))
    got = sharded.logits(ids, mask)
    np.testing.assert_allclose(np.asarray(got), expected, atol=1e-5)
    np.testing.assert_allclose(
        np.asarray(sharded.token_logprobs(ids, mask, LogProbOptions(4))),
        np.asarray(single.token_logprobs(ids, mask, LogProbOptions(4))),
        atol=1e-5,
    )


def test_parameters_are_laid_out_over_the_mesh(checkpoint):
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    policy = load_pretrained(checkpoint, mesh=mesh)
    q = policy.params["layers"]["self_attn"]["q_proj"]["kernel"][...]
    # [layers, hidden, heads, head_dim]: hidden over fsdp, heads over tensor
    assert q.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)
    shard_shape = q.addressable_shards[0].data.shape
    assert shard_shape == (q.shape[0], q.shape[1] // 2, q.shape[2] // 2, q.shape[3])
    emb = policy.params["embed_tokens"]["embedding"][...]
    assert emb.sharding.spec == jax.sharding.PartitionSpec("tensor", "fsdp")
    # shard() of an unsharded policy gives the same layout
    again = load_pretrained(checkpoint).shard(mesh)
    q2 = again.params["layers"]["self_attn"]["q_proj"]["kernel"][...]
    assert q2.sharding.spec == q.sharding.spec


def test_indivisible_dimensions_fall_back_to_replication():
    spec = fit_spec(
        (6, 8, 3), (("data", "fsdp"), "tensor", "tensor"), {"data": 2, "fsdp": 2, "tensor": 2}
    )
    assert tuple(spec) == (None, "tensor", None)


def test_mesh_size_must_match_devices():
    with pytest.raises(ValueError, match="needs 12 devices"):
        make_mesh(data=3, fsdp=2, tensor=2)
