"""A mixture-of-experts model through the parameter server (docs/design.md §14): expert weights
pushed from an expert-sharded trainer land in a worker's other layout, and a version where only
some experts changed (only they got tokens) reaches a worker as a delta of those blocks."""

from __future__ import annotations

import jax
import ml_dtypes
import numpy as np
import pytest

from rlax_tasks.models import ModelConfig, Policy, make_mesh
from rlax_tasks.paramserver.naming import flatten_named

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (forced host) devices")
CONFIG = ModelConfig(
    model_type="qwen3_moe", vocab_size=64, hidden_size=64, intermediate_size=64,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, qk_norm=True,
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
)  # fmt: skip
EXPERTS = "layers.mlp.experts"


def _bf16(policy: Policy) -> dict[str, np.ndarray]:
    return {k: np.asarray(v).astype(ml_dtypes.bfloat16)
            for k, v in flatten_named(policy.params).items()}  # fmt: skip


def test_expert_weights_round_trip_between_expert_layouts(server, client_for):
    base = Policy.init(CONFIG, seed=3)
    trainer = base.shard(make_mesh(1, 2, 1, devices=jax.devices()[:8], expert=4))
    client_for(server.address, chunk_bytes=4096).push(1, trainer.params)
    worker_template = Policy.init(CONFIG, seed=9).shard(
        make_mesh(1, 1, 1, devices=jax.devices()[:8], expert=8)
    ).params
    version, params = client_for(server.address, worker_id="w0").pull(like=worker_template)
    assert version == 1
    got, want = flatten_named(params), flatten_named(base.params)
    for name in want:
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]), err_msg=name)
    gate = jax.tree_util.tree_leaves(params["layers"]["mlp"]["experts"]["gate_proj"])[0]
    assert gate.sharding.spec[1] == "expert"  # into the worker's expert-sharded layout


def test_a_version_where_two_experts_changed_is_a_delta_of_their_blocks(make_server, client_for):
    ps = make_server(keep_versions=4)
    trainer = client_for(ps.address, chunk_bytes=16 * 1024)
    worker = client_for(ps.address, worker_id="w0", shared_memory=False)
    worker.register()
    v1 = _bf16(Policy.init(CONFIG, seed=0))
    trainer.push(1, v1)
    worker.pull()
    worker.ack(1)
    v2 = {k: v.copy() for k, v in v1.items()}
    for part in ("gate_proj", "up_proj", "down_proj"):  # experts 2 and 5 of layer 1 learned
        v2[f"{EXPERTS}.{part}"][1, [2, 5]] += ml_dtypes.bfloat16(0.5)
    trainer.push(2, v2)
    _, got = worker.pull(min_version=2)
    stats = worker.last_pull
    assert (stats.version, stats.base) == (2, 1)
    experts_bytes = sum(v1[f"{EXPERTS}.{p}"].nbytes for p in ("gate_proj", "up_proj",
                                                             "down_proj"))  # fmt: skip
    # 2 of the 16 (layer, expert) blocks changed: the delta carries about an eighth of them
    assert stats.nbytes < 0.25 * experts_bytes, (stats.nbytes, experts_bytes)
    for name, want in v2.items():
        np.testing.assert_array_equal(np.asarray(got[name]).view(np.uint16),
                                      want.view(np.uint16), err_msg=name)  # fmt: skip
