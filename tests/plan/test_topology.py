"""The topology planner: which job runs where, how it listens and how its clients find it —
fixed ports on one machine (`rlax run`), published addresses on slices (the DAG)."""

from __future__ import annotations

import argparse

import pytest

from rlax_tasks.config import load_config
from rlax_tasks.plan.topology import Ports, WorkerSlices, plan_topology
from rlax_tasks.rollout.cli import add_worker_parser

TOKEN = "t" * 32


def _cfg(tmp_path, **extra):
    return load_config(
        "tiny-arith",
        {"run_root": str(tmp_path / "runs"), "run_id": "r1", "model.path": "m",
         "placement.mode": "disaggregated", "workers.count": 2, **extra},
    )


def _flags(argv: list[str]) -> dict[str, str]:
    return {a: b for a, b in zip(argv, argv[1:], strict=False) if a.startswith("--")}


def test_one_machine_listens_on_the_ports_it_was_given(tmp_path):
    cfg = _cfg(tmp_path, **{"trainer.hosts": 2, "placement.trainer": [0, 1]})
    ports = Ports(ps=9001, trainer=9002, workers=(9003, 9004), coordinator=9005)
    topo = plan_topology(cfg, 5, "c.yaml", ports, [], TOKEN)
    ps, trainer = topo.job("ps"), topo.job("trainer")
    assert _flags(ps.argv)["--host"] == "127.0.0.1" and _flags(ps.argv)["--port"] == "9001"
    assert _flags(trainer.argv)["--ps-url"] == "http://127.0.0.1:9001"
    assert _flags(topo.job("controller").argv)["--trainer-url"] == "http://127.0.0.1:9002"
    assert topo.workers == {
        "worker-0": "http://127.0.0.1:9003",
        "worker-1": "http://127.0.0.1:9004",
    }
    names = [(name, env.get("RLAX_PROCESS_ID")) for name, _, env in topo.processes()]
    assert ("trainer", "0") in names and ("trainer-host1", "1") in names
    assert all("--publish" not in job.argv for job in topo.jobs)


def test_on_slices_services_publish_and_clients_read_the_service_files(tmp_path):
    cfg = _cfg(tmp_path, **{"trainer.hosts": 2, "placement.trainer": [0, 1]})
    topo = plan_topology(cfg, 5, "c.yaml", None, [], TOKEN)
    services = f"{cfg.run_dir}/services"
    for name in ("ps", "trainer", "worker-0", "worker-1"):
        flags = _flags(topo.job(name).argv)
        assert flags["--port"] == "0" and flags["--publish"] == f"{services}/{name}.json"
        assert "--host" not in flags  # the host's own address (RLAX_HOST_ADDRESS)
    for name in ("trainer", "worker-0", "worker-1"):
        assert _flags(topo.job(name).argv)["--ps-url"] == f"{services}/ps.json"
    assert _flags(topo.job("controller").argv)["--trainer-url"] == f"{services}/trainer.json"
    assert topo.workers["worker-1"] == f"{services}/worker-1.json"
    assert topo.job("trainer").hosts == (0, 1)  # one group; the node agent sets its variables
    with pytest.raises(ValueError, match="slices run jobs whole"):
        topo.processes()


def test_workers_on_slices_of_their_own_one_per_host(tmp_path):
    cfg = _cfg(tmp_path, **{"workers.count": 4})
    topo = plan_topology(cfg, 5, "c.yaml", None, [], TOKEN, worker_slices=WorkerSlices(2, 2))
    where = {j.name: (j.slice, j.hosts) for j in topo.jobs}
    assert where == {
        "ps": ("trainer", (0,)),
        "trainer": ("trainer", (0,)),
        "worker-0": ("workers-0", (0,)),
        "worker-1": ("workers-0", (1,)),
        "worker-2": ("workers-1", (0,)),
        "worker-3": ("workers-1", (1,)),
        "controller": ("trainer", (0,)),
    }
    with pytest.raises(ValueError, match="workers.count is 4 but 3 worker slices of 2 hosts"):
        plan_topology(cfg, 5, "c.yaml", None, [], TOKEN, worker_slices=WorkerSlices(3, 2))


def test_workers_pull_deltas_and_continue_sequences_unless_the_config_says_no(tmp_path):
    parser = argparse.ArgumentParser()
    add_worker_parser(parser.add_subparsers())
    for field in ("delta_pulls", "interrupt_on_reload", "decode_layer_copies"):
        for value in (True, False):
            cfg = _cfg(tmp_path, **{f"workers.{field}": value})
            argv = plan_topology(cfg, 5, "c.yaml", None, [], TOKEN).job("worker-0").argv
            assert getattr(parser.parse_args(argv), field) is value
        with pytest.raises(ValueError, match=field):
            _cfg(tmp_path, **{f"workers.{field}": "no"})
