"""Sampling-mask replay through the controller: the ids a worker's top-k/top-p kept per token
reach the trainer's batch (``support_ids``), rollouts/ (so a replayed step trains on the same
arrays) and snapshots of the buffer."""

from __future__ import annotations

import json

import numpy as np

from rlax_tasks.controller import SnapshotStore, read_rollouts
from rlax_tasks.controller.buffer import ScoredGroup, support_width
from rlax_tasks.controller.rollouts import read_step_batch
from rlax_tasks.rollout.requests import Completion, GroupResult, Request, SamplingParams
from tests.controller.fakes import World, controller, trained

STEPS = 4
TOP_K = SamplingParams(max_new_tokens=6, temperature=1.0, top_k=3)


def test_kept_ids_reach_the_batch_rollouts_and_snapshots(tmp_path):
    world = World()
    run_dir, c = trained(tmp_path, world, STEPS, sampling=TOP_K)
    assert len(world.trainer.batches) == STEPS
    rows = read_rollouts(run_dir)
    assert rows["support"].notna().all()
    for step, batch in enumerate(world.trainer.batches, start=1):
        arrays = batch.arrays()
        support = arrays["support_ids"]
        assert support.shape[:2] == arrays["input_ids"].shape and support.shape[2] == 2
        r = 0
        for g in batch.groups:  # each token's kept ids at its position, -1 elsewhere
            for i, kept in enumerate(g.support):
                p, n = len(g.prompt_tokens), len(g.completions[i])
                assert (support[r, :p] == -1).all() and (support[r, p + n :] == -1).all()
                for t, ids in enumerate(kept):
                    want = list(ids) + [-1] * (2 - len(ids))
                    assert support[r, p + t].tolist() == want
                    if ids:
                        assert g.completions[i][t] in ids
                r += 1
        # a replayed step (the trainer restored an older checkpoint) trains on the same arrays
        again = read_step_batch(run_dir, step).arrays()
        assert again.keys() == arrays.keys()
        for key in arrays:
            np.testing.assert_array_equal(again[key], arrays[key], err_msg=key)
    # groups waiting in the buffer keep theirs through a snapshot
    snap = SnapshotStore(run_dir).load_latest()
    assert snap.buffer["groups"]
    restored = [ScoredGroup.from_dict(json.loads(json.dumps(g))) for g in snap.buffer["groups"]]
    assert [g.support for g in restored] == [g.support for g in c.buffer.groups]
    assert all(g.support for g in restored)


def test_unfiltered_sampling_carries_no_support(tmp_path):
    world = World()
    c = controller(str(tmp_path / "run"), world)  # temperature 1, no top-k/top-p
    c.start()
    c.run(2, max_iterations=500)
    assert all("support_ids" not in b.arrays() for b in world.trainer.batches)
    assert read_rollouts(str(tmp_path / "run"))["support"].isna().all()


def test_a_worker_result_carries_its_support_through_json():
    prompt = (5, 6)
    comps = [
        Completion(Request(prompt, TOP_K, 0), [7, 8], [-0.5, -0.25], "eos", [[7, 9], []]),
        Completion(Request(prompt, TOP_K, 1), [8], [-0.1], "length"),
    ]
    got = GroupResult.from_dict(
        json.loads(json.dumps(GroupResult("p", 1, prompt, comps, None, 0).to_dict()))
    )
    assert [c.support for c in got.completions] == [[[7, 9], []], None]


def test_support_width_is_a_power_of_two():
    assert [support_width(n) for n in (0, 1, 2, 3, 5, 20, 64, 65)] == [1, 1, 2, 4, 8, 32, 64, 128]
