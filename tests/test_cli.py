"""The `rlax` console script: the demo runs end to end; user mistakes are one-line errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rlax_tasks.cli import main


def test_demo_builds_loads_and_generates(tmp_path, capsys):
    model_dir = tmp_path / "model"
    assert main(["demo", "--model-dir", str(model_dir), "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "building a tiny random Qwen2-shaped model" in out
    assert "generated 12 tokens" in out
    assert (model_dir / "config.json").exists() and (model_dir / "tokenizer.json").exists()
    # second run loads the existing directory instead of rebuilding it
    assert (
        main(["demo", "--model-dir", str(model_dir), "--prompt", "1+1=", "--max-new-tokens", "2"])
        == 0
    )
    out = capsys.readouterr().out
    assert "building" not in out and "'1+1=' ->" in out


def test_not_a_model_directory_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("not a model")
    assert main(["demo", "--model-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "has no config.json" in err and "Traceback" not in err


@pytest.mark.slow
def test_console_script_entry_point():
    out = subprocess.run(
        [sys.executable, "-m", "rlax_tasks.cli", "--help"], capture_output=True, text=True
    )
    assert out.returncode == 0 and "demo" in out.stdout


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
