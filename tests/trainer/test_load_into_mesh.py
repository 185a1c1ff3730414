"""The trainer loads its base model straight into its mesh (8 forced host devices): every
parameter goes to its shards as it is read, so none is ever whole on one device."""

from __future__ import annotations

import math

import jax
import pytest

from rlax_tasks.config import load_config
from rlax_tasks.models import Policy
from rlax_tasks.run.trainer_process import load_trainer_policy
from tests.tiny_model import tiny_model_config

# every sharded dimension divisible by 8 (heads 16, kv heads 8, ffn 128, vocab 256, hidden 64)
CONFIG = tiny_model_config(
    "wide", vocab_size=256, num_attention_heads=16, num_key_value_heads=8, head_dim=8
)


def test_no_parameter_is_whole_on_one_device_while_the_trainer_loads(tmp_path, monkeypatch):
    Policy.init(CONFIG, seed=0).save_pretrained(str(tmp_path / "model"))
    cfg = load_config("tiny-arith", {
        "model.path": str(tmp_path / "model"), "model.warmup_if_missing": False,
        "trainer.mesh_shape": [1, -1, 1],
    })  # fmt: skip
    placed = []  # (shape, spec, largest slice read for one device) of every array made
    make_array = jax.make_array_from_callback

    def watching(shape, sharding, callback, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        indices = sharding.addressable_devices_indices_map(shape).values()
        slice_size = math.prod(sharding.shard_shape(tuple(shape)))
        assert all(callback(i).size == slice_size for i in indices)  # its own slice, no more
        placed.append((tuple(shape), sharding.spec, slice_size))
        assert len(sharding.device_set) == 8, sharding  # on the trainer's mesh
        return make_array(shape, sharding, callback, *args, **kwargs)

    def no_whole_put(*args, **kwargs):  # noqa: ANN002, ANN003
        raise AssertionError("a parameter was put on a device whole (jax.device_put)")

    monkeypatch.setattr(jax, "make_array_from_callback", watching)
    monkeypatch.setattr(jax, "device_put", no_whole_put)
    policy = load_trainer_policy(cfg)
    monkeypatch.undo()

    assert len(placed) == len(jax.tree.leaves(policy.params))
    # the weight matrices and the embedding (fsdp-sharded): 1/8 of each on each device
    split = [(shape, n) for shape, spec, n in placed if "fsdp" in jax.tree.leaves(tuple(spec))]
    # embedding, lm_head, q, k, v, o, gate, up, down
    assert len(split) == 9 and all(n * 8 == math.prod(s) for s, n in split), split
    # what is whole on every device: the norms and biases the rule table replicates here
    whole = [shape for shape, _, n in placed if n == math.prod(shape)]
    assert all(math.prod(shape) <= 2 * 64 * 2 for shape in whole), whole


def test_a_trainer_mesh_larger_than_the_host_is_refused(tmp_path):
    Policy.init(CONFIG, seed=0).save_pretrained(str(tmp_path / "model"))
    cfg = load_config("tiny-arith", {
        "model.path": str(tmp_path / "model"), "model.warmup_if_missing": False,
        "trainer.mesh_shape": [1, 16, 1],
    })  # fmt: skip
    with pytest.raises(ValueError, match=r"needs 16 devices, only 8 exist"):
        load_trainer_policy(cfg)
