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


@pytest.mark.parametrize("command", ["ps", "controller", "worker", "verify"])
def test_the_jax_free_services_start_without_jax(command):
    """`rlax ps|controller|worker|verify` import only their own command's module: no JAX (the
    orchestrating processes leave the accelerators to the jobs that compute)."""
    code = (
        "import sys\nfrom rlax_tasks.cli import main\n"
        f"try:\n    main([{command!r}, '--help'])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in sys.modules if m == 'jax' or m.startswith('jax.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout[-2000:]


def test_every_command_registers_in_its_packages_cli_module():
    """Issue 74: one naming for the entry points. Each `rlax` command is registered by a
    ``rlax_tasks.<package>.cli`` module, with the register function its ``COMMANDS`` row names,
    which adds that command."""
    import argparse
    import importlib
    import re

    from rlax_tasks.cli import COMMANDS

    for command, (module, register) in COMMANDS.items():
        assert re.fullmatch(r"rlax_tasks\.[a-z_]+\.cli", module), (command, module)
        package = importlib.import_module(module.rsplit(".", 1)[0])
        assert hasattr(package, "__path__"), f"{command}: {package.__name__} is not a package"
        add = getattr(importlib.import_module(module), register, None)
        assert callable(add), f"{command}: {module} has no {register}"
        sub = argparse.ArgumentParser().add_subparsers()
        add(sub)
        assert command in sub.choices, f"{command}: {register} registers {list(sub.choices)}"


def test_rlax_help_lists_every_command():
    import argparse

    from rlax_tasks.cli import COMMANDS, build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert list(sub.choices) == list(COMMANDS)
    assert {"ps", "controller", "colocated", "trainer", "worker", "run"} <= set(COMMANDS)
