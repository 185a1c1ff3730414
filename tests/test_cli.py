"""The `rlax` console script: user mistakes are one-line errors, never a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rlax_tasks.cli import main


@pytest.mark.slow
def test_console_script_entry_point():
    out = subprocess.run(
        [sys.executable, "-m", "rlax_tasks.cli", "--help"], capture_output=True, text=True
    )
    assert out.returncode == 0 and "export" in out.stdout and "airflow" in out.stdout


def test_airflow_train_user_mistakes_are_one_line_errors(tmp_path, capsys):
    """`rlax airflow train` validates before it starts Airflow (the run itself is tested by
    tests/airflow_ops/test_airflow_train_cli.py)."""
    assert main(["airflow", "train", "--set", "rollout.group_size=0", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "rollout.group_size" in err and "Traceback" not in err
    home = str(tmp_path / "home")
    argv = ["airflow", "train", "--dags-folder", str(tmp_path), "--airflow-home", home]
    assert main([*argv, "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "no rlax_train.py there" in err and "Traceback" not in err


@pytest.mark.parametrize("steps", ["0", "-5"])
def test_rlax_run_steps_must_be_positive(steps, tmp_path, capsys):
    run_root = tmp_path / "runs"
    assert main(["run", "--run-root", str(run_root), "--steps", steps]) == 2
    err = capsys.readouterr().err
    assert (
        err
        == f"rlax run: error: --steps must be a positive number of training steps, got {steps}\n"
    )
    assert not run_root.exists()
