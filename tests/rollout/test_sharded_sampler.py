"""The sampler on a worker mesh (8 forced host devices): same completions as on one device, each
device holding ~1/8 of the weights and of the KV cache, and reloads that swap weights in place."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from rlax_tasks.models import Policy, load_pretrained, make_mesh
from rlax_tasks.models.sharding import MESH_AXES
from rlax_tasks.rollout import Sampler, service
from tests.rollout.prefill_rows import record_prefill_rows
from tests.tiny_model import tiny_model_config

# every sharded dimension divisible by 8 (heads 16, kv heads 8, ffn 128, vocab 256, hidden 64)
CONFIG = tiny_model_config(
    "wide", vocab_size=256, num_attention_heads=16, num_key_value_heads=8, head_dim=8
)
PROMPTS = [[5, 17, 99, 3], [200, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [42] * 6]
SLOTS, MAX_LEN, NEW = 4, 64, 12
THREE_AXES = tuple(a for a in MESH_AXES if a != "expert")  # a dense model's user mesh


def _peaked_policy(seed: int = 0) -> Policy:
    """Random weights scaled so next-token distributions are peaked: greedy choices are not
    near-ties that the reduction order of a sharded matmul could flip."""
    policy = Policy.init(CONFIG, seed=seed)
    return policy.with_params(jax.tree.map(lambda a: a * 4.0, policy.params))


def _generate(policy: Policy) -> list:
    sampler = Sampler(policy, max_slots=SLOTS, max_len=MAX_LEN)
    return sampler.generate(PROMPTS, max_new_tokens=NEW, temperature=0.0, ignore_eos=True)


def _device_bytes(tree, device) -> int:  # noqa: ANN001
    return sum(
        s.data.nbytes
        for a in jax.tree.leaves(tree)
        for s in a.addressable_shards
        if s.device == device
    )


@pytest.fixture(scope="module")
def single_device():
    policy = _peaked_policy()
    return policy, _generate(policy)


@pytest.mark.parametrize("shape", [(1, 1, 8), (1, 2, 4)], ids=["1x8", "2x4"])
def test_sharded_sampler_equals_one_device(single_device, shape) -> None:  # noqa: ANN001
    policy, reference = single_device
    mesh = make_mesh(*shape, devices=jax.devices()[:8])
    sharded = policy.shard(mesh)
    sampler = Sampler(sharded, max_slots=SLOTS, max_len=MAX_LEN)
    outs = sampler.generate(PROMPTS, max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
    for ref, out in zip(reference, outs, strict=True):
        assert out.tokens == ref.tokens
        np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-5, rtol=0)

    device = jax.devices()[0]
    total = sum(a.nbytes for a in jax.tree.leaves(sampler.params))
    held = _device_bytes(sampler.params, device)
    assert held <= 1.1 * total / 8, (held, total)  # norms are replicated: a little over 1/8
    cache = sampler._cache
    kv_total = sum(a.nbytes for a in (*cache.k, *cache.v))
    assert _device_bytes([cache.k, cache.v], device) == kv_total // 8
    # decode's own copies of the layers: sharded like the stacked weights, never whole
    assert len(sampler._held.layers) == sampler.policy.config.num_hidden_layers
    layers = sum(a.nbytes for a in jax.tree.leaves(sampler._held.layers))
    assert _device_bytes(sampler._held.layers, device) <= 1.1 * layers / 8


def test_without_layer_copies_decode_reads_the_stacked_layers_and_equals_one_device(
    single_device,
) -> None:  # noqa: ANN001
    """workers.decode_layer_copies: false on a mesh: no second copy of the layers, the same
    completions (decode reads slices of the stacked weights)."""
    policy, reference = single_device
    mesh = make_mesh(1, 1, 8, devices=jax.devices()[:8])
    sampler = Sampler(policy.shard(mesh), max_slots=SLOTS, max_len=MAX_LEN, layer_copies=False)
    assert sampler._held.layers is None
    outs = sampler.generate(PROMPTS, max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
    for ref, out in zip(reference, outs, strict=True):
        assert out.tokens == ref.tokens
        np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-5, rtol=0)


def test_reload_swaps_weights_in_place_and_matches_a_fresh_sampler() -> None:
    mesh = make_mesh(1, 1, 8, devices=jax.devices()[:8])
    sampler = Sampler(_peaked_policy(0).shard(mesh), max_slots=SLOTS, max_len=MAX_LEN)
    host = lambda p: jax.tree.map(np.asarray, p.params)  # noqa: E731 (as the worker pulls)
    sampler.set_params(host(_peaked_policy(1)))  # the sampler now owns its buffers
    weights = sum(a.nbytes for a in jax.tree.leaves(sampler.params))
    largest = max(a.nbytes for a in jax.tree.leaves(sampler.params))

    new = host(_peaked_policy(2))
    peak, put = [0], jax.device_put
    baseline = sum(a.nbytes for a in jax.live_arrays())

    def watching_put(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        out = put(*args, **kwargs)
        peak[0] = max(peak[0], sum(a.nbytes for a in jax.live_arrays()))
        return out

    jax.device_put = watching_put
    try:
        sampler.set_params(new)
    finally:
        jax.device_put = put
    assert peak[0] - baseline <= largest, (peak[0] - baseline, largest, weights)

    fresh = _generate(_peaked_policy(2))
    swapped = sampler.generate(PROMPTS, max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
    assert [o.tokens for o in swapped] == [o.tokens for o in fresh]


def test_a_sampler_never_frees_the_callers_weights() -> None:
    policy = _peaked_policy(0)
    sampler = Sampler(policy, max_slots=SLOTS, max_len=MAX_LEN)
    sampler.set_params(jax.tree.map(np.asarray, _peaked_policy(1).params))
    assert all(not a.is_deleted() for a in jax.tree.leaves(policy.params))
    policy.logits([[1, 2, 3]])  # still usable


def test_worker_mesh_flag() -> None:
    mesh = service.worker_mesh("1,2,-1")
    assert dict(mesh.shape) == {"data": 1, "fsdp": 2, "expert": 1, "tensor": 4}
    mesh = service.worker_mesh("1,1,4,2")  # data, fsdp, expert, tensor
    assert dict(mesh.shape) == {"data": 1, "fsdp": 1, "expert": 4, "tensor": 2}
    for bad in ("1,1", "1,0,1", "a,b,c", "-1,-1,1", "1,1,1,1,8"):
        with pytest.raises(ValueError, match="--mesh-shape"):
            service.worker_mesh(bad)
    with pytest.raises(ValueError, match="needs"):
        service.worker_mesh("1,3,1")


GROUPS = dict(max_new_tokens=NEW, temperature=1.0, seed=7, n=4, ignore_eos=True)


@pytest.fixture(scope="module")
def groups_unsharded():
    """A peaked policy and its 4 x 4 group completions on one device (that these equal one slot
    at a time's, prefilled each on its own: ``test_sampler.py``)."""
    policy = _peaked_policy(3)
    return policy, Sampler(policy, max_slots=16, max_len=MAX_LEN).generate(PROMPTS, **GROUPS)


@pytest.mark.parametrize("shape", [(1, 1, 8), (2, 1, 4)], ids=["1x1x8", "2x1x4"])
def test_groups_on_a_mesh_share_their_prefill_and_sample_as_on_one_device(
    groups_unsharded: tuple, shape: tuple[int, int, int]
) -> None:
    """A group's n samples of one prompt take one prefill row on a worker mesh too (2x1x4: the
    slots sharded over data, a prompt row's cache entries copied to slots on other devices),
    and sample exactly the tokens they do on one device."""
    policy, alone = groups_unsharded
    mesh = make_mesh(*shape, devices=jax.devices()[:8])
    sampler = Sampler(policy.shard(mesh), max_slots=16, max_len=MAX_LEN)
    rows = record_prefill_rows(sampler)
    outs = sampler.generate(PROMPTS, **GROUPS)
    assert rows == [(4, 16)]  # 4 distinct prompts, 16 requests: one prefill of 4 prompt rows
    assert [o.tokens for o in outs] == [o.tokens for o in alone]
    for out, ref in zip(outs, alone, strict=True):
        np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=5e-5, rtol=0)


@pytest.mark.parametrize(
    ("shape", "axes"),
    [((1, 8), ("fsdp", "tensor")), ((1, 2, 4), THREE_AXES), ((2, 1, 4), THREE_AXES)],
    ids=["1x8", "1x2x4", "2x1x4"],
)
def test_a_jax_make_mesh_mesh_gives_the_one_device_tokens(single_device, shape, axes, tmp_path):
    """A mesh built with jax.make_mesh (Explicit axes, JAX's default) through load_pretrained
    and the sampler: the single device's greedy tokens and log-probs."""
    policy, reference = single_device
    policy.save_pretrained(str(tmp_path))
    mesh = jax.make_mesh(shape, axes, devices=jax.devices()[:8])
    loaded = load_pretrained(str(tmp_path), mesh=mesh)
    for sharded in (loaded, policy.shard(mesh)):
        sampler = Sampler(sharded, max_slots=SLOTS, max_len=MAX_LEN)
        _assert_sharded_as_the_mesh_says(sampler, dict(mesh.shape))  # as placed
        outs = sampler.generate(PROMPTS, max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
        for ref, out in zip(reference, outs, strict=True):
            assert out.tokens == ref.tokens
            np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-5, rtol=0)
        _assert_sharded_as_the_mesh_says(sampler, dict(mesh.shape))  # as the kernels left it


def _splits(name: str, sizes: dict[str, int]) -> int:
    """How many pieces the mesh cuts a weight into (the layout written out for this dense model,
    whose every cut dimension divides): weight matrices over fsdp x tensor, q/k/v biases over
    tensor (their heads), norms whole on every device; data replicates."""
    if "norm" in name:
        return 1
    if name.endswith("bias"):
        return sizes.get("tensor", 1)
    return sizes.get("fsdp", 1) * sizes.get("tensor", 1)


def _assert_sharded_as_the_mesh_says(sampler: Sampler, sizes: dict[str, int]) -> None:
    """Every addressable shard of each weight holds its total / splits bytes, on 8 devices; each
    layer's KV cache [slots, kv heads, ...] is cut over data x fsdp (slots) and tensor (kv heads):
    1/8 of it per device."""
    devices = set(jax.devices()[:8])
    for path, leaf in jax.tree_util.tree_leaves_with_path(sampler.params):
        name = ".".join(str(k.key) for k in path if hasattr(k, "key"))  # (not the .value)
        shards = leaf.addressable_shards
        assert {s.device for s in shards} == devices, name
        want = leaf.nbytes // _splits(name, sizes)
        assert all(s.data.nbytes == want for s in shards), (name, want, leaf.sharding)
    cache = sampler._cache
    slots = sizes.get("data", 1) * sizes.get("fsdp", 1)
    heads = sizes.get("tensor", 1)
    for k in cache.k:
        b, kv, hd, s = k.shape
        assert k.sharding.shard_shape(k.shape) == (b // slots, kv // heads, hd, s)
    for v in cache.v:
        b, kv, s, hd = v.shape
        assert v.sharding.shard_shape(v.shape) == (b // slots, kv // heads, s, hd)
    for x in (*cache.k, *cache.v):
        assert {sh.data.nbytes for sh in x.addressable_shards} == {x.nbytes // 8}


def test_a_mesh_with_other_axis_names_is_refused_in_one_line(single_device):
    policy, _ = single_device
    mesh = jax.make_mesh((1, 8), ("x", "model"), devices=jax.devices()[:8])
    with pytest.raises(ValueError, match=r"^mesh axes \('x', 'model'\): RLAX shards over axes"):
        policy.shard(mesh)
