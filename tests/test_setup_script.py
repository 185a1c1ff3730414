"""scripts/setup.sh's accelerator flags and the pins behind them: the CUDA plugin and libtpu are
pinned at the pinned jax, so `--gpu` / `--tpu` install what CI's CPU build was tested with."""

from __future__ import annotations

import os
import re
import subprocess
import tomllib

import pytest

from tests.conftest import REPO


def _pins() -> dict[str, str]:
    with open(os.path.join(REPO, "constraints.txt")) as f:
        rows = [line.strip().split("==") for line in f if "==" in line]
    return {name.lower().replace("_", "-"): version for name, version in rows}


def test_the_accelerator_plugins_are_pinned_at_the_pinned_jax():
    pins = _pins()
    jax = pins["jax"]
    assert pins["jaxlib"] == pins["jax-cuda12-plugin"] == pins["jax-cuda12-pjrt"] == jax
    assert "libtpu" in pins and any(name.startswith("nvidia-cudnn") for name in pins)
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    assert extras["gpu"] == [f"jax[cuda12]=={jax}"] and extras["tpu"] == [f"jax[tpu]=={jax}"]


@pytest.mark.parametrize(
    ("flags", "says"),
    [(["--gpu", "--tpu"], "choose the accelerator"), (["--cuda"], "usage: bash scripts/setup.sh")],
)
def test_setup_refuses_flags_it_cannot_honour_before_installing_anything(flags, says):
    out = subprocess.run(
        ["bash", os.path.join(REPO, "scripts", "setup.sh"), *flags],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert out.returncode == 2 and says in out.stderr and out.stdout == "", out
    assert re.search(r"\[--gpu \| --tpu\]", out.stderr)
