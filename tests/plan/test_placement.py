"""Devices per job (docs/design.md §12): the `placement` section, each job's environment per
platform, and both launchers (`rlax run`, the DAG's plan) handing every job its own."""

from __future__ import annotations

import pytest
import yaml

from rlax_tasks.config import ConfigError, RunConfig, load_config
from rlax_tasks.plan.placement import describe, job_env, job_envs
from rlax_tasks.utils.byte_sizes import parse_bytes

ACCELERATOR_VARS = ("CUDA_VISIBLE_DEVICES", "TPU_VISIBLE_CHIPS", "XLA_PYTHON_CLIENT_MEM_FRACTION")


# the tiny preset runs colocated (one job); these tests place the separate jobs
DISAGGREGATED = {"placement.mode": "disaggregated", "workers.count": 2}


def tiny(overrides: dict | None = None) -> RunConfig:
    """The tiny preset as separate jobs, with ``overrides``."""
    return load_config("tiny-arith", {**DISAGGREGATED, **(overrides or {})})


def config(placement: dict, **overrides) -> RunConfig:
    return tiny({"placement": placement, **overrides})


def gpu(trainer, workers, **extra) -> RunConfig:
    placement = {"platform": "gpu", "trainer": trainer, "workers": workers, **extra}
    return config(placement, **{"workers.count": len(workers)})


def test_gpu_jobs_get_their_own_gpus_and_no_platform():
    cfg = gpu([0, 1, 2, 3], [[4], [5], [6], [7]])
    envs = job_envs(cfg, environ={})
    assert list(envs) == ["ps", "trainer", "worker-0", "worker-1", "worker-2", "worker-3",
                          "controller"]  # fmt: skip
    assert envs["trainer"] == {
        "CUDA_VISIBLE_DEVICES": "0,1,2,3",
        "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9",
        "RLAX_EXPECTED_DEVICES": "gpu 4",  # what the job checks at start
    }
    assert envs["worker-2"] == {
        "CUDA_VISIBLE_DEVICES": "6",
        "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9",
        "RLAX_EXPECTED_DEVICES": "gpu 1",
    }
    for job in ("ps", "controller", "verifier"):  # never hold an accelerator
        assert job_env(cfg, job) == {"JAX_PLATFORMS": "cpu"}


def test_processes_sharing_a_gpu_split_its_memory():
    cfg = gpu([0, 1], [[1], [2]])  # the trainer and worker-0 share GPU 1
    envs = job_envs(cfg, environ={})
    assert envs["trainer"]["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.45"
    assert envs["worker-0"]["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.45"
    assert envs["worker-1"]["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.9"
    fixed = gpu([0, 1], [[1], [2]], memory_fraction=0.3)
    assert {e["XLA_PYTHON_CLIENT_MEM_FRACTION"] for j, e in job_envs(fixed).items()
            if j.startswith(("trainer", "worker"))} == {"0.3"}  # fmt: skip
    with pytest.raises(ConfigError, match=r"^placement.memory_fraction: 2 processes share GPU 1"):
        gpu([0, 1], [[1], [2]], memory_fraction=0.6)


def test_tpu_jobs_get_their_own_chips_as_single_process_slices():
    cfg = config(
        {"platform": "tpu", "accelerator": "v5e", "trainer": [0, 1, 2, 3],
         "workers": [[4, 5], [6], [7]]},
        **{"workers.count": 3},
    )  # fmt: skip
    envs = job_envs(cfg, environ={})
    assert envs["trainer"]["TPU_VISIBLE_CHIPS"] == "0,1,2,3"
    assert envs["trainer"]["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "2,2,1"
    assert envs["worker-0"]["TPU_VISIBLE_CHIPS"] == "4,5"
    assert envs["worker-0"]["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "1,2,1"
    assert envs["worker-2"]["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "1,1,1"
    accel = [envs[j] for j in ("trainer", "worker-0", "worker-1", "worker-2")]
    for env in accel:
        assert env["TPU_PROCESS_BOUNDS"] == "1,1,1" and env["CLOUD_TPU_TASK_ID"] == "0"
        assert env["TPU_PROCESS_ADDRESSES"] == f"localhost:{env['TPU_PROCESS_PORT']}"
        assert "JAX_PLATFORMS" not in env and "CUDA_VISIBLE_DEVICES" not in env
    assert len({env["TPU_PROCESS_PORT"] for env in accel}) == 4  # one libtpu port each
    assert envs["ps"] == envs["controller"] == {"JAX_PLATFORMS": "cpu"}


def test_a_trainer_over_tpu_hosts_is_one_slice_over_every_chip_of_them():
    """libtpu reads a multi-host slice's shape from the TPU VM: the trainer's hosts get none of
    the one-host sub-slice variables (each its own slice of 1,1,1 would be H slices), and the
    workers, on slices of their own, take every chip of their host."""
    two = load_config("qwen2.5-math-1.5b-grpo-tpu-2host")
    envs = job_envs(two, environ={})
    for job in ("trainer", "worker-0", "worker-1"):
        assert not [k for k in envs[job] if k.startswith(("TPU_", "CLOUD_TPU_"))], envs[job]
    assert envs["trainer"]["RLAX_EXPECTED_DEVICES"] == "tpu 4"  # checked on each host
    assert envs["worker-0"]["RLAX_EXPECTED_DEVICES"] == "tpu any"
    one = job_envs(load_config("qwen2.5-math-1.5b-grpo-tpu"), environ={})
    assert one["trainer"]["TPU_PROCESS_BOUNDS"] == "1,1,1"  # one host split between processes


def test_the_held_out_evaluation_on_devices_of_its_own():
    """placement.evaluator: the held-out job's own GPUs (the ones it shares split their memory)
    or TPU chips (a slice of its own, its own libtpu port), a row of the placement table, and
    `rlax run` evaluates during training on them; without it, on a GPU, before and after only."""
    from rlax_tasks.run.heldout import HeldOutJobs

    placement = {"platform": "gpu", "trainer": [0, 1, 2, 3], "workers": [[4], [5], [6]]}
    every = {"workers.count": 3, "eval.every_steps": 5}
    cfg = config({**placement, "evaluator": [6, 7]}, **every)
    assert job_env(cfg, "heldout", environ={}) == {
        "CUDA_VISIBLE_DEVICES": "6,7",
        "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.45",  # GPU 6 is worker-2's too
        "RLAX_EXPECTED_DEVICES": "gpu 2",
    }
    assert job_env(cfg, "worker-2", environ={})["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.45"
    assert "  heldout     gpu 6,7" in describe(cfg, environ={})
    own = HeldOutJobs(cfg, "config.yaml", 10)
    assert (own.every, own.env["CUDA_VISIBLE_DEVICES"]) == (5, "6,7")
    shared = HeldOutJobs(config(placement, **every), "config.yaml", 10)
    assert (shared.every, shared.env["CUDA_VISIBLE_DEVICES"]) == (0, "0,1,2,3")

    tpu = config(
        {"platform": "tpu", "trainer": [0, 1, 2, 3], "workers": [[4, 5]], "evaluator": [6, 7]},
        **{"workers.count": 1},
    )  # fmt: skip
    envs = {job: job_env(tpu, job, environ={}) for job in ("trainer", "worker-0", "heldout")}
    assert envs["heldout"]["TPU_VISIBLE_CHIPS"] == "6,7"
    assert len({env["TPU_PROCESS_PORT"] for env in envs.values()}) == 3
    with pytest.raises(ConfigError, match=r"^placement.evaluator: TPU chip 5 is also placement"):
        config({"platform": "tpu", "trainer": [0, 1, 2, 3], "workers": [[4, 5]],
                "evaluator": [5]}, **{"workers.count": 1})  # fmt: skip
    with pytest.raises(ConfigError, match=r"^placement.evaluator: under a trainer over 2 TPU"):
        load_config("qwen2.5-math-1.5b-grpo-tpu-2host", {"placement.evaluator": [4]})
    with pytest.raises(ConfigError, match=r"^placement.evaluator: device lists need platform"):
        config({"platform": "auto", "evaluator": [0]})
    with pytest.raises(ConfigError, match=r"^workers.mesh_shape: .* over placement.evaluator's"):
        config({"platform": "gpu", "trainer": [0], "workers": [[1, 2]], "evaluator": [3]},
               **{"workers.count": 1, "workers.mesh_shape": [1, 1, 2]})  # fmt: skip


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"placement.trainer": [0, 1]},
         r"^placement.trainer: is \[0, 1\], but a trainer over 2 TPU hosts is one libtpu slice"),
        ({"placement.workers": [[0, 1, 2, 3]]},
         r"^placement.workers\[0\]: TPU chip 0 is also the trainer's"),
        ({"placement.workers": [[0]], "placement.trainer": [0, 1, 2, 3]},
         r"^placement.workers\[0\]: TPU chip 0 is also the trainer's"),
    ],
)  # fmt: skip
def test_a_trainer_over_tpu_hosts_cannot_share_them(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("qwen2.5-math-1.5b-grpo-tpu-2host", overrides)


def test_cpu_forces_cpu_and_auto_forces_nothing():
    tiny = load_config("tiny-arith")  # the embedded default behaves as before
    assert tiny.placement.platform == "cpu"
    fast_compile = "--xla_cpu_use_fusion_emitters=false"
    assert job_envs(tiny, environ={}) == {
        "colocated": {
            "JAX_PLATFORMS": "cpu",
            "RLAX_EXPECTED_DEVICES": "cpu any",
            "XLA_FLAGS": fast_compile,
        }
    }
    devices = config({"platform": "cpu", "trainer": [0, 1]})
    inherited = {"XLA_FLAGS": "--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=8"}
    env = job_env(devices, "trainer", environ=inherited)
    assert env["XLA_FLAGS"] == (
        f"--xla_dump_to=/tmp/x {fast_compile} --xla_force_host_platform_device_count=2"
    )
    # a flag the user set wins; a device count stays when the placement names no devices
    mine = {
        "XLA_FLAGS": "--xla_cpu_use_fusion_emitters=true --xla_force_host_platform_device_count=4"
    }
    assert job_env(tiny, "colocated", environ=mine)["XLA_FLAGS"] == mine["XLA_FLAGS"]
    auto = config({"platform": "auto"})
    envs = job_envs(auto, environ={})
    assert envs["trainer"] == envs["worker-1"] == {}  # and nothing to check against
    assert envs["ps"] == {"JAX_PLATFORMS": "cpu"}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"placement.mode": "disagregated"}, "placement.mode: must be one of"),
        ({"placement.platform": "gpus"}, "placement.platform: must be one of"),
        ({"placement.platform": "gpu"}, "placement.trainer: give the trainer's device indices"),
        (
            {"placement": {"platform": "gpu", "trainer": [0]}},
            "placement.workers: give each worker's device indices",
        ),
        (
            {"placement": {"platform": "gpu", "trainer": [0, 1, 1], "workers": [[2], [3]]}},
            "placement.trainer: device 1 is listed twice",
        ),
        (
            {"placement": {"platform": "gpu", "trainer": [0], "workers": [[1], [-2]]}},
            "placement.workers[1]: device indices are integers >= 0",
        ),
        (
            {"placement": {"platform": "gpu", "trainer": [0], "workers": [[1]]}},
            "placement.workers: lists 1 worker(s) but workers.count is 2",
        ),
        (
            {"placement": {"platform": "tpu", "trainer": [0, 1], "workers": [[1], [3]]}},
            "placement.workers[0]: TPU chip 1 is also the trainer's: TPU chips cannot be shared",
        ),
        (
            {"placement": {"platform": "tpu", "trainer": [0, 1, 2], "workers": [[4], [5]]}},
            "placement.trainer: a TPU process takes 1, 2, 4 or 8 chips",
        ),
        (
            {"placement": {"platform": "tpu", "trainer": [1, 2], "workers": [[4], [5]]}},
            "placement.trainer: a TPU process takes",
        ),
        (
            {"placement": {"platform": "tpu", "hosts": 2, "trainer": [0], "workers": [[1]]}},
            "placement.hosts: a multi-host TPU slice cannot be split",
        ),
        (
            {"placement": {"platform": "auto", "trainer": [0]}},
            "placement.trainer: device lists need platform gpu, tpu or cpu",
        ),
        ({"placement.accelerator": "h100-80gb"}, "placement.accelerator: 'h100-80gb' is a gpu"),
        ({"placement.accelerator": "h300"}, "placement.accelerator: must be one of"),
        ({"placement.memory_fraction": 0.5}, "placement.memory_fraction: applies to platform gpu"),
        ({"placement.host_memory": "lots"}, "placement.host_memory: must be a size"),
        ({"placement.hosts": 0}, "placement.hosts: must be >= 1"),
        ({"placement.gpus": [0]}, "placement.gpus: unknown key"),
        (
            {"placement": {"platform": "cpu", "trainer": [0, 1, 2, 3]},
             "trainer.mesh_shape": [1, 2, 1]},
            "trainer.mesh_shape: mesh [1, 2, 1] uses 2 device(s), the job has 4",
        ),
        (
            {"placement": {"platform": "gpu", "trainer": [0, 1, 2], "workers": [[3], [4]]},
             "trainer.mesh_shape": [1, -1, 2]},
            "trainer.mesh_shape: 3 device(s) do not split into mesh [1, -1, 2]",
        ),
        (
            {"placement": {"platform": "gpu", "trainer": [0], "workers": [[1, 2], [3]]},
             "workers.mesh_shape": [1, 1, 2]},
            "workers.mesh_shape: mesh [1, 1, 2] uses 2 device(s), the job has 1: worker list "
            "placement.workers[1]",
        ),
    ],
)  # fmt: skip
def test_placement_errors_name_the_field(overrides, message):
    with pytest.raises(ConfigError) as info:
        tiny(overrides)
    assert str(info.value).startswith(message), str(info.value)


def unnamed(placement: dict, **overrides) -> RunConfig:
    """The tiny preset with ``placement``, naming neither the mode nor workers.count."""
    raw = {"placement": {"mode": None, **placement}, "workers.count": None, **overrides}
    return load_config("tiny-arith", raw)


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_a_single_accelerator_host_runs_colocated_unless_told_otherwise(platform):
    cfg = unnamed({"platform": platform, "trainer": [0]})
    assert (cfg.placement.mode, cfg.workers.count) == ("colocated", 1)
    assert list(job_envs(cfg, environ={})) == ["colocated"]
    saved = yaml.safe_load(cfg.to_yaml())  # config.yaml names what was chosen
    assert (saved["placement"]["mode"], saved["workers"]["count"]) == ("colocated", 1)
    assert RunConfig.from_dict(saved) == cfg


@pytest.mark.parametrize(
    "placement, overrides, count",
    [
        ({"platform": "gpu", "trainer": [0], "workers": [[0]]}, {}, 1),  # sharing: as asked
        ({"platform": "gpu", "trainer": [0, 1], "workers": [[2], [3]]}, {}, 2),
        ({"platform": "gpu", "hosts": 2, "trainer": [0], "workers": [[1]]}, {}, 2),
        ({"platform": "tpu", "trainer": [0], "workers": [[1], [2]]}, {}, 2),
        ({"platform": "cpu"}, {}, 2),  # a CPU host has no accelerator to share
        ({"platform": "auto"}, {}, 2),
        ({"platform": "cpu", "trainer": [0]}, {"workers.count": 3}, 3),
    ],
)  # fmt: skip
def test_other_placements_default_to_separate_jobs(placement, overrides, count):
    cfg = unnamed(placement, **overrides)
    assert (cfg.placement.mode, cfg.workers.count) == ("disaggregated", count)


@pytest.mark.parametrize(
    "placement, overrides, way_out",
    [
        # two GPUs: which are the workers'?
        ({"platform": "gpu", "trainer": [0, 1]}, {}, "(or mode: colocated: one process"),
        # two workers asked for: colocated has one
        ({"platform": "gpu", "trainer": [0]}, {"workers.count": 2},
         "(or workers.count: 1 and mode: colocated"),
        # the same, named disaggregated on purpose
        ({"platform": "tpu", "trainer": [0], "mode": "disaggregated"}, {},
         "(or mode: colocated: one process"),
        # a trainer on two hosts: colocated is one host, so not offered
        ({"platform": "gpu", "trainer": [0]}, {"trainer.hosts": 2},
         "(a trainer on several hosts runs disaggregated)"),
        ({"platform": "gpu", "hosts": 2, "trainer": [0]}, {},
         "(a trainer on several hosts runs disaggregated)"),
    ],
)  # fmt: skip
def test_a_placement_without_worker_devices_says_how_to_fix_it(placement, overrides, way_out):
    with pytest.raises(ConfigError) as info:
        unnamed(placement, **overrides)
    message = str(info.value)
    assert message.startswith("placement.workers: give each worker's device indices"), message
    assert way_out in message, message
    if "several hosts" in way_out:  # never offered where it would be refused
        assert "colocated" not in message


def test_shorthand_multi_host_and_round_trip():
    cfg = tiny({"placement": "disaggregated"})
    assert cfg.placement.mode == "disaggregated" and cfg.placement.platform == "auto"
    cfg = tiny(
        {"placement": {"platform": "gpu", "hosts": 2, "trainer": [0, 1], "workers": [[2], [3]],
                       "host_memory": "1.5TiB"},
         "workers.count": 4},
    )  # fmt: skip
    assert cfg.placement.host_memory == parse_bytes("1536GiB") == 1536 * 2**30
    assert cfg.placement.workers == ((2,), (3,))
    assert RunConfig.from_dict(yaml.safe_load(cfg.to_yaml())) == cfg
    # worker-i is list i mod 2 on host i // 2; the trainer spans both hosts (mesh over 4 GPUs)
    assert job_env(cfg, "worker-3")["CUDA_VISIBLE_DEVICES"] == "3"
    table = describe(cfg, environ={})
    assert "gpu 0,1 × 2 hosts" in table and "1,4,1" in table and "gpu 3 of host 1" in table


def test_parse_bytes():
    assert parse_bytes(123) == 123
    assert parse_bytes("64GiB") == 64 * 2**30
    assert parse_bytes("500GB") == 500 * 10**9
    assert parse_bytes("1.5 TiB") == int(1.5 * 2**40)
    with pytest.raises(ValueError, match="size in bytes"):
        parse_bytes("64 gigs")


# --------------------------------------------------------------------------- both launchers
class RecordingSupervisor:
    """Stands in for rlax_tasks.run.supervisor.Supervisor: records the components, starts
    nothing, and reports every one done at once (the controller, or a colocated run's job)."""

    made: list[RecordingSupervisor] = []

    def __init__(self, log_dir: str) -> None:
        self.components: dict = {}
        RecordingSupervisor.made.append(self)

    def add(self, component):
        self.components[component.name] = component
        return component

    def poll(self) -> dict:
        return dict.fromkeys(self.components, 0)

    def stop(self) -> None:
        pass


def _small(tmp_path, **overrides) -> RunConfig:
    from tests.tiny_model import save_char_model

    save_char_model(str(tmp_path / "model"))
    return load_config(
        "tiny-arith",
        {"run_root": str(tmp_path / "runs"), "model.path": str(tmp_path / "model"),
         "model.warmup_if_missing": False, **DISAGGREGATED, **overrides},
    )  # fmt: skip


def test_rlax_run_starts_each_job_with_its_own_devices(tmp_path, monkeypatch):
    from rlax_tasks.run import local_run

    RecordingSupervisor.made.clear()
    monkeypatch.setattr(local_run, "Supervisor", RecordingSupervisor)
    # compilation_cache off: run_local would point this test process's JAX at the run's cache
    placement = {"platform": "gpu", "trainer": [0, 1], "workers": [[2], [3]]}
    cfg = _small(
        tmp_path,
        **{"placement": placement, "workers.mesh_shape": [-1, 1, 1], "compilation_cache": False},
    )
    local_run.run_local(cfg, 1, evaluate=False, status_every_s=1e9)
    comps = RecordingSupervisor.made[0].components
    assert set(comps) == {"ps", "trainer", "worker-0", "worker-1", "controller"}
    gpus = {name: c.env.get("CUDA_VISIBLE_DEVICES") for name, c in comps.items()}
    assert gpus == {"ps": None, "trainer": "0,1", "worker-0": "2", "worker-1": "3",
                    "controller": None}  # fmt: skip
    for name, c in comps.items():
        assert c.env["RLAX_PS_TOKEN"] == comps["ps"].env["RLAX_PS_TOKEN"]
        assert ("JAX_PLATFORMS" in c.env) == (name in ("ps", "controller"))
    for wid in ("worker-0", "worker-1"):
        argv = comps[wid].argv
        assert "--mesh-shape=-1,1,1" in argv  # one token: argparse would take -1 for an option
        assert argv[argv.index("--dtype") + 1] == cfg.model.dtype
    ps = comps["ps"].argv
    k = cfg.staleness.max_staleness
    assert ps[ps.index("--keep-versions") + 1] == str(k + 2)  # k + 2: a tiny model fits many
    assert int(ps[ps.index("--keep-bytes") + 1]) > 0


def test_rlax_run_on_one_gpu_starts_one_colocated_job_by_default(tmp_path, monkeypatch):
    from rlax_tasks.run import local_run
    from tests.tiny_model import save_char_model

    RecordingSupervisor.made.clear()
    monkeypatch.setattr(local_run, "Supervisor", RecordingSupervisor)
    save_char_model(str(tmp_path / "model"))
    cfg = unnamed(
        {"platform": "gpu", "trainer": [0]},
        **{"run_root": str(tmp_path / "runs"), "model.path": str(tmp_path / "model"),
           "model.warmup_if_missing": False, "compilation_cache": False},
    )  # fmt: skip
    local_run.run_local(cfg, 1, evaluate=False, status_every_s=1e9)
    comps = RecordingSupervisor.made[0].components
    assert list(comps) == ["colocated"]
    assert comps["colocated"].env["CUDA_VISIBLE_DEVICES"] == "0"
    assert "colocated" in comps["colocated"].argv
    saved = yaml.safe_load((tmp_path / "runs" / cfg.run_id / "config.yaml").read_text())
    assert (saved["placement"]["mode"], saved["workers"]["count"]) == ("colocated", 1)


def test_rlax_run_refuses_a_placement_across_hosts(tmp_path, monkeypatch):
    from rlax_tasks.run import local_run

    monkeypatch.setattr(local_run, "Supervisor", RecordingSupervisor)  # never start a process
    placement = {"platform": "gpu", "hosts": 2, "trainer": [0], "workers": [[1]]}
    cfg = _small(tmp_path, **{"placement": placement, "compilation_cache": False})
    with pytest.raises(ValueError, match="placement.hosts: rlax run starts every job"):
        local_run.run_local(cfg, 1, evaluate=False)
    assert not (tmp_path / "runs" / "tiny-arith").exists()  # nothing started, nothing written


def test_dag_plan_gives_each_job_its_own_devices(tmp_path):
    from rlax_tasks.airflow.plan_task import plan_training

    _small(tmp_path)
    params = {"preset": "tiny-arith", "run_root": str(tmp_path / "runs"), "steps": 2,
              "model_path": str(tmp_path / "model"),
              "num_workers": 2,
              "overrides": {"placement": {"mode": "disaggregated", "platform": "gpu",
                                          "trainer": [0, 1], "workers": [[1], [2]]}}}  # fmt: skip
    p = plan_training(params, "manual__gpu")
    assert [j.name for j in p.jobs()] == ["ps", "trainer", "worker-0", "worker-1", "controller"]
    assert p.trainer.env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert p.trainer.env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.45"  # GPU 1 is shared
    assert p.ps.env["JAX_PLATFORMS"] == p.controller.env["JAX_PLATFORMS"] == "cpu"
    assert "JAX_PLATFORMS" not in p.trainer.env
    token = p.ps.env["RLAX_PS_TOKEN"]
    assert all(job.env["RLAX_PS_TOKEN"] == token for job in p.jobs())
    assert [w.env["CUDA_VISIBLE_DEVICES"] for w in p.workers] == ["1", "2"]
    assert all("--mesh-shape=1,1,-1" in w.argv for w in p.workers)
    assert "--keep-bytes" in p.ps.argv and "--keep-versions" in p.ps.argv
    # the embedded default: one colocated job, watched by the controller task
    tiny = plan_training({**params, "num_workers": None, "overrides": {}}, "manual__cpu")
    assert tiny.controller.argv[0] == "colocated" and tiny.colocated
    assert tiny.ps.argv == tiny.trainer.argv == [] and tiny.workers == ()
    assert tiny.controller.env["JAX_PLATFORMS"] == "cpu"
    assert tiny.eval_env["JAX_PLATFORMS"] == "cpu"  # the final `rlax eval`
