"""The memory plan (rlax_tasks/plan/memory_plan.py): numbers for a small model computed by hand,
`rlax run --dry-run` on the real presets (no network), and a plan that cannot fit refused by
`rlax run` and by the DAG's plan before anything starts."""

from __future__ import annotations

import json

import pytest

from rlax_tasks.cli import main
from rlax_tasks.config import load_config
from rlax_tasks.plan.memory_plan import PlanDoesNotFit, memory_plan, ps_retention
from rlax_tasks.plan.model_shapes import resolve_model
from rlax_tasks.rundir import storage

MiB, GiB = 2**20, 2**30
# qwen2: hidden 64, intermediate 128, 2 layers, 4 heads / 2 KV of 16, vocabulary 256, untied.
# Parameters by hand: attention 64·64 + 2·64·32 + 64·64 = 12288, q/k/v bias 64 + 2·32 = 128,
# MLP 3·64·128 = 24576, two norms 128: 37120 a layer; 2 layers 74240 + embeddings and head
# 2·256·64 = 32768 + final norm 64 = 107072.
SMALL = {
    "model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256,
    "tie_word_embeddings": False,
}  # fmt: skip
P = 107072


@pytest.fixture
def small_model(tmp_path):
    path = tmp_path / "small"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(SMALL))
    return str(path)


def small_config(model_path: str, **extra):
    return load_config(
        "tiny-arith",
        {
            "model": {"path": model_path, "dtype": "bfloat16", "param_dtype": "float32",
                      "warmup_if_missing": False},
            "algorithm.overrides": {"kl_beta": 0.04},  # a KL term: the trainer holds a reference
            "rollout": {"prompts_per_step": 4, "group_size": 2, "max_new_tokens": 16},
            "staleness": {"reload_every": 1, "max_staleness": 2},  # k + 2 = 4 versions wanted
            "trainer": {"micro_batch_size": 4, "remat": "none", "mesh_shape": [1, -1, 1]},
            "workers": {"count": 1, "slots": 8, "max_len": 64, "mesh_shape": [1, 1, -1]},
            "placement": {"mode": "disaggregated", "platform": "gpu",
                          "accelerator": "h100-80gb", "trainer": [0, 1],
                          "workers": [[2, 3]], "host_memory": "1GiB"},
            **extra,
        },
    )  # fmt: skip


def test_memory_of_a_small_model_by_hand(small_model):
    plan = memory_plan(small_config(small_model))
    assert plan.model.num_parameters() == P
    trainer, worker = plan.jobs
    # trainer: 2 GPUs, mesh (1, 2, 1): fsdp 2 shards; float32 master weights
    # activations: micro-batch 4 over data×fsdp 2 = 2 sequences of T = 64 tokens, bf16 (2 B):
    #   per token 2·(4·64 + 2·4·16 + 2·2·16 + 4·128) = 2·960; T·that = 122880
    #   scores 4 heads × min(64², 64·192/2) = 4096 × (4 + 2) B = 98304; A = 221184 a layer
    #   remat none: 2 layers × A × 2 sequences = 884736
    # logits: 2 sequences × chunk min(128, 64) × 256 × 4 B × 3 = 393216 (on GPUs none are kept
    #   for the backward unless trainer.keep_logits_mb says)
    assert trainer.parts == {
        "params": P * 4 // 2,
        "reference": P * 2 // 2,  # the frozen reference in the compute dtype
        "adam": 2 * P * 4 // 2,
        "grads": P * 4 // 2 * 2,  # 2 micro-batches of the 8 sequences: running sum + own
        "activations": 884736,
        "logits": 393216,
    }
    # worker: 2 GPUs, mesh (1, 1, 2): tensor 2; bf16 weights, plus the largest array while a
    # reload swaps arrays in place: max(V·h = 256·64, L·h·f = 2·64·128) · 2 B / 2
    # KV cache 8 slots × 64 × 2 layers × 2 (k, v) × 2 KV heads × 16 × 2 B = 131072, KV heads / 2
    # decode's own copy of the layers: every parameter but the embedding, lm head, final norm
    assert worker.parts == {
        "weights": P * 2 // 2,
        "reload": 2 * 64 * 128 * 2 // 2,
        "decode_layers": (P - 2 * 256 * 64 - 64) * 2 // 2,
        "kv_cache": 131072 // 2,
        "logits": 8 * (256 // 2) * 4 * 2,
    }
    assert trainer.usable == worker.usable == int(81559 * MiB * 0.9)
    # parameter server: a bf16 version is 2·P; k + 2 = 4 versions in 25% of 1 GiB
    assert (plan.ps.version_bytes, plan.ps.keep_versions, plan.ps.keep_bytes) == (
        2 * P,
        4,
        GiB // 4,
    )
    assert plan.fits


@pytest.mark.parametrize(
    ("remat", "activations"),
    [
        # layer inputs kept (2·2·64·64 a layer... 2 layers: 16384) + one layer recomputed (A)
        ("full", 2 * (2 * 2 * 64 * 64 + 221184)),
        # matmul outputs kept: 2 B × 64 × (3·64 + 64 + 2·32 + 2·128) × 2 layers + A
        ("dots", 2 * (2 * 2 * 64 * (3 * 64 + 64 + 64 + 256) + 221184)),
    ],
)
def test_remat_keeps_less(small_model, remat, activations):
    plan = memory_plan(small_config(small_model, **{"trainer.remat": remat}))
    assert plan.jobs[0].parts["activations"] == activations


def test_logits_kept_for_the_backward_count_only_when_they_fit_the_budget(small_model, monkeypatch):
    from rlax_tasks.plan.placement import ACCELERATORS, Accelerator

    # the micro-batch's logits are 4 × 64 × 256 × 4 B = 256 KiB: a 1 MiB budget keeps them,
    # 2 sequences × 64 × 256 × 4 B per device; 0 recomputes them; unset on GPUs: 0
    def logits(**settings: object) -> int:
        return memory_plan(small_config(small_model, **settings)).jobs[0].parts["logits"]

    assert logits(**{"trainer.keep_logits_mb": 1}) == 393216 + 2 * 64 * 256 * 4
    assert logits(**{"trainer.keep_logits_mb": 0}) == logits() == 393216
    # and a trainer that does not fit is told it may recompute them
    monkeypatch.setitem(ACCELERATORS, "h100-80gb", Accelerator("h100-80gb", "gpu", MiB))
    tight = memory_plan(small_config(small_model, **{"trainer.keep_logits_mb": 1}))
    with pytest.raises(PlanDoesNotFit, match="trainer.keep_logits_mb: 0"):
        tight.check()


def test_parameter_server_keeps_what_fits_its_budget(small_model):
    # a bf16 version is 214144 B; keep_bytes also counts a push in flight
    # 25% of 4,000,000 B = 1000000: 4 versions fit, 3 kept beside a push (k + 2 = 4 wanted)
    cfg = small_config(small_model, **{"placement.host_memory": 4_000_000})
    ps = ps_retention(cfg, memory_plan(cfg).model)
    assert (ps.keep_versions, ps.keep_bytes) == (3, 1_000_000)
    assert ps.argv() == ["--keep-versions", "3", "--keep-bytes", "1000000"]
    # 500000 B: the newest + a push fit (the PS's minimum), 2 kept + a push do not: a warning
    roomy = memory_plan(small_config(small_model, **{"placement.host_memory": 2_000_000}))
    assert roomy.ps.keep_versions == 2 and roomy.fits
    assert "a push waits for the workers' acks" in roomy.warnings[0]
    # 250000 B holds one version: the PS would refuse it, and the plan does not fit
    tight = memory_plan(small_config(small_model, **{"placement.host_memory": 1_000_000}))
    assert tight.ps.keep_versions == 2 and not tight.fits
    assert "ps needs 418.2 KiB of host RAM for the newest version and a push" in tight.message()
    assert "set placement.host_memory" in tight.message()


def test_a_job_that_does_not_fit_names_itself_and_the_fix(small_model, monkeypatch):
    from rlax_tasks.plan.placement import ACCELERATORS, Accelerator

    # an accelerator of 1 MiB: 0.9 MiB usable; the trainer needs 2.3 MiB, the worker 0.27
    monkeypatch.setitem(ACCELERATORS, "h100-80gb", Accelerator("h100-80gb", "gpu", MiB))
    plan = memory_plan(small_config(small_model))
    assert [j.job for j in plan.jobs if j.total > j.usable] == ["trainer"]
    with pytest.raises(PlanDoesNotFit) as info:
        plan.check()
    text = str(info.value)
    assert text.startswith("the memory plan does not fit:\n- trainer needs 2.3 MiB per device")
    assert "but has 921.6 KiB (0.9 of h100-80gb's 1.0 MiB)" in text
    assert "placement.trainer" in text and "trainer.micro_batch_size" in text
    assert "trainer.remat: full" in text and "worker" not in text.replace("workers.max_len", "")


def test_model_shapes_come_from_a_known_table_or_a_given_config(small_model, tmp_path):
    cfg = load_config("qwq-32b-code")
    model, source = resolve_model(cfg)
    assert model.num_parameters() == 32_763_876_352 and "known shapes of QwQ-32B" in source
    cfg = load_config("qwen2.5-math-1.5b-grpo", {"model.path": "gs://bucket/my-model"})
    with pytest.raises(ValueError, match=r"^model.path: gs://bucket/my-model/config.json cannot"):
        resolve_model(cfg)
    model, source = resolve_model(cfg, model_config=small_model + "/config.json")
    assert model.num_parameters() == P and source.endswith("config.json")
    # a packaged model not imported yet, into a directory of any name
    cfg = load_config("smollm2-arith", {"model.path": str(tmp_path / "my-base")})
    model, source = resolve_model(cfg)
    assert model.num_hidden_layers == 30 and "known shapes of smollm2-135m-instruct" in source


# --------------------------------------------------------------------------- rlax run --dry-run
@pytest.fixture
def no_network(monkeypatch):
    def refuse(path, *a, **k):  # every gs:// access goes through storage._blob
        raise AssertionError(f"--dry-run touched {path}")

    monkeypatch.setattr(storage, "_blob", refuse)


@pytest.mark.parametrize(
    ("preset", "lines"),
    [
        (
            "qwen2.5-math-1.5b-grpo",
            ["trainer     gpu 0-3", "worker-0    gpu 4 ", "worker-3    gpu 7 ", "ps          cpu"],
        ),
        (
            "qwq-32b-code",
            ["trainer     gpu 0-3 × 8 hosts  1,8,4", "worker-7    gpu 4-7 of host 7  1,1,4"],
        ),
    ],
)
def test_dry_run_prints_each_job_its_devices_and_gib_per_device(preset, lines, capsys, no_network):
    assert main(["run", "--preset", preset, "--dry-run"]) == 0
    out = capsys.readouterr().out
    for line in lines:
        assert line in out, out
    assert "memory per device (GiB" in out and "from the known shapes of" in out
    table = out[out.index("memory per device") :].splitlines()
    for job in ("trainer", "worker-0"):
        row = next(r for r in table if r.strip().startswith(job))
        assert row.rstrip().endswith("71.68   yes"), row  # usable 0.9 × h100-80gb per device
    assert "--keep-bytes 435.9 GiB" in out and "verdict: fits h100-80gb" in out


@pytest.mark.parametrize(
    ("preset", "experts", "fits"),
    [("qwen3-30b-a3b-grpo-gpu", "128 experts split 4 way(s)", "verdict: fits h200"),
     ("qwen3-30b-a3b-grpo-tpu", "128 experts split 8 way(s)", "verdict: fits v5p"),
     ("qwen3-235b-a22b-grpo-gpu", "128 experts split 16 way(s)", "verdict: fits h200")],
)  # fmt: skip
def test_the_moe_presets_plan_their_experts_and_fit(preset, experts, fits, capsys, no_network):
    """Each MoE preset's --dry-run: the experts split over the expert axis, the dispatch
    buffers counted, a plan that fits; without the expert axis the 30B one does not."""
    assert main(["run", "--preset", preset, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "model: qwen3_moe" in out and experts in out and fits in out, out
    assert " dispatch " in out  # the experts' dispatch buffers, a column of the table
    # the same GPU run with the experts only over fsdp 2: each GPU holds 64 experts a layer
    argv = ["run", "--preset", "qwen3-30b-a3b-grpo-gpu", "--dry-run"]
    assert main([*argv, "--set", "trainer.mesh_shape=[1,2,1,1]", "--set",
                 "placement.trainer=[0,1]", "--set", "workers.mesh_shape=[1,1,2,1]"]) == 2
    assert "verdict: DOES NOT FIT" in capsys.readouterr().out


def test_a_held_out_evaluation_on_its_own_gpu_is_planned_there(capsys, no_network):
    """placement.evaluator [7] beside worker-3 on GPU 7: a row of the placement table and of
    the memory plan, each of the two with half of the 0.9 of GPU 7."""
    argv = ["run", "--preset", "qwen2.5-math-1.5b-grpo", "--dry-run"]
    assert main([*argv, "--set", "placement.evaluator=[7]"]) == 0
    out = capsys.readouterr().out
    assert "  heldout     gpu 7 " in out and "XLA_PYTHON_CLIENT_MEM_FRACTION=0.45" in out
    table = out[out.index("memory per device") :].splitlines()
    for job in ("heldout", "worker-3"):
        row = next(r for r in table if r.strip().startswith(job))
        assert row.rstrip().endswith("35.84   yes"), row  # 0.45 × h100-80gb
    # on GPU nodes it runs on host 0
    assert main(["run", "--preset", "qwq-32b-code", "--dry-run", "--set",
                 "placement.evaluator=[7]"]) == 2  # fmt: skip
    out = capsys.readouterr()
    assert "  heldout     gpu 7 of host 0 " in out.out
    assert "give the held-out evaluation more devices (placement.evaluator)" in out.err


def test_a_plan_that_cannot_fit_exits_2_before_anything_starts(tmp_path, capsys, no_network):
    one_gpu = [
        "--set", "placement={hosts: 1, trainer: [0], workers: [[0]]}",
        "--set", "workers.count=1", "--set", "trainer.mesh_shape=[1,1,1]",
        "--run-root", str(tmp_path / "runs"),
    ]  # fmt: skip
    assert main(["run", "--preset", "qwq-32b-code", "--dry-run", *one_gpu]) == 2
    captured = capsys.readouterr()
    assert "verdict: DOES NOT FIT" in captured.out
    err = captured.err
    assert "the memory plan does not fit" in err and "Traceback" not in err
    assert "trainer needs 1.1 TiB per device" in err and "but has 35.8 GiB" in err
    assert "0.45 of h100-80gb" in err  # the trainer and the worker share GPU 0
    assert "trainer.micro_batch_size" in err and "workers.slots" in err
    # without --dry-run `rlax run` refuses it too, before it writes or starts anything
    assert main(["run", "--preset", "qwq-32b-code", "--steps", "1", *one_gpu]) == 2
    assert "the memory plan does not fit" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_the_dag_plan_refuses_it_too(tmp_path, no_network):
    from rlax_tasks.airflow.plan_task import plan_training
    from rlax_tasks.plan.slices import PlanError

    params = {
        "preset": "qwq-32b-code", "run_root": str(tmp_path / "runs"), "steps": 4,
        "overrides": {"placement": {"hosts": 1, "trainer": [0], "workers": [[0]]},
                      "workers.count": 1, "trainer.mesh_shape": [1, 1, 1]},
    }  # fmt: skip
    with pytest.raises(PlanError, match="the memory plan does not fit") as info:
        plan_training(params, "manual__qwq")
    assert "trainer needs 1.1 TiB per device" in str(info.value)
    assert not (tmp_path / "runs").exists()
