"""A trainer over two simulated hosts (two CPU processes joined by jax.distributed, gloo) trains
to the same weights as one process over the same number of devices, checkpoints and restores; its
batches are packed (``trainer.pack_sequences``), every host packing the same rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from rlax_tasks.process.ports import free_port
from tests.conftest import TEST_XLA_FLAGS

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "multihost_trainer.py")

pytestmark = pytest.mark.slow


def _env(devices: int, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLAX_")}
    env.update(
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} {TEST_XLA_FLAGS}",
        **extra,
    )
    return env


def _run_group(run_dir: str, out: str, hosts: int, devices_per_host: int) -> None:
    if hosts == 1:
        procs = [subprocess.Popen([sys.executable, SCRIPT, run_dir, out], env=_env(8))]
    else:
        address = f"127.0.0.1:{free_port()}"
        procs = [
            subprocess.Popen(
                [sys.executable, SCRIPT, run_dir, out],
                env=_env(
                    devices_per_host,
                    RLAX_COORDINATOR_ADDRESS=address,
                    RLAX_NUM_PROCESSES=str(hosts),
                    RLAX_PROCESS_ID=str(i),
                ),
            )
            for i in range(hosts)
        ]
    codes = [p.wait(timeout=300) for p in procs]
    assert codes == [0] * len(procs), codes


def test_two_hosts_train_checkpoint_and_restore_like_one(tmp_path):
    _run_group(str(tmp_path / "one"), str(tmp_path / "one.npz"), hosts=1, devices_per_host=8)
    _run_group(str(tmp_path / "two"), str(tmp_path / "two.npz"), hosts=2, devices_per_host=4)
    one, two = np.load(tmp_path / "one.npz"), np.load(tmp_path / "two.npz")
    assert sorted(one.files) == sorted(two.files) and one.files
    for name in one.files:
        np.testing.assert_allclose(two[name], one[name], rtol=0, atol=1e-6, err_msg=name)
    # the same checkpoint steps on disk, written once by the group (not once per host)
    assert sorted(os.listdir(tmp_path / "two" / "checkpoints")) == sorted(
        os.listdir(tmp_path / "one" / "checkpoints")
    )
    # one metrics row per step, written by host 0 only
    rows = (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()
    single = (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == len(single) == 3
    # every step ran on packed rows (32 padded rows of 32 -> 24), the same on both layouts
    packed = [json.loads(r)["train_rows"] for r in rows]
    assert packed == [json.loads(r)["train_rows"] for r in single] == [24, 24, 24]
