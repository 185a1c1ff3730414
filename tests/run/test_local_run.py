"""`rlax run` end to end on this machine: real processes, real kills, exact step accounting."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from rlax_tasks.config import load_config
from rlax_tasks.controller import SnapshotStore, read_rollouts
from rlax_tasks.evaluation.checkpoints import mirror_arrays
from rlax_tasks.run.local_run import run_local
from tests.conftest import TEST_XLA_FLAGS
from tests.tiny_model import save_char_model

HERE = os.path.dirname(os.path.abspath(__file__))
RECORD_TOKENS = os.path.join(os.path.dirname(HERE), "shims", "record_tokens")


def small_settings(tmp_path, **extra) -> dict:
    """The tests' overrides of tiny-arith, with a tiny model written under ``tmp_path``."""
    save_char_model(str(tmp_path / "model"))
    return {
        "run_root": str(tmp_path / "runs"),
        "model.path": str(tmp_path / "model"),
        "model.warmup_if_missing": False,
        "rollout.prompts_per_step": 4,
        "rollout.group_size": 4,
        "workers.slots": 16,
        "eval.num_prompts": 16,
        # the tiny preset runs colocated; these tests exercise the separate jobs
        "placement.mode": "disaggregated",
        "workers.count": 2,
        **extra,
    }


def small_config(tmp_path, **extra):
    return load_config("tiny-arith", small_settings(tmp_path, **extra))


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def steps_trained(run_dir: str) -> int:
    """The last step the run's metrics.jsonl records (0 before the first): a kill hook's clock."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return 0
    return max((r["step"] for r in read_jsonl(path)), default=0)


@pytest.mark.slow
def test_run_survives_kill_9_of_every_component_and_random_kills(tmp_path, monkeypatch):
    """kill -9 of the trainer, the controller, a worker and the parameter server, then of a
    random component, after 6 different steps of one run: the run finishes, every step is in
    the lineage exactly once, in order, no prompt is trained twice, and the report is written."""
    import random

    monkeypatch.setenv("XLA_FLAGS", TEST_XLA_FLAGS)  # the components need one device each
    # sampling at T 0.8 with top-k 5: the trainer's log-probs must be those of the tempered
    # distribution over the ids the workers' top-k kept (sampling-mask replay)
    sampling = {"rollout.temperature": 0.8, "rollout.top_k": 5}
    # a restarted worker holds none of the groups a restored controller has in flight on it:
    # they come back when it is timed out (tiny-arith: 120 s)
    cfg = small_config(tmp_path, **{"eval.every_steps": 10, "workers.timeout_s": 20, **sampling})
    scripted = ["trainer", "controller", "worker-0", "ps"]
    rng = random.Random(7)
    names = ["ps", "trainer", "controller", "worker-0", "worker-1"]
    killed: list[tuple[int, str]] = []
    # one kill per step seen trained; after a restart, steps come faster than the supervisor
    # polls (0.2 s) and 2-3 pass unseen, so the run has room for 6 kills spread over its steps
    steps, kills = 24, 6

    def hook(sup):
        if len(killed) >= kills:
            return
        done = steps_trained(cfg.run_dir)
        if done > (killed[-1][0] if killed else 1) and done < steps:
            name = scripted[len(killed)] if len(killed) < len(scripted) else rng.choice(names)
            sup.kill(name)
            killed.append((done, name))

    report = run_local(cfg, steps=steps, evaluate=True, supervisor_hook=hook)
    assert len(killed) == kills, killed
    assert [name for _, name in killed[:4]] == scripted
    for name in set(name for _, name in killed):
        assert report["restarts"][name] >= 1, (name, report["restarts"])
    assert sum(report["restarts"].values()) >= kills
    lineage = read_jsonl(os.path.join(cfg.run_dir, "lineage.jsonl"))
    assert [r["step"] for r in lineage] == list(range(1, steps + 1))
    consumed = [p for r in lineage for p in r["prompt_ids"]]
    assert len(consumed) == len(set(consumed)) == steps * 4  # no prompt trained twice
    assert report["after"]["version"] == steps
    assert os.path.exists(os.path.join(cfg.run_dir, "eval", "report.md"))
    for plot in ("reward", "pass_at_k", "staleness", "weight_sync"):
        assert os.path.getsize(os.path.join(cfg.run_dir, "eval", f"{plot}.png")) > 1000
    # eval.every_steps: held-out pass@k during the run, each row timed by its version's step
    progress = read_jsonl(os.path.join(cfg.run_dir, "eval", "progress.jsonl"))
    assert progress[0]["step"] == 0 and progress[0]["seconds"] == 0
    assert progress[-1]["version"] == steps and len(progress) >= 3
    assert all(0 <= r["pass@1"] <= r["pass@8"] <= 1 for r in progress)
    times = [r["seconds"] for r in progress if r["seconds"] is not None]
    assert times == sorted(times) and len(times) >= 3
    assert all("time" in r for r in read_jsonl(os.path.join(cfg.run_dir, "metrics.jsonl")))
    # trainer and sampler agree on the sampled tokens' log-probs (f32 both; ~0.1 at T 1)
    rows = read_jsonl(os.path.join(cfg.run_dir, "metrics.jsonl"))
    assert max(r["logprob_mismatch_p95"] for r in rows) < 1e-3
    assert all(r["support_replayed_frac"] == 1.0 for r in rows)


NO_BACKEND_RUN = """
import json, sys
from rlax_tasks.config import load_config
from rlax_tasks.run.local_run import run_local
report = run_local(load_config("tiny-arith", json.loads(sys.argv[1])), steps=4, evaluate=True)
bridge = sys.modules.get("jax._src.xla_bridge")
print(json.dumps({"backends": sorted(bridge._backends) if bridge else [],
                  "before": report["before"]["version"], "after": report["after"]["version"]}))
"""


@pytest.mark.slow
def test_rlax_run_evaluates_in_a_job_of_its_own_and_loads_no_jax_backend(tmp_path):
    """`rlax run` with held-out evaluation before, during and after: the evaluations run as the
    heldout job (its log), and the supervisor's own process never starts a JAX backend (on a
    GPU host it would take the devices' memory before the jobs start)."""
    settings = small_settings(tmp_path, **{"eval.num_prompts": 8, "eval.every_steps": 2})
    env = {**os.environ, "XLA_FLAGS": TEST_XLA_FLAGS}
    out = subprocess.run([sys.executable, "-c", NO_BACKEND_RUN, json.dumps(settings)], env=env,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen == {"backends": [], "before": 0, "after": 4}
    run_dir = tmp_path / "runs" / "tiny-arith"
    progress = read_jsonl(str(run_dir / "eval" / "progress.jsonl"))
    assert [r["version"] for r in progress][0] == 0 and progress[-1]["version"] == 4
    log = (run_dir / "logs" / "heldout.log").read_text()
    assert "at version 0:" in log and "at version 4:" in log
    assert (run_dir / "eval" / "report.md").exists()


def drawn_tokens(path: str) -> dict[tuple[str, int, int], list[int]]:
    """{(prompt_id, sample, position): every token the workers drew there}, from the file of
    the tests/shims/record_tokens shim (outside the product: each draw, by every process)."""
    drawn: dict[tuple[str, int, int], list[int]] = {}
    for r in read_jsonl(path):
        if r["job"].startswith("worker-"):
            prompt_id, sample = r["request"]
            drawn.setdefault((prompt_id, int(sample), r["position"]), []).append(r["token"])
    return drawn


def count_resumed(
    run_dir: str, held: dict[tuple[str, int], dict], drawn: dict[tuple[str, int, int], list[int]]
) -> tuple[int, int, list]:
    """(tokens ``held`` by a snapshot that were trained on, how many of them were drawn more
    than once, the held samples whose trained row does not start with their tokens and
    versions): each held position must have been drawn, the token held (``drawn``)."""
    lineage = read_jsonl(os.path.join(run_dir, "lineage.jsonl"))
    consumed = {p for r in lineage for p in r["prompt_ids"]}
    dropped = {d["prompt_id"] for r in lineage for d in r["dropped_zero_variance"]}
    rows = read_rollouts(run_dir).set_index(["prompt_id", "sample"])
    counted = regenerated = 0
    changed = []
    for key, record in held.items():
        n = len(record["tokens"])
        if key not in rows.index:  # its group trained no step: all its rewards were equal
            assert key[0] in dropped or key[0] not in consumed, key
            continue
        row = rows.loc[key]
        counted += n
        for position, token in enumerate(record["tokens"]):
            draws = drawn.get((*key, position), [])
            assert token in draws, f"{key} position {position}: held {token}, drawn {draws}"
            regenerated += len(draws) - 1
        trained = (list(row["tokens"])[:n], list(row["token_versions"])[:n])
        if trained != (record["tokens"], record["versions"]):
            changed.append(key)
    return counted, regenerated, changed


def job_pid(parent: int, job: str) -> int | None:
    """The pid of the job ``job`` (its RLAX_JOB_NAME) that process ``parent`` started."""
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/environ", "rb") as f:
                named = f"RLAX_JOB_NAME={job}".encode() in f.read().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent and named:
            return int(entry)
    return None


@pytest.mark.slow
def test_kill_9_of_a_worker_then_of_rlax_run_regenerates_no_token_a_snapshot_held(tmp_path):
    """Mid-generation, kill -9 of a worker, then of `rlax run` itself (every job dies with it),
    each while the run's last snapshot holds part-generated groups; `rlax run` again resumes
    and finishes with every step once, and no token those snapshots held is generated again
    (each held sample is trained with those tokens first, and tests/shims/record_tokens, which
    records every token each worker process draws, saw each held position drawn once).

    A test shim (tests/run/slow_decode) pauses the workers after each decode chunk until the
    run is killed, so every snapshot finds groups mid-generation, and freezes worker-0 once a
    snapshot has its part-generated groups, so what that snapshot holds is what it held when
    killed. The run's kill is tried again on a resumed run when a snapshot without records came
    between the look and the kill."""
    steps = 12
    # completions of 3 decode chunks, one group at a time per worker, and no staleness bound
    # (k): every held record is resumed (one with a token older than k would not be)
    extra = {"rollout.max_new_tokens": 20, "workers.slots": 4, "staleness.max_staleness": 1000}
    settings = small_settings(tmp_path, **extra)
    argv = [sys.executable, "-m", "rlax_tasks.cli", "run", "--steps", str(steps), "--no-eval"]
    argv += [a for k, v in settings.items() for a in ("--set", f"{k}={v}")]
    slow, freeze = tmp_path / "slow-decode", tmp_path / "freeze-worker-0"
    slow.touch()
    freeze.touch()
    env = {
        **os.environ,
        "XLA_FLAGS": TEST_XLA_FLAGS,
        # every token the workers draw, recorded outside the product, then the decode pauses
        "PYTHONPATH": os.pathsep.join([RECORD_TOKENS, os.path.join(HERE, "slow_decode")]),
        "RLAX_TEST_TOKENS_FILE": str(tmp_path / "tokens.jsonl"),
        "RLAX_TEST_SLOW_DECODE": str(slow),
        "RLAX_TEST_FREEZE_FILE": str(freeze),
        "RLAX_TEST_FREEZE_WORKER": "worker-0",
    }
    run_dir = str(tmp_path / "runs" / "tiny-arith")
    store = SnapshotStore(run_dir)  # read only (read_latest)

    def records(worker: str | None = None) -> dict[tuple[str, int], dict]:
        """The last snapshot's records (of the groups in flight at ``worker``)."""
        snap = store.read_latest() if os.path.exists(run_dir) else None
        if snap is None:
            return {}
        at = {e["prompt_id"] for e in snap.in_flight if worker in (None, e["worker"])}
        return {(r["prompt_id"], r["sample"]): r for r in snap.partials if r["prompt_id"] in at}

    def wait_for(run: subprocess.Popen, worker: str | None = None) -> None:
        while run.poll() is None and not records(worker):
            time.sleep(0.05)
        assert run.poll() is None, f"rlax run ended before a snapshot held records ({worker})"

    held_by_worker: dict[tuple[str, int], dict] = {}
    held_by_run: dict[tuple[str, int], dict] = {}
    tries = 0
    with open(tmp_path / "rlax-run.log", "ab") as log:
        while not held_by_run and tries < 3:
            tries += 1
            run = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
            if not held_by_worker:
                wait_for(run, "worker-0")  # frozen: what it holds stays as recorded
                held_by_worker = records("worker-0")
                pid = job_pid(run.pid, "worker-0")
                assert pid is not None, "no worker-0 process under rlax run"
                os.kill(pid, signal.SIGKILL)
                freeze.unlink()  # its restart goes on
                time.sleep(1.0)  # the next snapshot may still be the one above
            wait_for(run)
            run.send_signal(signal.SIGKILL)  # its jobs die with it (parent-death signal)
            run.wait()
            held_by_run = records()  # the snapshot the next `rlax run` restores
        slow.unlink()
        done = subprocess.run(argv, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=600)
    assert held_by_run, f"no snapshot held records when rlax run was killed ({tries} tries)"
    assert done.returncode == 0, (tmp_path / "rlax-run.log").read_text()[-3000:]
    lineage = read_jsonl(os.path.join(run_dir, "lineage.jsonl"))
    assert [r["step"] for r in lineage] == list(range(1, steps + 1))
    consumed = [p for r in lineage for p in r["prompt_ids"]]
    assert len(consumed) == len(set(consumed)) == steps * 4
    drawn = drawn_tokens(str(tmp_path / "tokens.jsonl"))
    for what, held in (("worker-0", held_by_worker), ("rlax run", held_by_run)):
        counted, regenerated, changed = count_resumed(run_dir, held, drawn)
        print(f"kill -9 of {what}: {counted} tokens its snapshot held were trained on, "
              f"{regenerated} generated again")  # fmt: skip
        assert counted > 0 and regenerated == 0, what
        assert not changed, f"{what}: trained rows that do not start with the held tokens"


@pytest.mark.slow
def test_lockstep_prompt_sequence_after_kills_equals_an_uninterrupted_run(tmp_path, monkeypatch):
    """On-policy lockstep (j = k = 1): with the trainer and the controller killed mid-run, the
    prompts of every step in lineage.jsonl are those of an uninterrupted run with the seed."""
    monkeypatch.setenv("XLA_FLAGS", TEST_XLA_FLAGS)
    lockstep = {
        "staleness.reload_every": 1,
        "staleness.max_staleness": 1,
        "trainer.checkpoint_every": 4,
    }
    reference = small_config(tmp_path / "a", **lockstep)
    run_local(reference, steps=6, evaluate=False)
    cfg = small_config(tmp_path / "b", **lockstep)
    schedule = [(2, "controller"), (3, "trainer"), (4, "worker-1")]

    def hook(sup):
        if schedule and steps_trained(cfg.run_dir) >= schedule[0][0]:
            sup.kill(schedule.pop(0)[1])

    run_local(cfg, steps=6, evaluate=False, supervisor_hook=hook)
    assert not schedule
    a = read_jsonl(os.path.join(reference.run_dir, "lineage.jsonl"))
    b = read_jsonl(os.path.join(cfg.run_dir, "lineage.jsonl"))
    assert [r["prompt_ids"] for r in b] == [r["prompt_ids"] for r in a]
    assert [r["step"] for r in b] == list(range(1, 7))
    # checkpoint_every=4: the trainer killed after step 3 restarted from scratch and was given
    # steps 1-3 again; on-policy, every token and the final weights match the reference run
    ra, rb = read_rollouts(reference.run_dir), read_rollouts(cfg.run_dir)
    assert [list(t) for t in rb["tokens"]] == [list(t) for t in ra["tokens"]]
    (va, wa), (vb, wb) = mirror_arrays(reference.run_dir, 6), mirror_arrays(cfg.run_dir, 6)
    assert va == vb == 6 and wa.keys() == wb.keys()
    for name in wa:
        np.testing.assert_array_equal(wb[name], wa[name], err_msg=name)


@pytest.mark.slow
def test_the_heldout_job_before_training_is_gone_before_the_training_jobs_start(tmp_path):
    """Evaluated before and after only (no version between): the held-out job that evaluated the
    starting weights has exited (its process, and on a GPU its memory) when training starts."""
    cfg = load_config("tiny-arith", {
        **small_settings(tmp_path, **{"eval.num_prompts": 8, "eval.every_steps": 0}),
        "placement.mode": "colocated", "workers.count": 1,
    })  # fmt: skip
    seen: list[tuple[bool, bool]] = []

    def hook(sup) -> None:  # called from the training loop: the jobs have started
        if not seen:
            heldout, colocated = sup.components["heldout"], sup.components["colocated"]
            seen.append((heldout.proc.poll() is None, colocated.proc is not None))

    report = run_local(cfg, 2, supervisor_hook=hook)
    assert seen == [(False, True)]  # the held-out job had exited, the colocated job had started
    assert report["before"]["version"] == 0
