"""`rlax airflow train` as a person watches it: a quiet terminal (Airflow's logs in the run's
logs/airflow.log), one line per task transition, the training status line, notices, the end of a
failed task's log, and a before/after table at the end."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from rlax_tasks.airflow.dag_watch import DagRunWatcher
from rlax_tasks.cli import main
from rlax_tasks.rundir import notices
from rlax_tasks.rundir.paths import run_paths
from tests.conftest import REPO, TEST_XLA_FLAGS

STAMP = r"^\[\s*(?:\d+h )?(?:\d+m )?\d+[sm]\] "  # the elapsed-time column of the lines


@pytest.mark.parametrize("steps", ["0", "-3", "ten"])
def test_steps_must_be_a_positive_integer(steps, tmp_path, capsys):
    # an empty DAG folder: were --steps let through, the command would stop there, not run
    where = ["--run-root", str(tmp_path), "--airflow-home", str(tmp_path), "--dags-folder"]
    assert main(["airflow", "train", "--steps", steps, *where, str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--steps" in err and "positive" in err, err


def _dag_run_conf(tmp_path, monkeypatch, *args: str) -> dict:
    """The conf `rlax airflow train ARGS` hands the DAG run (the run itself faked)."""
    from rlax_tasks.airflow import local_dag_run

    seen = {}

    def fake_dag_run(conf, **kwargs):
        seen.update(conf)
        return {"state": "success", "tasks": {}, "run_dir": str(tmp_path / "r")}

    monkeypatch.setattr(local_dag_run, "run_train_dag", fake_dag_run)
    where = ["--run-root", str(tmp_path), "--airflow-home", str(tmp_path)]
    assert main(["-v", "airflow", "train", "--steps", "2", *where, *args]) == 0
    return seen


@pytest.mark.parametrize("flag", [[], ["--allow-config-change"]])
def test_allow_config_change_reaches_the_dag_run(flag, tmp_path, monkeypatch, capsys):
    """The flag becomes rlax_train's allow_config_change Param (the plan task's resume check
    is tested in tests/airflow_ops/test_plan_task.py)."""
    conf = _dag_run_conf(tmp_path, monkeypatch, *flag)
    assert conf["allow_config_change"] is bool(flag)


@pytest.mark.parametrize("preset", ["tiny-arith", "smollm2-arith"])
def test_the_default_run_id_names_the_preset(preset, tmp_path, monkeypatch):
    """Without --run-id each preset gets its own run (PRESET-airflow), so training another
    preset never resumes (or is refused as a changed config of) the tiny one's run."""
    conf = _dag_run_conf(tmp_path, monkeypatch, "--preset", preset)
    assert conf["run_id"] == f"{preset}-airflow"


def _lines(out: io.StringIO) -> list[str]:
    return [re.sub(STAMP, "", line) for line in out.getvalue().splitlines()]


def test_the_watcher_shows_transitions_once_status_notices_and_a_failed_tasks_log(tmp_path):
    run_dir = str(tmp_path / "run")
    paths = run_paths(run_dir)
    os.makedirs(paths.logs)
    log = paths.airflow_log

    def airflow_writes(*lines: str) -> None:
        with open(log, "a") as f:
            f.writelines(line + "\n" for line in lines)

    airflow_writes("2026-01-01T00:00:00Z [info     ] an earlier task's line [task]")
    states: dict[str, str] = {}
    out = io.StringIO()
    watcher = DagRunWatcher(
        out, lambda: dict(states), run_dir, 4, log, status_every_s=0, quiet_status_s=0
    )
    states.update(plan="scheduled", controller="none", evaluate="none")
    watcher.poll()
    assert _lines(out) == []  # the runner's bookkeeping states get no line
    states["plan"] = "queued"  # dag.test() shows a starting task queued
    watcher.poll()
    states["plan"] = "running"
    watcher.poll()
    states.update(plan="success", controller="queued")
    watcher.poll()
    assert _lines(out) == [
        "plan             running",
        "plan             success",
        "controller       running",
        "step 0/4  waiting for the first step  elapsed 0s",
    ]
    out.truncate(0), out.seek(0)

    now = time.time()
    with open(paths.metrics, "a") as f:  # the trainer's rows, 2 steps/s
        f.writelines(json.dumps({"step": s, "reward_mean": 0.5, "time": now + s / 2}) + "\n"
                     for s in (1, 2))  # fmt: skip
    airflow_writes("2026-01-01T00:00:30Z [info     ] job controller running on slice s [task]")
    notices.post(run_dir, "fallback", "snapshots/2.json does not verify: using 1.json", "ctl")
    watcher.poll()
    watcher.poll()  # the notice once, the status line while the step moves or now and then
    lines = _lines(out)
    assert lines[0] == "[fallback] ctl: snapshots/2.json does not verify: using 1.json"
    assert lines[1].startswith("step 2/4  reward 0.500  dropped 0 stale  weights v2  2.00 steps/s")
    assert lines.count(lines[0]) == 1
    out.truncate(0), out.seek(0)

    # the controller's try fails: the end of its log, without Airflow's bookkeeping and frames
    airflow_writes(
        "2026-01-01T00:01:00Z [info     ] [DAG TEST] running task <TaskInstance: controller>",
        "2026-01-01T00:01:01Z [error    ] Task failed with exception [task]",
        "Traceback (most recent call last):",
        '  File "/venv/lib/python3.11/site-packages/airflow/sdk/task_runner.py", line 9, in run',
        "    result = execute(context=context)",
        "             ^^^^^^^^^^^^^^^^^^^^^^^^",
        '  File "/work/rlax_tasks/airflow/operators.py", line 106, in raise_for_job_event',
        '    raise JobFailedError(f"job {name}: {message}")',
        "JobFailedError: job controller failed: crashed with SIGKILL",
        "2026-01-01T00:01:02Z [info     ] ::endgroup:: [task]",
        "2026-01-01T00:01:02Z [info     ] [DAG TEST] end task task_id=controller map_index=-1",
        "2026-01-01T00:01:03Z [info     ] the next task's line [task]",
    )
    states["controller"] = "up_for_retry"
    watcher.poll()
    states["controller"] = "queued"  # the retry: running again
    watcher.poll()
    lines = _lines(out)
    assert lines[0] == "controller       up_for_retry"
    assert lines[2:8] == [
        "  | 2026-01-01T00:00:30Z [info     ] job controller running on slice s [task]",
        "  | 2026-01-01T00:01:01Z [error    ] Task failed with exception [task]",
        "  | Traceback (most recent call last):",
        '  |   File "/work/rlax_tasks/airflow/operators.py", line 106, in raise_for_job_event',
        '  |     raise JobFailedError(f"job {name}: {message}")',
        "  | JobFailedError: job controller failed: crashed with SIGKILL",
    ]
    assert "controller       running" in lines[8:]
    assert not any("earlier task" in x or "next task" in x or "site-packages" in x for x in lines)

    states.update(controller="success", evaluate="failed")
    watcher.stop()  # the final poll
    lines = _lines(out)
    assert "controller       success" in lines and "evaluate         failed" in lines
    assert watcher.training_seconds is not None


def _kill_the_job_once_training(run_dir: str, killed: list, done: threading.Event) -> None:
    """SIGKILLs the colocated job (the controller task's) once the run applied a step."""
    runner = os.path.join(
        run_dir, "slices", "rlax-cli-trainer", "jobs", "controller", "runner.json"
    )
    while not done.wait(0.05):
        if os.path.exists(run_paths(run_dir).metrics):
            try:
                with open(runner) as f:
                    (child, *_) = psutil.Process(json.load(f)["pid"]).children()
                child.send_signal(signal.SIGKILL)
                killed.append(child.pid)
                return
            except (OSError, ValueError, psutil.Error):
                pass


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_rlax_airflow_train_shows_progress_a_retry_and_a_before_after_table(tmp_path):
    """The main job end to end (subprocess, tiny preset) with its job killed mid-run: nothing
    of Airflow's internals reaches the terminal, which shows each task's transitions (the
    controller's retry with why), the training status line and the before/after table; the
    Airflow log file holds the task logs; the run still applies every step once."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.tiny_model import save_char_model

    model = str(tmp_path / "model")
    save_char_model(model)
    runs = str(tmp_path / "runs")
    run_dir = os.path.join(runs, "cli")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    env.update(XLA_FLAGS=TEST_XLA_FLAGS, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    env.update(RLAX_RETRY_DELAY_S="1", RLAX_SIBLING_GRACE_S="20", RLAX_POLL_INTERVAL_S="1")
    # every task runs in this one process (dag.test): at its exit it says which JAX backends it
    # started (tests/shims/report_backends): none, the jobs do the accelerator work
    backends = tmp_path / "backends.jsonl"
    shim = os.path.join(REPO, "tests", "shims", "report_backends")
    env.update(PYTHONPATH=f"{shim}{os.pathsep}{REPO}", RLAX_TEST_BACKENDS_FILE=str(backends))
    argv = [
        sys.executable, "-m", "rlax_tasks.cli", "airflow", "train", "--steps", "8",
        "--run-id", "cli", "--run-root", runs, "--airflow-home", str(tmp_path / "airflow"),
        "--set", f"model.path={model}", "--set", "model.warmup_if_missing=false",
        "--set", "rollout.prompts_per_step=4", "--set", "rollout.group_size=4",
        "--set", "workers.slots=16", "--set", "eval.num_prompts=16",
        "--set", "eval.num_samples=4", "--set", "eval.ks=[1,4]",
        "--set", "eval.every_steps=3",  # no heldout task: no devices of its own
    ]  # fmt: skip
    killed: list = []
    done = threading.Event()
    killer = threading.Thread(
        target=_kill_the_job_once_training, args=(run_dir, killed, done), daemon=True
    )
    killer.start()
    try:
        proc = subprocess.Popen(
            argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        out, err = proc.communicate(timeout=1100)
    finally:
        done.set()
        killer.join(timeout=5)
    assert proc.returncode == 0, out + err
    seen = [json.loads(line) for line in backends.read_text().splitlines()]
    assert [r["backends"] for r in seen if r["pid"] == proc.pid] == [[]], seen
    assert killed, "the job was never killed"
    assert err == ""  # nothing reached the terminal behind the command's back
    transitions = re.findall(STAMP + r"(\w+(?:\[\d+\])?)\s+(running|success|skipped|failed|"
                             r"up_for_retry|upstream_failed)$", out, re.M)  # fmt: skip
    # one line per transition; the killed try: up_for_retry, why, and running again
    assert all(a != b for a, b in zip(transitions, transitions[1:], strict=False)), out
    tries = [state for task, state in transitions if task == "controller"]
    assert tries == ["running", "up_for_retry", "running", "success"], out
    why = out[out.index("controller       up_for_retry") :].splitlines()[1:4]
    assert "why (it will be retried)" in why[0] and why[1].startswith("  | "), out
    assert "preempted" in out or "SIGKILL" in out, out  # the job's fate, from the task's log
    before_retry = out[: out.index("controller       up_for_retry")]
    for internal in ("TaskInstance", "XCom", "xcom", "GitWildMatchPattern", "cryptography",
                     "PyTorch was not found", "DAG TEST", "Traceback"):  # fmt: skip
        assert internal not in before_retry, f"{internal!r} on the terminal:\n{out}"
    log_format = re.compile(r"\[(debug|info|warning|error)\s*\]|^\d{4}-\d\d-\d\d[T ]\d", re.M)
    assert not log_format.search(before_retry), out
    final = {task: state for task, state in transitions}
    for task in ("plan", "start_services", "controller", "evaluate", "report", "teardown",
                 "record_state"):  # fmt: skip
        assert final[task] == "success", out
    assert {final["ps"], final["trainer"], final["worker"]} == {"skipped"}  # colocated
    assert final["heldout"] == "skipped", out  # a cpu run without placement.evaluator
    assert set(final.values()) <= {"success", "skipped"}, out
    assert re.search(STAMP + r"step [1-8]/8  reward \d\.\d{3}  dropped \d+ stale  weights v\d",
                     out, re.M), out  # fmt: skip

    paths = run_paths(run_dir)
    with open(paths.lineage) as f:  # every step applied once, in order, across the kill
        lineage = [json.loads(line) for line in f]
    assert [r["step"] for r in lineage] == list(range(1, 9))
    consumed = [p for r in lineage for p in r["prompt_ids"]]
    assert len(consumed) == len(set(consumed)) == 8 * 4
    with open(paths.status) as f:
        status = json.load(f)
    assert status["state"] == "succeeded" and status["dag_id"] == "rlax_train"
    jobs = os.path.join(run_dir, "slices", "rlax-cli-trainer", "jobs")
    assert os.path.isdir(os.path.join(jobs, "controller.1"))  # the killed try, archived
    for name in os.listdir(jobs):  # teardown: no job of the run is left running
        with open(os.path.join(jobs, name, "runner.json")) as f:
            assert not psutil.pid_exists(json.load(f)["pid"]), name
    with open(paths.eval_results(8)) as f:
        after = json.load(f)["models"][0]["overall"]
    # the starting weights, evaluated alike before training (eval/v0) and cached in the run root
    with open(paths.eval_results(0)) as f:
        base = json.load(f)
    before = base["models"][0]["overall"]
    assert before["prompts"] == after["prompts"] == 16 and base["models"][0]["ks"] == [1, 4]
    (entry,) = os.listdir(os.path.join(runs, "base-evals"))
    with open(os.path.join(runs, "base-evals", entry, "results.json")) as f:
        assert json.load(f) == base
    assert sorted(os.listdir(jobs)) == ["controller", "controller.1", "evaluate", "evaluate-base"]
    for k in (1, 4):
        row = re.search(rf"^  held-out pass@{k}\s+(\S+)\s+(\S+)$", out, re.M)
        assert row, out
        assert row.group(2) == f"{after[f'pass@{k}']:.3f}"
        assert row.group(1) == f"{before[f'pass@{k}']:.3f}"
    assert re.search(r"^  training time\s+\d", out, re.M) and "after (v8)" in out
    assert re.search(rf"^  report\s+{re.escape(paths.report_md)}$", out, re.M), out  # DAG's report
    with open(paths.report_md) as f:
        assert f"| pass@1 | {before['pass@1']:.3f} | {after['pass@1']:.3f} |" in f.read()
    assert f"tensorboard --logdir {runs}" in out

    assert paths.airflow_log in out.splitlines()[1]  # where the logs went, said at the start
    with open(paths.airflow_log) as f:
        airflow_log = f.read()
    assert "[DAG TEST] starting task_id=plan" in airflow_log  # Airflow's own lines
    assert "job controller succeeded" in airflow_log  # and the tasks' logs
    train = EventAccumulator(os.path.join(paths.tb, "train"), size_guidance={"scalars": 0})
    train.Reload()  # every step in TensorBoard too, as in metrics.jsonl (the last kept once)
    assert [e.step for e in train.Scalars("reward_mean")] == list(range(1, 9))
    evals = EventAccumulator(os.path.join(paths.tb, "eval"))
    evals.Reload()
    assert [(e.step, round(e.value, 6)) for e in evals.Scalars("eval/pass@1")][-1] == (
        8,
        round(after["pass@1"], 6),
    )
