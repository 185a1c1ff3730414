"""Per-token weight versions through the controller: a worker that continued sequences on newer
weights reports each token's version; staleness is judged by the oldest, and the versions reach
the trainer's batch, rollouts/ (a replayed step trains on the same arrays), snapshots and
lineage (with per-token staleness in the exported scalars)."""

from __future__ import annotations

import json

import numpy as np

from rlax_tasks.controller import SnapshotStore, read_rollouts
from rlax_tasks.controller.buffer import ScoredGroup
from rlax_tasks.controller.lineage import read_lineage
from rlax_tasks.controller.rollouts import read_step_batch
from rlax_tasks.rollout.requests import Completion, GroupResult, Request, SamplingParams
from rlax_tasks.trainer.scalar_export import lineage_scalars
from tests.controller.fakes import World, controller, trained

STEPS = 5


def test_token_versions_reach_the_batch_rollouts_snapshots_and_lineage(tmp_path):
    run_dir = str(tmp_path / "run")
    world = World()
    world.pool.mid_sequence_reloads = True
    c = controller(run_dir, world)
    c.start()
    c.run(STEPS, max_iterations=500)
    batches = world.trainer.batches
    assert len(batches) == STEPS
    spans = 0
    for step, batch in enumerate(batches, start=1):
        arrays = batch.arrays()
        versions = arrays["token_versions"]
        r = 0
        for g in batch.groups:
            assert g.version == min(min(v) for v in g.token_versions)  # the oldest token
            assert batch.version - g.version <= 2  # max_staleness bounds every token
            for i, tv in enumerate(g.token_versions):
                p, n = len(g.prompt_tokens), len(g.completions[i])
                assert versions[r, p : p + n].tolist() == list(tv)
                assert (versions[r, :p] == -1).all() and (versions[r, p + n :] == -1).all()
                spans += len(set(tv)) > 1
                r += 1
        again = read_step_batch(run_dir, step).arrays()
        for key in arrays:
            np.testing.assert_array_equal(again[key], arrays[key], err_msg=key)
    assert spans > 0, "no completion spanned two versions"
    rows = read_rollouts(run_dir)
    assert rows["token_versions"].notna().all()
    oldest = rows.assign(m=rows["token_versions"].map(min)).groupby(["step", "group_id"])["m"]
    assert (rows["weight_version"] == oldest.transform("min")).all()  # the group's oldest token
    lineage = read_lineage(run_dir)
    for record, batch in zip(lineage, batches, strict=True):
        counts = record["token_versions"]
        assert counts == [g.version_counts() for g in batch.groups]
        tokens = [v for g in batch.groups for tv in g.token_versions for v in tv]
        lags = [batch.version - v for v in tokens]
        scalars = lineage_scalars(record)
        assert scalars["staleness/token_mean"] == sum(lags) / len(lags)
        assert scalars["staleness/token_max"] == max(lags)
    snap = SnapshotStore(run_dir).load_latest()
    restored = [ScoredGroup.from_dict(json.loads(json.dumps(g))) for g in snap.buffer["groups"]]
    assert restored and all(g.token_versions for g in restored)
    assert [g.to_dict() for g in restored] == snap.buffer["groups"]


def test_without_per_token_versions_the_group_version_stands_for_every_token(tmp_path):
    world = World()
    run_dir, c = trained(tmp_path, world, 2)
    assert all("token_versions" not in b.arrays() for b in world.trainer.batches)
    assert read_rollouts(run_dir)["token_versions"].isna().all()
    record, batch = read_lineage(run_dir)[0], world.trainer.batches[0]
    sizes = [sum(map(len, g.completions)) for g in batch.groups]
    assert record["token_versions"] == [
        [[g.version, n]] for g, n in zip(batch.groups, sizes, strict=True)
    ]


def test_a_worker_result_carries_token_versions_through_json():
    params = SamplingParams(max_new_tokens=4)
    comps = [
        Completion(Request((5,), params, 0), [7, 8, 9], [-0.5] * 3, "eos", None, [3, 3, 4]),
        Completion(Request((5,), params, 1), [8], [-0.1], "length", None, [4]),
    ]
    result = GroupResult("p", 3, (5,), comps, None, 0)
    got = GroupResult.from_dict(json.loads(json.dumps(result.to_dict())))
    assert [c.versions for c in got.completions] == [[3, 3, 4], [4]]
