"""`rlax run` with a trainer over two simulated hosts (two CPU processes × 4 forced devices joined
by jax.distributed, gloo) against one process over 8 devices: the same final weights, compared on
`rlax export` of each run's final checkpoint (which must exist); a trainer host killed (-9)
mid-run takes its group down, the group restarts from its checkpoint and the run ends with the
same weights, no step applied twice."""

from __future__ import annotations

import os

import numpy as np
import pytest
from safetensors.numpy import load_file

from rlax_tasks.cli import main
from rlax_tasks.run.local_run import run_local
from rlax_tasks.trainer.checkpointing import is_complete_checkpoint
from tests.conftest import TEST_XLA_FLAGS
from tests.run.test_local_run import read_jsonl, small_config, steps_trained

pytestmark = pytest.mark.slow

LOCKSTEP = {  # on-policy (j = k = 1): the rollouts, hence the weights, do not depend on timing
    "staleness.reload_every": 1,
    "staleness.max_staleness": 1,
    "trainer.checkpoint_every": 2,
    "trainer.learning_rate": 1e-3,
    "trainer.warmup_steps": 0,
}
STEPS = 5  # past the last periodic checkpoint (4): the final one is the trainer's clean stop


def exported(run_dir: str, out: str, capsys) -> dict[str, np.ndarray]:
    """The tensors `rlax export` writes for the run's newest checkpoint: its final step's."""
    assert is_complete_checkpoint(os.path.join(run_dir, "checkpoints", str(STEPS)))
    capsys.readouterr()
    assert main(["export", run_dir, out]) == 0
    assert capsys.readouterr().out.startswith(f"exported step {STEPS} of {run_dir}")
    tensors: dict[str, np.ndarray] = {}
    for name in sorted(os.listdir(out)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(out, name)))
    return tensors


def test_two_trainer_hosts_match_one_and_survive_a_host_kill(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XLA_FLAGS", TEST_XLA_FLAGS)  # each job's devices come from placement only
    one = small_config(tmp_path / "one", **LOCKSTEP, **{"placement.trainer": list(range(8))})
    run_local(one, steps=STEPS, evaluate=False)

    two = small_config(
        tmp_path / "two",
        **LOCKSTEP,
        **{"trainer.hosts": 2, "placement.trainer": [0, 1, 2, 3]},
    )
    killed: list[int] = []

    def kill_host_1_after_step_3(sup):
        done = steps_trained(two.run_dir)
        if not killed and done >= 3:
            sup.kill("trainer-host1")
            killed.append(done)

    report = run_local(two, steps=STEPS, evaluate=False, supervisor_hook=kill_host_1_after_step_3)
    assert killed and killed[0] < STEPS
    # the whole group restarted (host 0 too), once
    assert report["restarts"]["trainer"] == report["restarts"]["trainer-host1"] == 1
    log0 = open(os.path.join(two.run_dir, "logs", "trainer.log")).read()
    assert "process 0 of 2" in log0 and "restored step" in log0

    lineage = read_jsonl(os.path.join(two.run_dir, "lineage.jsonl"))
    assert [r["step"] for r in lineage] == list(range(1, STEPS + 1))  # each step once
    ref_lineage = read_jsonl(os.path.join(one.run_dir, "lineage.jsonl"))
    assert [r["prompt_ids"] for r in lineage] == [r["prompt_ids"] for r in ref_lineage]

    a = exported(one.run_dir, str(tmp_path / "export-one"), capsys)
    b = exported(two.run_dir, str(tmp_path / "export-two"), capsys)
    assert a.keys() == b.keys() and a
    for name in a:
        np.testing.assert_allclose(b[name], a[name], rtol=0, atol=1e-6, err_msg=name)
