"""`rlax doctor` on this CPU host: the devices and each job's kernel, a self-check that passes,
and exit 2 naming a check that fails."""

from __future__ import annotations

import re

import jax
import numpy as np

from rlax_tasks.cli import main
from rlax_tasks.models import transformer
from rlax_tasks.tools import doctor
from rlax_tasks.tools.reference_forward import qwen2_logits


def test_doctor_prints_the_cpu_devices_and_kernels_and_passes_its_self_check(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^platform cpu: 8 local device\(s\), 8 in all", out, re.M), out
    assert re.search(r"^  0: cpu \(host memory\)$", out, re.M), out
    assert re.search(r"^  colocated\s+cpu\s+mesh -\s+attention blocked$", out, re.M), out
    for check in ("logits", "train step", "decode step", "copy"):
        assert re.search(rf"^  {check}\s+ok\s", out, re.M), out
    # against the NumPy float64 forward: float32's rounding, never an exact zero
    diff = float(re.search(r"max \|cpu - numpy float64\| = (\S+)", out)[1])
    assert 0 < diff < 1e-5 and "GB/s" in out


def test_each_job_of_a_disaggregated_config_gets_its_devices_mesh_and_kernel(capsys):
    assert main(["doctor", "--preset", "qwen2.5-math-1.5b-grpo", "--no-self-check"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^  trainer\s+gpu .*attention cudnn$", out, re.M), out
    assert re.search(r"^  ps\s+cpu \(no accelerator\)$", out, re.M), out
    assert "(the placement's platform gpu is not the cpu found here)" in out
    assert "self-check" not in out


def test_the_reference_forward_is_qwen2(tmp_path):
    """The NumPy reference agrees with transformers' Qwen2 on the same weights, so the check
    against it tests the devices' kernels, not a second copy of ours."""
    from rlax_tasks.models import load_pretrained
    from tests.models.hf_models import hf_logits, tiny_hf_model

    hf = tiny_hf_model("qwen2")
    hf.save_pretrained(tmp_path)
    policy = load_pretrained(str(tmp_path))
    ids = np.random.default_rng(1).integers(3, policy.config.vocab_size, size=(2, 9))
    want = hf_logits(hf, ids, np.ones_like(ids))
    got = qwen2_logits(policy.config, policy.params, ids)
    assert np.abs(got - want).max() < 1e-4 * np.abs(want).max()


def test_a_failing_check_is_named_and_exits_2(capsys, monkeypatch):
    # the product's attention loses its rotary positions: the logits check must see it
    monkeypatch.setattr(transformer, "apply_rope", lambda x, cos, sin: x)

    def broken_copy() -> doctor.Check:
        raise RuntimeError("DMA engine on fire")

    monkeypatch.setattr(doctor, "_copy_check", broken_copy)

    def passed(name: str):  # the train and decode checks pass in the test above: no compiles
        return lambda policy, ids: doctor.Check(name, True, "not run in this test")

    monkeypatch.setattr(doctor, "_train_check", passed("train step"))
    monkeypatch.setattr(doctor, "_decode_check", passed("decode step"))
    jax.clear_caches()  # the forward traced by the test above had its positions
    try:
        assert main(["doctor"]) == 2
    finally:
        jax.clear_caches()  # nothing traced without them outlives this test
    captured = capsys.readouterr()
    assert re.search(r"^  logits\s+FAILED\s", captured.out, re.M), captured.out
    assert re.search(r"^  copy\s+FAILED\s+RuntimeError: DMA engine on fire$", captured.out, re.M)
    assert captured.err == "rlax doctor: failed: logits, copy\n"
