"""Loading a checkpoint logs parameters loaded / total, a line per tensor at interval 0."""

from __future__ import annotations

import logging
import re

import jax
import numpy as np
from safetensors import safe_open

from rlax_tasks.models import load_pretrained
from rlax_tasks.models.hf_io import write_hf
from rlax_tasks.models.policy import abstract_model
from rlax_tasks.utils.progress_meter import EVERY_ENV, format_si


def test_checkpoint_load_logs_parameters_loaded(tiny_config, tmp_path, monkeypatch, caplog):
    path = str(tmp_path / "model")
    _, abstract = abstract_model(tiny_config, "float32")  # zero weights: no initializers to run
    write_hf(path, tiny_config, jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), abstract),
             "float32")  # fmt: skip
    with safe_open(f"{path}/model.safetensors", framework="numpy") as f:
        tensors = len(list(f.keys()))
    monkeypatch.setenv(EVERY_ENV, "0")
    with caplog.at_level(logging.INFO, logger="rlax_tasks.models"):
        load_pretrained(path)
    total = format_si(tiny_config.num_parameters())
    prefix = re.escape(f"loading {path}: ")
    counts = re.findall(rf"{prefix}(\S+)/{re.escape(total)} params \(\d+%\) \S+/s eta", caplog.text)
    assert len(counts) == tensors and counts[-1] == total  # one line per tensor read
    assert re.search(rf"{prefix}{re.escape(total)}/{re.escape(total)} params done in", caplog.text)
