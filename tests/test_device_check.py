"""A JAX job checks the devices it got against its placement: a job placed on GPUs or TPUs that
found the CPU exits 2 with one line (what it found, what the placement says, what to do)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from rlax_tasks.config import load_config
from rlax_tasks.plan.placement import describe, job_env
from rlax_tasks.process.device_check import EXPECTED_ENV, DeviceMismatch, check_devices
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
    """scripts/device_check.sh on this CPU host (the device run's own entry point): every part of
    the CPU form passes, and at most 4 files come back: the summary, the figures, one archive."""
    import json
    import tarfile
    import xml.etree.ElementTree as ET

    out = subprocess.run(
        ["bash", os.path.join(REPO, "scripts", "device_check.sh"), str(tmp_path / "out")],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "[device_run] every part passed" in out.stdout, out.stdout
    assert sorted(os.listdir(tmp_path / "out")) == ["figures.json", "logs.tar.gz", "summary.json"]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["platform"] == "cpu" and summary["complete"]
    assert summary["versions"].startswith("python 3.") and "jax 0." in summary["versions"]
    assert any(s.startswith("tiny-arith end to end on one GPU") for s in summary["skipped"])
    assert [(p["name"], p["status"]) for p in summary["parts"]] == [
        ("decode", "passed"), ("train", "passed"), ("profile", "passed"),
        ("accelerator-tests", "passed"), ("doctor", "passed"),
    ]  # fmt: skip
    figures = summary["figures"]
    assert [r["slots"] for r in figures["decode"]] == [8, 4]
    assert all(r["tokens_per_s"] > 0 and r["fraction_of_roofline"] is None
               for r in figures["decode"])  # fmt: skip
    assert figures["train"]["tokens_per_s"] > 0 and figures["train"]["mfu"] is None
    # the sweep: each setting in turn within its budget (its choice: tests/test_benchmarks.py)
    measured = figures["train"]["measured"]
    assert measured and measured[0]["remat"] == "full", measured
    assert figures["train"]["settings"][0].startswith("trainer.remat=")
    for program in ("decode", "train"):  # the profile's table: time, bytes and rates per op
        table = figures["profile"][program]
        assert table["matched_hlo"] and table["total_us"] > 0, table
        assert any(r.get("gb_per_s") for r in table["top"]), table
    tests = figures["accelerator-tests"]  # its junit report's counts
    assert tests["tests"] == tests["skipped"] >= 3 and tests["failed"] == []
    with tarfile.open(tmp_path / "out" / "logs.tar.gz") as tar:
        names = tar.getnames()
        assert "decode step  ok" in tar.extractfile("doctor.log").read().decode()
        suite = ET.parse(tar.extractfile("accelerator-tests.xml")).getroot().find("testsuite")
    assert int(suite.get("tests")) == int(suite.get("skipped")) >= 3  # none can run on the CPU
    assert any(n.endswith(".trace.json.gz") for n in names), names
