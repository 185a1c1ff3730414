"""`rlax run` owns its processes and its run directory (docs/design.md §13), checked on real runs of
the tiny preset (one colocated job) and of a disaggregated topology: kill -9 or SIGTERM of
`rlax run` leaves no process behind (every descendant's PID collected before the kill), a second
`rlax run` on a live run is refused, and after a kill -9 the same command takes the run over and
resumes it. One finished 4-step run, started in this process with its evaluation, is shared by the
module: its report is checked first, then the tests below go on from it."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys

import psutil
import pytest

from rlax_tasks.cli import main
from rlax_tasks.config import load_config
from rlax_tasks.run.local_run import run_local
from rlax_tasks.rundir import notices
from rlax_tasks.rundir.paths import run_paths
from tests.compute.helpers import wait_for
from tests.conftest import TEST_XLA_FLAGS

pytestmark = pytest.mark.slow


@dataclasses.dataclass(frozen=True)
class Run:
    root: str
    model: str
    run_id: str = "tiny-arith"

    @property
    def run_dir(self) -> str:
        return os.path.join(self.root, "runs", self.run_id)

    def argv(self, *extra: str) -> list[str]:
        return ["run", "--preset", "tiny-arith", "--run-root", os.path.join(self.root, "runs"),
                "--run-id", self.run_id, "--no-eval",
                "--set", f"model.path={self.model}", "--set", "model.warmup_if_missing=false",
                "--set", "rollout.prompts_per_step=4", "--set", "rollout.group_size=4",
                "--set", "workers.slots=16", "--set", "trainer.warmup_steps=0",
                "--set", "eval.every_steps=0", *extra]  # fmt: skip

    def start(self, *extra: str) -> subprocess.Popen:
        """`rlax run` as a process of its own (stdout, stderr in files under the root)."""
        env = {**os.environ, "XLA_FLAGS": TEST_XLA_FLAGS}  # not the tests' 8 host devices
        out = open(os.path.join(self.root, "out.txt"), "w")  # noqa: SIM115
        err = open(os.path.join(self.root, "err.txt"), "w")  # noqa: SIM115
        with out, err:
            return subprocess.Popen(
                [sys.executable, "-m", "rlax_tasks.cli", *self.argv(*extra)],
                stdout=out, stderr=err, env=env,
            )  # fmt: skip

    def output(self) -> tuple[str, str]:
        return tuple(open(os.path.join(self.root, n)).read() for n in ("out.txt", "err.txt"))

    def step(self) -> int:
        with open(run_paths(self.run_dir).metrics) as f:
            return max(json.loads(line)["step"] for line in f)


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _job(p: psutil.Process) -> str:
    """The `rlax` sub-command ``p`` runs (past the launcher that set its parent-death signal)."""
    try:
        argv = p.cmdline()
    except psutil.Error:
        return ""
    return argv[3] if argv[1:3] == ["-m", "rlax_tasks.cli"] and len(argv) > 3 else ""


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _started(proc: subprocess.Popen, *jobs: str) -> list[psutil.Process]:
    """Waits until `rlax run` (``proc``) has started every job in ``jobs``; all its descendants."""

    def ready() -> list[psutil.Process] | None:
        assert proc.poll() is None, "rlax run ended early"
        found = _descendants(proc.pid)
        running = {_job(p) for p in found}
        return found if all(j in running for j in jobs) else None

    return wait_for(ready, timeout_s=120)


def _none_left(procs: list[psutil.Process]) -> None:
    try:
        wait_for(lambda: not [p for p in procs if _alive(p)], timeout_s=60)
    finally:
        for p in procs:  # a failed test must not leave its processes to the next one
            if _alive(p):
                p.kill()


@pytest.fixture(scope="module")
def reported(tmp_path_factory) -> tuple[Run, dict]:
    """The run's first 4 steps through ``run_local`` (`rlax run` in this process), with the
    settings of ``Run.argv`` and an evaluation every 2 steps; the run and its report."""
    from tests.tiny_model import save_char_model

    root = str(tmp_path_factory.mktemp("owned"))
    save_char_model(os.path.join(root, "model"))
    run = Run(root, os.path.join(root, "model"))
    cfg = load_config("tiny-arith", {
        "run_root": os.path.join(root, "runs"), "run_id": run.run_id,
        "model.path": run.model, "model.warmup_if_missing": False,
        "rollout.prompts_per_step": 4, "rollout.group_size": 4, "workers.slots": 16,
        "trainer.warmup_steps": 0, "eval.every_steps": 2, "eval.num_prompts": 8,
    })  # fmt: skip
    assert cfg.run_dir == run.run_dir
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XLA_FLAGS", TEST_XLA_FLAGS)  # the tests' 8 host devices would slow the job down
        report = run_local(cfg, steps=4)
    assert run.step() == 4
    return run, report


@pytest.fixture(scope="module")
def finished(reported) -> Run:
    return reported[0]


def test_rlax_run_runs_a_colocated_run_as_one_job_with_a_report(reported):
    run, report = reported
    assert set(report["restarts"]) == {"colocated"}
    assert report["after"]["version"] == 4 and "pass@1" in report["before"]
    with open(os.path.join(run.run_dir, "eval", "progress.jsonl")) as f:
        progress = [json.loads(line) for line in f if line.strip()]
    assert [r["step"] for r in progress][:1] == [0] and progress[-1]["version"] == 4
    assert not os.path.exists(os.path.join(run.run_dir, "workers.json"))


def test_sigterm_stops_every_component_and_releases_the_run(finished):
    proc = finished.start("--steps", str(finished.step() + 5))
    procs = _started(proc, "colocated")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 128 + signal.SIGTERM
    _none_left(procs)
    err = finished.output()[1]
    assert err.strip().splitlines()[-1] == (
        "rlax run: stopped by SIGTERM: every component stopped; run the same command again to "
        "resume"
    )
    assert open(run_paths(finished.run_dir).lock).read() == ""  # released: no holder left


def test_a_fatal_notice_stops_the_run_with_its_message(finished):
    proc = finished.start("--steps", str(finished.step() + 5))
    procs = _started(proc, "colocated")
    message = "checkpoints/9 cannot be written: disk full; free space and run again"
    notices.post(finished.run_dir, "fatal", message, source="colocated")
    assert proc.wait(timeout=120) == 2
    _none_left(procs)
    out, err = finished.output()
    assert f"[fatal] colocated: {message}" in out
    log = os.path.join(run_paths(finished.run_dir).logs, "colocated.log")
    assert err.strip().splitlines()[-1] == f"rlax run: error: colocated: {message} (log: {log})"
    assert "Traceback" not in err


def test_kill_9_leaves_no_process_and_the_same_command_takes_over(finished, capsys):
    target = finished.step() + 1
    first = finished.start("--steps", str(target))
    procs = _started(first, "colocated")
    # a second rlax run on the live run is refused, naming the holder
    assert main(finished.argv("--steps", str(target))) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"rlax run: error: run {finished.run_dir} is in use by pid {first.pid}")
    assert f"kill {first.pid}" in last
    first.send_signal(signal.SIGKILL)
    first.wait()
    _none_left(procs)
    # the same command again: the dead run's lock is taken over, the run resumes to the target
    again = finished.start("--steps", str(target))
    assert again.wait(timeout=600) == 0, finished.output()[1][-3000:]
    err = finished.output()[1]
    assert f"left by pid {first.pid} on" in err and "taken over" in err
    assert finished.step() == target
    with open(run_paths(finished.run_dir).lineage) as f:
        assert [json.loads(line)["step"] for line in f] == list(range(1, target + 1))


def test_kill_9_of_a_disaggregated_run_leaves_no_process(finished):
    run = dataclasses.replace(finished, run_id="disaggregated")
    jobs = ("ps", "trainer", "worker", "controller")
    proc = run.start(
        "--steps", "3", "--set", "placement.mode=disaggregated", "--set", "workers.count=2"
    )
    procs = _started(proc, *jobs)
    assert len(procs) >= 5
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    _none_left(procs)


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_the_base_models_warm_up_dies_with_rlax_run(tmp_path):
    """kill -9 of `rlax run` while it builds the base model: the warm-up (a JAX process on the
    trainer's devices) is not left holding them."""
    env = {**os.environ, "XLA_FLAGS": TEST_XLA_FLAGS}
    argv = [sys.executable, "-m", "rlax_tasks.cli", "run", "--preset", "tiny-arith", "--no-eval",
            "--run-root", str(tmp_path / "runs"),
            "--set", f"model.path={tmp_path / 'base'}"]  # fmt: skip
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:

        def warm_up() -> psutil.Process | None:
            for child in psutil.Process(proc.pid).children(recursive=True):
                try:
                    if "rlax_tasks.warmup.base_model" in " ".join(child.cmdline()):
                        return child
                except psutil.NoSuchProcess:
                    continue
            return None

        child = wait_for(warm_up, timeout_s=60)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        wait_for(lambda: not _alive(child), timeout_s=15)  # it died with its parent
    finally:
        if proc.poll() is None:
            proc.kill()
