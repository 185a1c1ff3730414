"""`rlax doctor` on this CPU host: the devices and each job's kernel, a self-check that passes,
and exit 2 naming a check that fails."""

from __future__ import annotations

import re

from rlax_tasks.cli import main
from rlax_tasks.tools import doctor


def test_doctor_prints_the_cpu_devices_and_kernels_and_passes_its_self_check(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^platform cpu: 8 local device\(s\), 8 in all", out, re.M), out
    assert re.search(r"^  0: cpu \(host memory\)$", out, re.M), out
    assert re.search(r"^  colocated\s+cpu\s+mesh -\s+attention blocked$", out, re.M), out
    for check in ("logits", "train step", "decode step", "copy"):
        assert re.search(rf"^  {check}\s+ok\s", out, re.M), out
    assert "max |cpu - cpu| = 0.00e+00" in out and "GB/s" in out


def test_each_job_of_a_disaggregated_config_gets_its_devices_mesh_and_kernel(capsys):
    assert main(["doctor", "--preset", "qwen2.5-math-1.5b-grpo", "--no-self-check"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^  trainer\s+gpu .*attention cudnn$", out, re.M), out
    assert re.search(r"^  ps\s+cpu \(no accelerator\)$", out, re.M), out
    assert "(the placement's platform gpu is not the cpu found here)" in out
    assert "self-check" not in out


def test_a_failing_check_is_named_and_exits_2(capsys, monkeypatch):
    monkeypatch.setattr(doctor, "LOGITS_ATOL", -1.0)  # no difference is small enough

    def broken_copy() -> doctor.Check:
        raise RuntimeError("DMA engine on fire")

    monkeypatch.setattr(doctor, "_copy_check", broken_copy)

    def passed(name: str):  # the train and decode checks pass in the test above: no compiles
        return lambda policy, ids: doctor.Check(name, True, "not run in this test")

    monkeypatch.setattr(doctor, "_train_check", passed("train step"))
    monkeypatch.setattr(doctor, "_decode_check", passed("decode step"))
    assert main(["doctor"]) == 2
    captured = capsys.readouterr()
    assert re.search(r"^  logits\s+FAILED\s", captured.out, re.M), captured.out
    assert re.search(r"^  copy\s+FAILED\s+RuntimeError: DMA engine on fire$", captured.out, re.M)
    assert captured.err == "rlax doctor: failed: logits, copy\n"
