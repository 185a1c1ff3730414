"""`rlax run --backend ray` on a real local Ray cluster (a head without CPUs, four worker nodes
with two CPUs and a fake GPU each): the trainer over two Ray nodes (two CPU processes × 4 forced
devices joined by jax.distributed), the PS and controller beside its host 0, each worker on a
slice of its own. The node of trainer host 1 is removed mid-run: Ray re-places its bundle, the
trainer starts again there and resumes from its checkpoint, and the run ends with the weights of
the same run on this machine (`rlax run`, local processes, nothing lost), compared on `rlax
export` of each run's final checkpoint; nothing is left on the cluster."""

from __future__ import annotations

import json
import os
import threading
import time

import numpy as np
import pytest
import yaml

from rlax_tasks.cli import main
from rlax_tasks.run.local_run import run_local
from rlax_tasks.trainer.checkpointing import is_complete_checkpoint
from tests.conftest import TEST_XLA_FLAGS
from tests.run.test_local_run import read_jsonl, small_config, small_settings
from tests.run.test_multihost_run import LOCKSTEP, STEPS, exported

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

pytestmark = pytest.mark.slow

MB = 1024 * 1024
# a lost node is noticed within about two seconds (Ray's default health check takes ~30 s)
HEALTH_CHECK = {"health_check_period_ms": 500, "health_check_failure_threshold": 3}
TWO_HOSTS = {**LOCKSTEP, "trainer.hosts": 2, "placement.trainer": [0, 1, 2, 3]}


def _attempt_nodes(run_dir: str) -> dict[str, list[dict[int, str]]]:
    """{job: [{host: Ray node id} of each attempt, in order]} (from the jobs' spec files)."""
    found: dict[str, list] = {}
    for root, _, names in os.walk(os.path.join(run_dir, "slices")):
        base, _, attempt = os.path.basename(root).rpartition(".")
        if attempt.isdigit() and "spec.json" in names:
            with open(os.path.join(root, "spec.json")) as f:
                nodes = json.load(f)["nodes"]
            found.setdefault(base, []).append(
                (int(attempt), {int(h): n["node_id"] for h, n in nodes.items()})
            )
    return {job: [nodes for _, nodes in sorted(rows)] for job, rows in found.items()}


def _remove_trainer_node_after_checkpoint_2(cluster, run_dir: str, seen: dict) -> None:
    """Removes the Ray node of trainer host 1 (a lost machine) once the checkpoint of step 2 is
    complete, so that the trainer resumes from it."""
    deadline = time.monotonic() + 600
    metrics = os.path.join(run_dir, "metrics.jsonl")
    while time.monotonic() < deadline:
        steps = [r["step"] for r in read_jsonl(metrics)] if os.path.exists(metrics) else []
        if steps and is_complete_checkpoint(os.path.join(run_dir, "checkpoints", "2")):
            node_id = _attempt_nodes(run_dir)["trainer"][0][1]
            node = next(n for n in cluster.worker_nodes if n.node_id == node_id)
            seen["step"], seen["node"] = max(steps), node_id
            cluster.remove_node(node, allow_graceful=False)
            return
        time.sleep(0.2)


def test_rlax_run_on_a_ray_cluster_matches_the_local_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XLA_FLAGS", TEST_XLA_FLAGS)  # each job's devices come from placement only
    local = small_config(tmp_path / "local", **TWO_HOSTS)
    run_local(local, steps=STEPS, evaluate=False)

    settings = small_settings(tmp_path / "ray", **TWO_HOSTS)
    head = {"num_cpus": 0, "object_store_memory": 80 * MB, "_system_config": HEALTH_CHECK}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    seen: dict = {}
    run_dir = os.path.join(settings["run_root"], "rayrun")
    try:
        for _ in range(4):
            cluster.add_node(num_cpus=2, num_gpus=1, object_store_memory=80 * MB)
        cluster.wait_for_nodes()
        sets = [f"{k}={yaml.safe_dump(v, default_flow_style=True).strip()}" for k, v in
                settings.items() if k != "run_root"]  # fmt: skip
        argv = ["run", "--preset", "tiny-arith", "--run-root", settings["run_root"],
                "--run-id", "rayrun", "--steps", str(STEPS), "--no-eval",
                "--backend", "ray", "--address", cluster.address]  # fmt: skip
        for item in sets:
            argv += ["--set", item]
        remover = threading.Thread(
            target=_remove_trainer_node_after_checkpoint_2,
            args=(cluster, run_dir, seen),
            daemon=True,
        )
        remover.start()
        assert main(argv) == 0
        remover.join(timeout=5)
        assert seen.get("step"), "the node was not removed"
        nodes = _attempt_nodes(run_dir)
        # the trainer's two hosts on two nodes, the PS and controller beside its host 0, each
        # worker on a node the backend chose
        first, last = nodes["trainer"][0], nodes["trainer"][-1]
        assert first[0] != first[1], nodes
        assert nodes["ps"][0][0] == nodes["controller"][0][0] == first[0], nodes
        assert {"worker-0", "worker-1"} <= nodes.keys()
        # the trainer started again, its host 1 on another node
        assert len(nodes["trainer"]) >= 2 and last[1] != seen["node"], nodes
        log0 = open(os.path.join(run_dir, "logs", "trainer.log")).read()
        log1 = open(os.path.join(run_dir, "logs", "trainer-host1.log")).read()
        assert "process 0 of 2" in log0 and "process 1 of 2" in log1
        assert "restored step 2" in log0  # the attempt after the lost node resumed
        # nothing of the run is left on the cluster
        live = [r for r in ray.util.placement_group_table().values() if r["state"] != "REMOVED"]
        assert live == []
        assert ray.util.list_named_actors(all_namespaces=True) == []
    finally:
        ray.shutdown()
        cluster.shutdown()

    lineage = read_jsonl(os.path.join(run_dir, "lineage.jsonl"))
    assert [r["step"] for r in lineage] == list(range(1, STEPS + 1))
    reference = read_jsonl(os.path.join(local.run_dir, "lineage.jsonl"))
    assert [r["prompt_ids"] for r in lineage] == [r["prompt_ids"] for r in reference]
    a = exported(local.run_dir, str(tmp_path / "export-local"), capsys)
    b = exported(run_dir, str(tmp_path / "export-ray"), capsys)
    assert a.keys() == b.keys() and a
    for name in a:
        np.testing.assert_allclose(b[name], a[name], rtol=0, atol=1e-6, err_msg=name)
