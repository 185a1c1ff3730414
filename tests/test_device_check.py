"""A JAX job checks the devices it got against its placement: a job placed on GPUs or TPUs that
found the CPU exits 2 with one line (what it found, what the placement says, what to do)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from rlax_tasks.config import load_config
from rlax_tasks.process.device_check import EXPECTED_ENV, DeviceMismatch, check_devices
from rlax_tasks.run.placement import describe, job_env
from tests.conftest import REPO


def test_a_platform_or_count_other_than_the_placements_is_refused_with_what_to_do():
    check_devices("trainer", "gpu 4", "gpu", 4)
    check_devices("worker-0", "tpu any", "tpu", 8)
    with pytest.raises(DeviceMismatch) as e:
        check_devices("trainer", "gpu 4", "cpu", 1)
    assert str(e.value) == (
        "trainer: placement.platform is gpu but JAX found cpu with 1 device: install the CUDA "
        "plugin (bash scripts/setup.sh --gpu) on a host with NVIDIA GPUs, or set "
        "placement.platform: cpu"
    )
    with pytest.raises(DeviceMismatch, match=r"^worker-1: placement.platform is tpu .* libtpu"):
        check_devices("worker-1", "tpu 4", "cpu", 8)
    with pytest.raises(DeviceMismatch, match=r"gives it 4 gpu device\(s\) .* found gpu with 2"):
        check_devices("trainer", "gpu 4", "gpu", 2)
    assert issubclass(DeviceMismatch, ValueError)  # the CLI's one-line error, exit 2


def test_each_jax_job_is_told_what_its_placement_names():
    gpu = load_config("tiny-arith", {
        "placement": {"mode": "disaggregated", "platform": "gpu", "trainer": [0, 1],
                      "workers": [[2]]},
    })  # fmt: skip
    assert job_env(gpu, "trainer")[EXPECTED_ENV] == "gpu 2"
    assert job_env(gpu, "worker-0")[EXPECTED_ENV] == "gpu 1"
    assert EXPECTED_ENV not in job_env(gpu, "ps") and EXPECTED_ENV not in job_env(gpu, "controller")
    assert EXPECTED_ENV not in describe(gpu)  # the dry run's table shows device variables only
    tiny = load_config("tiny-arith")  # colocated, cpu, the host's devices
    assert job_env(tiny, "colocated")[EXPECTED_ENV] == "cpu any"
    auto = load_config("tiny-arith", {"placement.platform": "auto"})
    assert EXPECTED_ENV not in job_env(auto, "colocated")


@pytest.mark.parametrize("job", ["trainer", "worker-0", "colocated"])
def test_a_job_placed_on_gpus_exits_2_with_one_line_on_this_cpu(job, tmp_path):
    placement = {"platform": "gpu", "trainer": [0, 1]}
    if job != "colocated":
        placement.update(mode="disaggregated", workers=[[2]])
    cfg = load_config("tiny-arith", {"placement": placement, "run_root": str(tmp_path)})
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(cfg.to_dict()))
    argv = {
        "trainer": ["trainer", "--config", str(config)],
        "worker-0": ["worker", "--model-dir", str(tmp_path / "none"), "--worker-id", job],
        "colocated": ["colocated", "--config", str(config), "--steps", "1"],
    }[job]
    env = {**os.environ, "PYTHONPATH": REPO, "RLAX_PS_TOKEN": "t", **job_env(cfg, job)}
    out = subprocess.run(
        [sys.executable, "-m", "rlax_tasks.cli", *argv],
        env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    command = argv[0]
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.count("\n") == 1, out.stderr[-3000:]
    assert out.stderr.startswith(
        f"rlax {command}: error: {job}: placement.platform is gpu but JAX found cpu with "
    ), out.stderr
    assert "bash scripts/setup.sh --gpu" in out.stderr


@pytest.mark.slow
def test_device_check_script_runs_its_cpu_form_and_says_what_it_skipped(tmp_path):
    """scripts/device_check.sh on this CPU host: doctor, the accelerator tests (skipping
    themselves) and the small-shape benchmark, each step's exit code and the figures as JSON."""
    import json
    import xml.etree.ElementTree as ET

    out = subprocess.run(
        ["bash", os.path.join(REPO, "scripts", "device_check.sh"), str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "[device_check] skipped: Qwen2.5-1.5B shapes" in out.stdout, out.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["platform"] == "cpu"
    assert summary["versions"].startswith("python 3.") and "jax 0." in summary["versions"]
    assert any(s.startswith("tiny-arith end to end on one GPU") for s in summary["skipped"])
    assert [(s["step"], s["exit"]) for s in summary["steps"]] == [
        ("doctor", 0), ("accelerator-tests", 0), ("benchmark", 0)
    ]  # fmt: skip
    assert "decode step  ok" in (tmp_path / "doctor.log").read_text()
    suite = ET.parse(tmp_path / "accelerator-tests.xml").getroot().find("testsuite")
    assert int(suite.get("tests")) == int(suite.get("skipped")) >= 3  # none can run on the CPU
    bench = summary["accelerator"]
    assert [r["slots"] for r in bench["decode"]] == [4, 8]
    assert all(r["tokens_per_s"] > 0 and "fraction_of_roofline" not in r for r in bench["decode"])
    assert bench["train"]["tokens_per_s"] > 0 and "mfu" not in bench["train"]
