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


@pytest.mark.parametrize("relay", ["star", "chain"])
def test_replicas_relay_from_replica_0_and_share_the_workers_evenly(tmp_path, relay):
    from rlax_tasks.config.checks import ConfigError
    from rlax_tasks.plan.run_plan import TrainingPlan

    extra = {"workers.count": 5, "paramserver.replicas": 3, "paramserver.relay": relay}
    cfg = _cfg(tmp_path, **extra)
    ports = Ports(ps=9001, trainer=9002, workers=(9003, 9004, 9005, 9006, 9007), coordinator=9008,
                  ps_replicas=(9010, 9011))  # fmt: skip
    topo = plan_topology(cfg, 5, "c.yaml", ports, [], TOKEN)
    names = [j.name for j in topo.jobs]
    assert names[:4] == ["ps", "ps-1", "ps-2", "trainer"]
    url = {"ps": "http://127.0.0.1:9001", "ps-1": "http://127.0.0.1:9010",
           "ps-2": "http://127.0.0.1:9011"}  # fmt: skip
    ups = {}
    for r in ("ps-1", "ps-2"):
        argv = topo.job(r).argv
        ups[r] = [b for a, b in zip(argv, argv[1:], strict=False) if a == "--upstream"]
    assert ups["ps-1"] == [url["ps"]]
    assert ups["ps-2"] == ([url["ps"]] if relay == "star" else [url["ps-1"], url["ps"]])
    assert "--run-root" not in topo.job("ps-1").argv  # replica 0 alone mirrors
    assert topo.job("ps-1").hosts == (0,)  # one trainer host here (each on its own with more)
    assert topo.job("ps-1").env["JAX_PLATFORMS"] == "cpu"
    homes = [_flags(topo.job(f"worker-{i}").argv)["--ps-url"] for i in range(5)]
    assert homes == [url["ps"], url["ps-1"], url["ps-2"], url["ps"], url["ps-1"]]
    argv = topo.job("worker-1").argv
    failover = [b for a, b in zip(argv, argv[1:], strict=False) if a == "--ps-failover"]
    assert failover == [url["ps-2"], url["ps"]]  # the next ones, round the ring
    args = argparse.ArgumentParser()
    add_worker_parser(args.add_subparsers())
    parsed = args.parse_args(argv)
    assert parsed.ps_url == url["ps-1"] and parsed.ps_failover == failover
    assert _flags(topo.job("trainer").argv)["--ps-url"] == url["ps"]  # pushes to replica 0
    # the plan carries the replicas as jobs of their own, through the DAG's XCom too
    from rlax_tasks.plan.launch import training_plan

    plan = training_plan(cfg, 5, "c.yaml", topo)
    assert [j.name for j in plan.ps_replicas] == ["ps-1", "ps-2"]
    assert [j.name for j in plan.jobs()][:4] == ["ps", "ps-1", "ps-2", "trainer"]
    assert TrainingPlan.from_dict(plan.to_dict()) == plan
    two_hosts = _cfg(tmp_path, **extra, **{"trainer.hosts": 2, "placement.trainer": [0, 1]})
    spread = plan_topology(two_hosts, 5, "c.yaml", None, [], TOKEN)
    assert [spread.job(r).hosts for r in ("ps", "ps-1", "ps-2")] == [(0,), (1,), (0,)]
    with pytest.raises(ConfigError, match="paramserver.replicas"):
        _cfg(tmp_path, **{"paramserver.replicas": 3})  # 2 workers for 3 replicas
    with pytest.raises(ConfigError, match="paramserver.relay"):
        _cfg(tmp_path, **{"paramserver.relay": "ring"})
    with pytest.raises(ConfigError, match="paramserver.replicas"):
        load_config("tiny-arith", {"run_root": str(tmp_path), "paramserver.replicas": 2})
