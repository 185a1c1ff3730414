"""The memory plan of a run on Cloud TPU slices (rlax_tasks/plan/slices.py, slice_memory_plan): the
trainer over every chip of the accelerator_type slice, the workers on a worker slice type (or
on the devices the config gives them), each checked against its family's HBM per chip, whatever
placement.accelerator says (unset, or the same family) — so a model that cannot fit a slice is
refused before anything is provisioned. The model's shapes come from a config.json written
here: no network."""

from __future__ import annotations

import json

import pytest

from rlax_tasks.config import load_config
from rlax_tasks.plan.slices import slice_fit_error, slice_memory_plan
from rlax_tasks.rundir import storage
from tests.plan.test_memory_plan import SMALL, GiB
from tests.plan.test_memory_plan import (
    P as P_SMALL,  # the small qwen2's parameters, counted by hand
)

# Qwen2.5-7B's shapes (its public config.json): 7,615,616,512 parameters
QWEN_7B = {
    "model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
    "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
    "vocab_size": 152064, "tie_word_embeddings": False, "max_position_embeddings": 32768,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
}  # fmt: skip
P_7B = 7_615_616_512


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    def refuse(path, *a, **k):  # every gs:// access goes through storage._blob
        raise AssertionError(f"the slice plan touched {path}")

    monkeypatch.setattr(storage, "_blob", refuse)


def model_dir(tmp_path, name, shapes):
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(shapes))
    return str(path)


def run_config(model_path: str, **extra):
    """tiny-arith (placement: cpu, no accelerator named) with float32 master weights and Adam,
    a KL term (the trainer holds a bf16 reference), 8 sequences a step in micro-batches of 4."""
    return load_config(
        "tiny-arith",
        {
            "model": {"path": model_path, "dtype": "bfloat16", "param_dtype": "float32",
                      "warmup_if_missing": False},
            "algorithm.overrides": {"kl_beta": 0.04},
            "rollout": {"prompts_per_step": 4, "group_size": 2, "max_new_tokens": 16},
            "trainer": {"micro_batch_size": 4, "remat": "full", "mesh_shape": [1, -1, 1]},
            "workers": {"count": 2, "slots": 8, "max_len": 64, "mesh_shape": [1, 1, -1]},
            "placement.mode": "disaggregated",  # (the tiny preset runs colocated)
            "placement": {"host_memory": "1TiB"},
            **extra,
        },
    )  # fmt: skip


def test_a_tiny_model_fits_a_v4_8_and_a_v4_16(tmp_path):
    cfg = run_config(model_dir(tmp_path, "small", SMALL))
    assert cfg.placement.accelerator is None  # nothing named: the slice decides
    one = slice_memory_plan(cfg, "v4-8")
    two = slice_memory_plan(cfg, "v4-16")
    for plan in (one, two):
        assert plan.fits and slice_fit_error(plan) is None
        assert plan.model.num_parameters() == P_SMALL
        assert (plan.cfg.placement.platform, plan.cfg.placement.accelerator) == ("tpu", "v4")
        assert [j.usable for j in plan.jobs] == [32 * GiB] * 3  # a v4 chip's HBM, every job
    # v4-8: one host of 4 chips; v4-16: 2 hosts × 4 chips, the trainer over all 8 (fsdp 8)
    trainer1, trainer2 = one.jobs[0], two.jobs[0]
    assert (one.cfg.trainer.hosts, trainer1.count, trainer1.devices) == (1, 4, "v4-8: 4 chips")
    assert (two.cfg.trainer.hosts, trainer2.count) == (2, 8)
    assert trainer2.devices == "v4-16: 4 chips × 2 hosts"
    assert trainer1.parts["params"] == P_SMALL * 4 // 4
    assert trainer2.parts["params"] == P_SMALL * 4 // 8
    assert "verdict: fits accelerator_type v4-16" in two.format()


def test_a_7b_model_does_not_fit_a_v5litepod_8_trainer_but_fits_a_v5litepod_16(tmp_path):
    cfg = run_config(model_dir(tmp_path, "qwen7b", QWEN_7B))
    small = slice_memory_plan(cfg, "v5litepod-8", "v5litepod-8")
    assert small.model.num_parameters() == P_7B
    trainer = small.jobs[0]
    # 8 chips, fsdp 8: float32 params 4P + Adam 8P + gradients 4P twice (2 micro-batches)
    # + the bf16 reference 2P = 22P/8 = 19.5 GiB per chip before any activation > 16 GiB
    assert trainer.count == 8 and trainer.usable == 16 * GiB
    parts = trainer.parts
    assert [parts[k] for k in ("params", "adam", "grads", "reference")] == [
        P_7B * 4 // 8, 2 * P_7B * 4 // 8, P_7B * 4 // 8 * 2, P_7B * 2 // 8,
    ]  # fmt: skip
    assert not small.fits and trainer.total > 16 * GiB
    line = slice_fit_error(small)
    assert "\n" not in line
    assert line.startswith("accelerator_type: v5litepod-8: trainer needs 20.0 GiB per chip (")
    assert "but a v5e chip has 16.0 GiB: use a larger accelerator_type" in line
    assert "(v5litepod-16 fits the trainer)" in line and "trainer.micro_batch_size" in line
    assert "worker" not in line.replace("workers.max_len", "")  # the workers fit their slice
    assert "trainer needs 20.0 GiB per device" in small.message()
    # v5litepod-16: 4 hosts × 4 chips, fsdp 16: 22P/16 = 9.75 GiB; activations (remat full; the
    # micro-batch of 4 does not split 16 ways: 4 sequences of 64 tokens) 4 × (28·2·64·3584 +
    # A = 13271040) = 104464384 B; logits 4 × 64 × 152064 × 4 B × 3 = 467140608 B
    big = slice_memory_plan(cfg, "v5litepod-16", "v5litepod-8")
    assert big.fits and slice_fit_error(big) is None
    assert big.jobs[0].count == 16 and big.cfg.trainer.hosts == 4
    assert big.jobs[0].total == 22 * P_7B // 16 + 104464384 + 467140608 < 16 * GiB


def test_workers_on_a_worker_slice_are_checked_against_its_chips(tmp_path):
    cfg = run_config(model_dir(tmp_path, "qwen7b", QWEN_7B))
    # the trainer on a v5p-8 (4 chips of 95 GiB: 22P/4 = 39 GiB fits); a worker on one chip
    # needs bf16 weights 2P = 14.2 GiB + the reload's largest array (28·3584·18944 · 2 B)
    # = 17.7 GiB, 17.8 with its KV cache and logits, and decode's own copy of the layers (every
    # weight but the embedding and lm head, 2·(P − 2·152064·3584 − 3584) B = 12.1 GiB): 29.9 GiB,
    # which fits a v5p chip (no worker type: the trainer's family) ...
    same = slice_memory_plan(cfg, "v5p-8")
    assert same.fits and [j.usable for j in same.jobs] == [95 * GiB] * 3
    worker = same.jobs[1]
    assert worker.count == 1 and worker.parts["weights"] == 2 * P_7B
    assert worker.parts["reload"] == 28 * 3584 * 18944 * 2
    assert worker.parts["decode_layers"] == 2 * (P_7B - 2 * 152064 * 3584 - 3584)
    # ... not a v5e chip of a v5litepod-1 worker slice, whose Param the line names
    tight = slice_memory_plan(cfg, "v5p-8", "v5litepod-1")
    assert [j.usable for j in tight.jobs] == [95 * GiB, 16 * GiB, 16 * GiB]
    assert not tight.fits and tight.jobs[0].total <= tight.jobs[0].usable
    line = slice_fit_error(tight)
    assert line.startswith(
        "worker_accelerator_type: v5litepod-1: worker-0 (and 1 other worker) needs 29.9 GiB per "
        "chip ("
    )
    without = run_config(cfg.model.path, **{
        "workers.decode_layer_copies": False})  # fmt: skip
    line_without = slice_fit_error(slice_memory_plan(without, "v5p-8", "v5litepod-1"))
    assert "needs 17.8 GiB per chip (" in line_without  # decode reads the stacked layers
    assert "but a v5e chip has 16.0 GiB: use a worker_accelerator_type with more chips" in line
    assert "(v5litepod-4: 4 chips a host fits a worker)" in line and "trainer" not in line
    # a v5litepod-4 host: 4 chips a worker, tensor 4: a quarter of the weights each
    roomy = slice_memory_plan(cfg, "v5p-8", "v5litepod-4")
    assert roomy.fits and [j.count for j in roomy.jobs] == [4, 4, 4]
    assert roomy.jobs[1].parts["weights"] == 2 * P_7B // 4
    assert roomy.jobs[1].devices == "v5litepod-4: 4 chips"


def test_the_config_passed_in_is_not_modified(tmp_path):
    cfg = run_config(model_dir(tmp_path, "small", SMALL))
    before = cfg.to_dict()
    plan = slice_memory_plan(cfg, "v4-16", "v5litepod-8")
    assert cfg.to_dict() == before
    assert (cfg.placement.platform, cfg.placement.accelerator) == ("cpu", None)
    assert cfg.trainer.hosts == 1
    assert plan.cfg is not cfg and plan.cfg.placement.platform == "tpu"
    assert (plan.cfg.placement.accelerator, plan.cfg.trainer.hosts) == ("v4", 2)


def test_a_placement_accelerator_of_another_family_is_refused(tmp_path):
    tpu = {
        "placement": {"platform": "tpu", "accelerator": "v4", "trainer": [0, 1, 2, 3],
                      "workers": [[4, 5], [6, 7]], "host_memory": "1TiB"},
    }  # fmt: skip
    cfg = run_config(model_dir(tmp_path, "small", SMALL), **tpu)
    with pytest.raises(ValueError, match=r"^placement.accelerator: is 'v4'") as info:
        slice_memory_plan(cfg, "v5litepod-8")
    assert "accelerator_type v5litepod-8 is a v5e slice" in str(info.value)
    with pytest.raises(ValueError, match="worker_accelerator_type v6e-4 is a v6e slice"):
        slice_memory_plan(cfg, "v4-8", "v6e-4")
    # the same family is no conflict; the workers keep the 2 chips the config gives each
    plan = slice_memory_plan(cfg, "v4-8")
    assert plan.fits and [j.count for j in plan.jobs] == [4, 2, 2]
    assert plan.jobs[1].devices == "2 chips of v4 (as configured)"
    # a GPU accelerator is another family too
    gpu = load_config("qwen2.5-math-1.5b-grpo")
    with pytest.raises(ValueError, match=r"^placement.accelerator: is 'h100-80gb'.* v5p slice"):
        slice_memory_plan(gpu, "v5p-8")


def test_a_config_the_slice_cannot_run_names_the_param_and_the_field(tmp_path):
    cfg = run_config(model_dir(tmp_path, "small", SMALL), **{"trainer.mesh_shape": [1, 4, 1]})
    with pytest.raises(ValueError, match=r"^accelerator_type: v4-16 \(8 chips, 2 hosts × 4 ch"):
        slice_memory_plan(cfg, "v4-16")
    with pytest.raises(ValueError, match="trainer.mesh_shape"):
        slice_memory_plan(cfg, "v4-16")
    assert slice_memory_plan(cfg, "v4-8").fits  # 4 chips: the mesh fits
    with pytest.raises(ValueError, match=r"^accelerator_type: accelerator type 'v9-8'"):
        slice_memory_plan(cfg, "v9-8")
