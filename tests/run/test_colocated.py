"""A colocated run (trainer, sampler, parameter server and controller in one process): kill -9 of
the process at a random step, then the same command again, ends with the lineage and the weights
of an uninterrupted run; the uninterrupted run, its newest snapshot and checkpoint then damaged,
falls back to the newest ones that verify (`rlax run` of a colocated run with its report:
tests/run/test_supervisor_ownership.py)."""

from __future__ import annotations

import dataclasses
import glob
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from rlax_tasks.config import ConfigError, RunConfig, load_config, save_resolved
from rlax_tasks.evaluation.checkpoints import mirror_arrays
from rlax_tasks.models import load_pretrained
from rlax_tasks.rundir import notices
from tests.conftest import TEST_XLA_FLAGS
from tests.run.test_local_run import read_jsonl, small_config, steps_trained

STEPS = 6
COLOCATED = {
    "placement.mode": "colocated",
    "workers.count": 1,
    # on-policy lockstep (j = k = 1): the rollouts, hence the weights, do not depend on timing
    "staleness.reload_every": 1,
    "staleness.max_staleness": 1,
    "trainer.checkpoint_every": 2,
    "trainer.warmup_steps": 0,
    "eval.every_steps": 0,
    # the trainer takes its log-probs at the sampling temperature, over the top-k's kept ids
    "rollout.temperature": 0.8,
    "rollout.top_k": 5,
}


def _command(config_path: str, steps: int) -> list[str]:
    return [sys.executable, "-m", "rlax_tasks.cli", "colocated", "--config", config_path,
            "--steps", str(steps)]  # fmt: skip


def _env() -> dict[str, str]:
    return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": TEST_XLA_FLAGS}


def _run(
    config_path: str, log_path: str, kill_after: int | None = None, steps: int = STEPS
) -> int | None:
    """Runs the command; with ``kill_after`` kills it (-9) once that step is in the metrics and
    returns the step it had reached, else waits for exit 0."""
    cfg = load_config(config_path)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(_command(config_path, steps), stdout=log, stderr=log, env=_env())
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline:
            if kill_after is not None and steps_trained(cfg.run_dir) >= kill_after:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                return steps_trained(cfg.run_dir)
            time.sleep(0.02)
        if proc.poll() is None:
            proc.kill()
            pytest.fail(f"rlax colocated did not finish in 300 s; see {log_path}")
    assert proc.returncode == 0, open(log_path).read()[-3000:]
    return None


@dataclasses.dataclass(frozen=True)
class Runs:
    """An uninterrupted run and one killed (-9) after step ``at`` then resumed, in one run root
    (the second process reuses the compilation cache)."""

    root: str
    whole: RunConfig
    whole_path: str  # its config.yaml, the command's --config
    killed: RunConfig
    at: int
    reached: int | None


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    tmp = tmp_path_factory.mktemp("colocated")
    whole = small_config(tmp / "shared", run_id="whole", **COLOCATED)
    killed = small_config(tmp / "shared", run_id="killed", **COLOCATED)
    at = random.Random().randint(1, STEPS - 1)  # a different step every time, logged on failure
    print(f"kill -9 after step {at}")

    whole_path = save_resolved(whole)
    _run(whole_path, os.path.join(tmp, "whole.log"))
    path = save_resolved(killed)
    reached = _run(path, os.path.join(tmp, "killed.log"), kill_after=at)
    if reached is not None and reached < STEPS:
        _run(path, os.path.join(tmp, "killed.log"))  # the same command again
    return Runs(str(tmp), whole, whole_path, killed, at, reached)


@pytest.mark.slow
def test_kill_9_at_a_random_step_then_the_same_command_resumes_exactly(runs):
    whole, killed = runs.whole, runs.killed
    assert runs.reached is not None and runs.reached < STEPS, f"killed at step {runs.reached}"

    log = open(os.path.join(runs.root, "killed.log")).read()
    assert log.count("controller restored step") == 1, log[-3000:]
    lineage = read_jsonl(os.path.join(killed.run_dir, "lineage.jsonl"))
    reference = read_jsonl(os.path.join(whole.run_dir, "lineage.jsonl"))
    assert [r["step"] for r in lineage] == list(range(1, STEPS + 1))  # each step once, in order
    assert [r["prompt_ids"] for r in lineage] == [r["prompt_ids"] for r in reference]
    assert [r["rollout_versions"] for r in lineage] == [r["rollout_versions"] for r in reference]
    metrics = read_jsonl(os.path.join(killed.run_dir, "metrics.jsonl"))
    assert max(r["logprob_mismatch_p95"] for r in metrics) < 1e-3  # sampler and trainer at T 0.8
    assert all(r["support_replayed_frac"] == 1.0 for r in metrics)

    # the final weights: the version both runs published (and mirrored) at the last step
    v_whole, a_whole = mirror_arrays(whole.run_dir)
    v_killed, a_killed = mirror_arrays(killed.run_dir)
    assert v_whole == v_killed == STEPS
    assert a_whole.keys() == a_killed.keys()
    for name in a_whole:
        np.testing.assert_allclose(a_killed[name], a_whole[name], atol=1e-6, err_msg=name)
    start = dict(load_pretrained(whole.model.path).named_params())
    assert any(not np.allclose(a_whole[n], np.asarray(start[n])) for n in a_whole), "no training"


def _cut_short(path: str) -> None:
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])


@pytest.mark.slow
def test_a_damaged_newest_snapshot_and_checkpoint_fall_back_and_every_step_trains_once(runs):
    """The uninterrupted run goes on (after the test above has compared it): its newest snapshot
    and checkpoint (step 6) cut short, the same command with more steps sets both aside
    (renamed, not deleted), falls back to step 4's and trains every step exactly once."""
    run_dir = runs.whole.run_dir  # checkpoints every 2 steps
    _cut_short(os.path.join(run_dir, "snapshots", f"{STEPS}.json"))  # what LATEST names
    state = os.path.join(run_dir, "checkpoints", str(STEPS), "state", "d", "*")
    _cut_short(sorted(glob.glob(state))[0])

    # the same command, more steps
    _run(runs.whole_path, os.path.join(runs.root, "damaged.log"), steps=STEPS + 2)
    lineage = read_jsonl(os.path.join(run_dir, "lineage.jsonl"))
    assert [r["step"] for r in lineage] == list(range(1, STEPS + 3))  # each once, contiguous
    metrics = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    assert [r["step"] for r in metrics] == list(range(1, STEPS + 3))
    # set aside, not deleted: the damaged bytes are still there under the new names
    (snapshot,) = glob.glob(os.path.join(run_dir, "snapshots", f"{STEPS}.json.damaged-*"))
    (checkpoint,) = glob.glob(os.path.join(run_dir, "checkpoints", f"{STEPS}.damaged-*"))
    assert os.path.getsize(snapshot) > 0 and glob.glob(os.path.join(checkpoint, "state", "d", "*"))
    fallbacks = [n for n in notices.read_since(run_dir)[0] if n.kind == "fallback"]
    assert sorted(n.source for n in fallbacks) == ["controller", "trainer"]
    restored = f"restored the newest intact one, step {STEPS - 2}"
    assert restored in " ".join(n.message for n in fallbacks), fallbacks


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"workers.count": 2}, "workers.count"),
        ({"trainer.hosts": 2}, "trainer.hosts"),
        ({"placement.hosts": 2}, "placement.hosts"),
        ({"placement.platform": "gpu", "placement.trainer": [0], "placement.workers": [[1]]},
         "placement.workers"),
    ],
)  # fmt: skip
def test_colocated_settings_it_cannot_carry_name_the_field(tmp_path, overrides, field):
    with pytest.raises(ConfigError) as e:
        small_config(tmp_path, **{**COLOCATED, **overrides})
    assert str(e.value).startswith(field), str(e.value)


def test_a_colocated_plan_is_one_job_with_the_trainer_and_the_sampler_on_its_devices(tmp_path):
    from rlax_tasks.plan.memory_plan import memory_plan
    from rlax_tasks.plan.topology import Ports, plan_topology

    cfg = small_config(tmp_path, **COLOCATED)
    plan = memory_plan(cfg)
    [job] = plan.jobs
    assert job.job == "colocated"
    assert {"params", "adam", "weights", "kv_cache"} <= set(job.parts)  # trainer + sampler
    topo = plan_topology(cfg, 5, "c.yaml", Ports(1, 2, (3,), 4), ["--keep-versions", "2"], "t")
    [only] = topo.jobs
    assert only.argv[:5] == ["colocated", "--config", "c.yaml", "--steps", "5"]
    assert not only.service and topo.ps_url == "http://127.0.0.1:1"


def test_the_sampler_takes_the_trainers_weights_device_to_device_and_keeps_them(tmp_path):
    """TrainerWeights.pull casts and copies the trainer's arrays on the device; the sampler takes
    them over (no host round trip, no second copy), and the trainer's next step (which donates
    its own arrays) leaves them intact."""
    import dataclasses

    import jax

    from rlax_tasks.algorithms import make_objective
    from rlax_tasks.models import load_pretrained
    from rlax_tasks.rollout.sampler import Sampler
    from rlax_tasks.run.colocated import TrainerWeights, sampler_policy
    from rlax_tasks.trainer.service import TrainerService
    from rlax_tasks.trainer.trainer import Trainer

    cfg = small_config(tmp_path, **COLOCATED)
    policy = load_pretrained(cfg.model.path)
    trainer = Trainer(
        policy, make_objective("grpo", kl_beta=0.0),
        dataclasses.replace(cfg.trainer, checkpoint_every=0), cfg.run_dir,
    )  # fmt: skip
    service = TrainerService(trainer)
    sampler = Sampler(sampler_policy(trainer.policy(), (1, 1, -1), "float32"), 4, 32)
    shardings = jax.tree.map(lambda a: a.sharding, sampler.params)
    weights = TrainerWeights(service, shardings, "float32")
    version, pulled = weights.pull()
    assert version == 0
    mine = {id(a) for a in jax.tree.leaves(pulled)}

    def buffers(tree):
        return {a.addressable_data(0).unsafe_buffer_pointer() for a in jax.tree.leaves(tree)}

    assert not buffers(trainer.params) & buffers(pulled)  # copies, not the trainer's buffers
    sampler.set_params(pulled, donate=True)
    assert {id(a) for a in jax.tree.leaves(sampler.params)} == mine  # taken over, not copied
    before = [np.asarray(a) for a in jax.tree.leaves(sampler.params)]

    rng = np.random.default_rng(0)
    ids = rng.integers(3, policy.config.vocab_size, (4, 12)).astype(np.int32)
    mask = np.ones_like(ids)
    completion = np.zeros_like(ids)
    completion[:, 6:] = 1
    service.train(1, {
        "input_ids": ids, "attention_mask": mask, "completion_mask": completion,
        "behavior_logprobs": np.full(ids.shape, -1.0, np.float32),
        "rewards": np.array([1.0, 0.0, 1.0, 0.0], np.float32),
        "group_ids": np.array([0, 0, 1, 1], np.int32),
    })  # fmt: skip
    after = [np.asarray(a) for a in jax.tree.leaves(sampler.params)]  # still alive, unchanged
    assert all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))
    assert weights.latest_version() == 1
    _, newer = weights.pull(min_version=1)
    moved = [np.asarray(a) for a in jax.tree.leaves(newer)]
    assert any(not np.array_equal(a, b) for a, b in zip(before, moved, strict=True))
    with pytest.raises(TimeoutError, match="not 2 yet"):
        TrainerWeights(service, shardings, "float32", wait_s=0.05).pull(min_version=2)
