"""The device run's deadline and summary, rehearsed with parts of its own (``--plan``): a part
that hangs past its share is stopped and every other part's figures stay; a signal mid-run
leaves the summary of what was measured; at most 4 files come back."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from tests.conftest import REPO

RUN = os.path.join(REPO, "benchmarks", "device_run.py")
WRITE = "import json, sys; json.dump({'figure': float(sys.argv[2])}, open(sys.argv[1], 'w'))"
HANG = (
    "import json, sys, time, os; json.dump({'partial': 1}, open(sys.argv[1], 'w')); "
    "open(sys.argv[2], 'w').write(str(os.getpid())); time.sleep(600)"
)


def _hang_in_a_child(json_arg: str, pid_file) -> list[str]:
    """A part whose hanging process is its leader's child (the leader alone is not the part)."""
    return ["bash", "-c", f'{sys.executable} -c "{HANG}" {json_arg} {pid_file} & wait']


def _plan(tmp_path, parts) -> str:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(parts))
    return str(path)


def _write(name: str, value: float, cap_s: float = 60) -> dict:
    return {
        "name": name,
        "cap_s": cap_s,
        "argv": [sys.executable, "-c", WRITE, "{json}", str(value)],
    }


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purpose
        return f.read().split(") ", 1)[1][0] != "Z"


def _summary(out) -> dict:
    return json.loads((out / "summary.json").read_text())


def test_a_part_that_hangs_past_its_share_loses_nothing_else(tmp_path):
    out, pid_file = tmp_path / "out", tmp_path / "hang.pid"
    plan = _plan(
        tmp_path,
        [
            _write("decode", 11929.0),
            {"name": "train", "cap_s": 3, "argv": _hang_in_a_child("{json}", pid_file)},
            _write("profile", 2.5),
            {"name": "doctor", "cap_s": 60, "argv": [sys.executable, "-c", "raise SystemExit(3)"]},
        ],
    )
    run = subprocess.run(
        [sys.executable, RUN, str(out), "--plan", plan, "--deadline-s", "120"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 1, run.stdout + run.stderr  # a part did not pass
    assert sorted(os.listdir(out)) == ["figures.json", "logs.tar.gz", "summary.json"]
    summary = _summary(out)
    status = {p["name"]: p["status"] for p in summary["parts"]}
    assert status == {
        "decode": "passed",
        "train": "timed out",
        "profile": "passed",
        "doctor": "failed",
    }
    assert summary["figures"]["decode"] == {"figure": 11929.0}
    assert summary["figures"]["profile"] == {"figure": 2.5}
    assert summary["figures"]["train"] == {"partial": 1}  # what it wrote before it hung
    train = next(p for p in summary["parts"] if p["name"] == "train")
    assert train["limit_s"] == 3 and train["seconds"] < 15
    assert not _alive(int(pid_file.read_text()))  # stopped, not left holding its device
    assert "not passed: train, doctor" in run.stdout


def test_each_part_is_capped_by_what_is_left_of_the_deadline(tmp_path):
    out = tmp_path / "out"
    slow = {
        "name": "train",
        "cap_s": 100,
        "argv": [sys.executable, "-c", "import time; time.sleep(600)"],
    }
    plan = _plan(tmp_path, [_write("decode", 1.0), slow, _write("profile", 2.0)])
    t0 = time.monotonic()
    run = subprocess.run(
        [sys.executable, RUN, str(out), "--plan", plan, "--deadline-s", "30"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert time.monotonic() - t0 < 45, run.stdout
    parts = {p["name"]: p for p in _summary(out)["parts"]}
    assert parts["train"]["status"] == "timed out" and parts["train"]["limit_s"] < 30
    assert parts["profile"]["status"] == "skipped"  # nothing left: said so, not run
    assert "left of the deadline" in parts["profile"]["why"]


def _start_with_a_hang(tmp_path, figure: float) -> tuple[subprocess.Popen, object, int]:
    """A run of a part that writes ``figure``, then one that hangs: (the run, its OUT_DIR, the
    hanging part's pid), once that part has started."""
    out, pid_file = tmp_path / "out", tmp_path / "hang.pid"
    hang = {"name": "train", "cap_s": 300,
            "argv": [sys.executable, "-c", HANG, "{json}", str(pid_file)]}  # fmt: skip
    plan = _plan(tmp_path, [_write("decode", figure), hang])
    proc = subprocess.Popen([sys.executable, RUN, str(out), "--plan", plan],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 60
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pid_file.exists(), f"the hanging part did not start (run exit {proc.poll()})"
    time.sleep(0.3)  # its pid is written: so is the summary of the part before
    return proc, out, int(pid_file.read_text())


def test_a_signal_mid_run_leaves_the_summary_of_what_was_measured(tmp_path):
    proc, out, pid = _start_with_a_hang(tmp_path, 7.0)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 128 + signal.SIGTERM
    summary = _summary(out)
    assert summary["interrupted"] == "SIGTERM" and not summary["complete"]
    assert summary["figures"]["decode"] == {"figure": 7.0}
    assert sorted(os.listdir(out)) == ["figures.json", "logs.tar.gz", "summary.json"]
    assert not _alive(pid)


def test_a_run_killed_outright_keeps_the_summary_of_the_parts_before(tmp_path):
    """SIGKILL (a command past its time): summary.json was rewritten after each part, and the
    part under way dies with the run."""
    proc, out, pid = _start_with_a_hang(tmp_path, 24562.0)
    proc.kill()
    proc.wait(30)
    summary = _summary(out)
    assert summary["figures"]["decode"] == {"figure": 24562.0}
    assert [p["name"] for p in summary["parts"]] == ["decode"] and not summary["complete"]
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid)


def test_a_plan_without_a_field_is_refused_naming_it(tmp_path):
    plan = _plan(tmp_path, [{"name": "decode", "argv": ["true"]}])
    run = subprocess.run(
        [sys.executable, RUN, str(tmp_path / "out"), "--plan", plan],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode != 0
    assert run.stderr.strip().splitlines()[-1] == f"--plan {plan}: part 0 has no cap_s"
