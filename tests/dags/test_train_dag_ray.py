"""`dag.test()` of rlax_train on the ray backend, on a real local Ray cluster (a head without
CPUs, four worker nodes with two CPUs and a fake GPU each, one of them spare): a 2-host trainer
slice (the trainer one jax.distributed group over two Ray nodes, the PS and the controller
beside host 0) and a worker slice of its own, every host running real `rlax` jobs in Ray
actors. The node of trainer host 1 is removed mid-run: Ray re-places its bundle on the spare
node, the jobs' retries start there and the run resumes from its checkpoint: every step applied
once, the final evaluation and report written, no actor or placement group left."""

from __future__ import annotations

import json
import os

import pytest

from tests.dags.conftest import drill_conf, drill_dag, read_jsonl, when_trained

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

MB = 1024 * 1024
STEPS = 4
RUN_ID = "rayrun"
NAMESPACE = "rlax-dag-test"
# a lost node is noticed within about two seconds (Ray's default health check takes ~30 s)
HEALTH_CHECK = {"health_check_period_ms": 500, "health_check_failure_threshold": 3}
NODE = {"num_cpus": 2, "num_gpus": 1, "object_store_memory": 80 * MB}


def _trainer_nodes() -> dict[int, str]:
    """{host: Ray node id} of the run's trainer slice, as Ray placed its bundles."""
    for row in ray.util.placement_group_table().values():
        if row["state"] != "REMOVED" and f"rlax-{RUN_ID}-trainer" in row["name"]:
            return dict(row["bundles_to_node_id"])
    return {}


def _job_nodes(run_dir: str, job: str) -> list[dict[int, str]]:
    """{host: Ray node id} of every attempt of ``job``, in order (from the jobs' spec files)."""
    specs = []
    for root, _, names in os.walk(os.path.join(run_dir, "slices")):
        base, _, attempt = os.path.basename(root).rpartition(".")
        if base == job and attempt.isdigit() and "spec.json" in names:
            with open(os.path.join(root, "spec.json")) as f:
                nodes = json.load(f)["nodes"]
            specs.append((int(attempt), {int(h): n["node_id"] for h, n in nodes.items()}))
    return [nodes for _, nodes in sorted(specs)]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_rlax_train_on_a_ray_cluster_survives_a_lost_node(tmp_path, monkeypatch, airflow_db):
    from airflow.utils.state import DagRunState

    # the trainer's 2 hosts each on a Ray node of its own, the worker on a 1-host slice
    conf = drill_conf(tmp_path, RUN_ID, STEPS, "2xcpu", "cpu")
    run_root = conf["run_root"]
    run_dir = os.path.join(run_root, RUN_ID)
    head = {"num_cpus": 0, "object_store_memory": 80 * MB, "_system_config": HEALTH_CHECK}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    try:
        nodes = [cluster.add_node(**NODE).node_id for _ in range(4)]
        cluster.wait_for_nodes()
        # the backend and its cluster come from a Ray Connection (rlax_ray); each host's bundle
        # takes a whole node's CPUs: the trainer's hosts and the worker are on three nodes
        extra = {
            "address": cluster.address,
            "namespace": NAMESPACE,
            "cpus_per_host": 2,
            "stop_grace_s": 2.0,
        }
        dag = drill_dag(monkeypatch, tmp_path, {"conn_type": "rlax_ray", "extra": extra})
        seen: dict = {}

        def remove_node_of_trainer_host_1(step: int) -> None:
            node_id = _trainer_nodes()[1]
            seen["step"], seen["node"] = step, node_id
            lost = next(n for n in cluster.worker_nodes if n.node_id == node_id)
            cluster.remove_node(lost, allow_graceful=False)

        remover = when_trained(run_dir, 2, remove_node_of_trainer_host_1)
        dr = dag.test(run_conf=conf)
        remover.join(timeout=5)
        tis = {(ti.task_id, ti.map_index): ti for ti in dr.get_task_instances()}
        states = {f"{k[0]}[{k[1]}]": ti.state for k, ti in tis.items()}
        assert dr.state == DagRunState.SUCCESS, states
        assert seen.get("step"), "no node was removed"
        # the trainer's jobs were retried on the re-placed slice, off the lost node
        assert tis[("trainer", -1)].try_number >= 2, states
        trainer, worker = _job_nodes(run_dir, "trainer"), _job_nodes(run_dir, "worker-0")
        first = trainer[0]
        assert len({first[0], first[1], worker[0][0]}) == 3, (trainer, worker)
        assert first[1] == seen["node"]
        # Ray re-placed the lost host's bundle on the spare node; host 0 stayed where it was
        spare = set(nodes) - {first[0], first[1], worker[0][0]}
        assert {trainer[-1][1]} == spare and trainer[-1][0] == first[0], (trainer, nodes)
        lineage = read_jsonl(os.path.join(run_dir, "lineage.jsonl"))
        assert [r["step"] for r in lineage] == list(range(1, STEPS + 1))  # each step once
        consumed = [p for r in lineage for p in r["prompt_ids"]]
        assert len(consumed) == len(set(consumed)) == STEPS * 4
        logs = [
            open(os.path.join(root, name)).read()
            for root, _, names in os.walk(run_root)
            for name in names
            if name == "stderr.log" and "trainer" in root
        ]
        assert any("process 0 of 2" in text for text in logs)
        assert any("process 1 of 2" in text for text in logs)
        assert any("restored step" in text for text in logs)  # resumed from its checkpoint
        # the final evaluation and the report; the recorded state
        assert os.path.exists(os.path.join(run_dir, "eval", f"v{STEPS}", "results.json"))
        assert os.path.exists(os.path.join(run_dir, "eval", "report.md"))
        with open(os.path.join(run_dir, "status.json")) as f:
            assert json.load(f)["state"] == "succeeded"
        # nothing of the run is left on the cluster
        live = [
            row["name"]
            for row in ray.util.placement_group_table().values()
            if row["state"] != "REMOVED"
        ]
        assert live == []
        assert [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)] == []
    finally:
        ray.shutdown()
        cluster.shutdown()
