"""`rlax export RUN_DIR[@STEP] OUT_DIR`: a trainer checkpoint becomes an HF directory that
transformers loads with the logits the trained policy had; user mistakes are one-line errors."""

from __future__ import annotations

import dataclasses
import filecmp
import json
import logging
import os
import shutil

import numpy as np
import pytest
from safetensors import safe_open

from rlax_tasks.cli import main
from rlax_tasks.config import load_config, save_resolved
from rlax_tasks.tools.export import ExportError, export_checkpoint, parse_run_spec
from tests.trainer.helpers import random_batch

PROBE = np.random.default_rng(7).integers(0, 64, (2, 12)).astype(np.int32)
STEPS = 2


@dataclasses.dataclass
class Run:
    run_dir: str
    base: str
    logits: dict[int, np.ndarray]  # step -> our float32 logits of PROBE at that step


def _config(root: str, run_id: str, base: str, preset: str, **trainer):
    return load_config(
        "tiny-arith",
        {
            "run_root": root,
            "run_id": run_id,
            "model": {"path": base, "warmup_if_missing": False},
            "algorithm": {"preset": preset, "overrides": {"kl_beta": 0.0}},
            "trainer": {
                "learning_rate": 1e-2,
                "warmup_steps": 0,
                "total_steps": None,
                "mesh_shape": [1, 2, 2],  # checkpoints sharded over a mesh the export never builds
                "checkpoint_every": 1,
                **trainer,
            },
        },
    )


def _train(cfg, policy, probe_policy) -> dict[int, np.ndarray]:
    """Trains STEPS steps with the Trainer (a checkpoint per step); our logits after each."""
    from rlax_tasks.algorithms import make_objective
    from rlax_tasks.trainer.trainer import Trainer

    save_resolved(cfg)
    objective = make_objective(cfg.algorithm.preset, **cfg.objective_overrides())
    logits = {}
    with Trainer(policy, objective, cfg.trainer, cfg.run_dir) as trainer:
        for step in range(1, STEPS + 1):
            trainer.step(random_batch(step))
            logits[step] = probe_policy(trainer.policy())
        trainer.wait_for_checkpoint()
    return logits


@pytest.fixture(scope="module")
def qwen_run(tmp_path_factory, chat_model_dir) -> Run:
    """Qwen2 (qkv bias, untied head, chat tokenizer), float32, GRPO, checkpoints of steps 1, 2;
    its base config.json carries a key our ModelConfig does not model."""
    from rlax_tasks.models import load_pretrained

    root = tmp_path_factory.mktemp("qwen")
    base = str(root / "base")
    shutil.copytree(chat_model_dir, base)
    with open(os.path.join(base, "config.json")) as f:
        raw = json.load(f)
    with open(os.path.join(base, "config.json"), "w") as f:
        json.dump({**raw, "custom_key": {"kept": True}}, f)
    cfg = _config(str(root / "runs"), "qwen", base, "grpo")
    logits = _train(cfg, load_pretrained(base), lambda p: np.asarray(p.logits(PROBE)))
    return Run(cfg.run_dir, base, logits)


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory) -> Run:
    """Llama with tied embeddings and no tokenizer, bfloat16 master weights, PPO (value head)."""
    import jax

    from rlax_tasks.models import Policy, load_pretrained
    from tests.tiny_model import tiny_model_config

    root = tmp_path_factory.mktemp("llama")
    base = str(root / "base")
    config = tiny_model_config(model_type="llama", qkv_bias=False, tie_word_embeddings=True)
    Policy.init(config, seed=1).save_pretrained(base)
    reference = load_pretrained(base, dtype="float32")

    def probe(policy) -> np.ndarray:  # the trained bfloat16 weights, computed in float32
        weights = jax.tree.map(lambda a: np.asarray(a).astype(np.float32), policy.params)
        return np.asarray(reference.with_params(weights).logits(PROBE))

    cfg = _config(str(root / "runs"), "llama", base, "ppo")
    logits = _train(cfg, load_pretrained(base, dtype="bfloat16"), probe)
    return Run(cfg.run_dir, base, logits)


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory) -> Run:
    """Qwen3-MoE (4 experts, 2 per token), float32, GRPO, trained on an expert mesh (expert 2 ×
    fsdp 2): its checkpoints hold the stacked, expert-sharded expert weights."""
    from rlax_tasks.models import ModelConfig, Policy, load_pretrained

    root = tmp_path_factory.mktemp("moe")
    base = str(root / "base")
    config = ModelConfig(model_type="qwen3_moe", vocab_size=64, hidden_size=32,
                         intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, qk_norm=True, num_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=16)  # fmt: skip
    Policy.init(config, seed=2).save_pretrained(base)
    cfg = _config(str(root / "runs"), "moe", base, "grpo", mesh_shape=[1, 2, 2, 1])
    logits = _train(cfg, load_pretrained(base), lambda p: np.asarray(p.logits(PROBE)))
    return Run(cfg.run_dir, base, logits)


def _hf_logits(path: str) -> np.ndarray:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return model(input_ids=torch.tensor(PROBE, dtype=torch.long)).logits.numpy()


def _tensors(path: str) -> dict[str, np.ndarray]:
    import torch

    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k).to(torch.float32).numpy() for k in f.keys()}  # noqa: SIM118


def _dtypes(path: str) -> set[str]:
    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        return {str(f.get_tensor(k).dtype) for k in f.keys()}  # noqa: SIM118


def _export(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["export", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


# ------------------------------------------------------------------------------ the export
def test_newest_and_earlier_steps_load_in_transformers_with_the_trained_logits(
    qwen_run, tmp_path, capsys
):
    assert np.abs(qwen_run.logits[1] - qwen_run.logits[2]).max() > 1e-3  # the steps differ
    newest, first = str(tmp_path / "newest"), str(tmp_path / "first")
    code, out, _ = _export(capsys, qwen_run.run_dir, newest)
    assert code == 0 and f"exported step {STEPS}" in out and "(float32)" in out
    assert _export(capsys, f"{qwen_run.run_dir}@1", first)[0] == 0

    np.testing.assert_allclose(_hf_logits(newest), qwen_run.logits[STEPS], atol=1e-4, rtol=0)
    np.testing.assert_allclose(_hf_logits(first), qwen_run.logits[1], atol=1e-4, rtol=0)
    # same tensors as the base model, but trained
    base, trained = _tensors(qwen_run.base), _tensors(newest)
    assert set(trained) == set(base) and "lm_head.weight" in trained
    assert max(np.abs(trained[k] - base[k]).max() for k in base) > 1e-3
    assert _dtypes(newest) == {"torch.float32"}
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # no staging left


def test_a_moe_run_exports_per_expert_tensors_transformers_loads(moe_run, tmp_path, capsys):
    out = str(tmp_path / "moe")
    assert _export(capsys, moe_run.run_dir, out)[0] == 0
    np.testing.assert_allclose(_hf_logits(out), moe_run.logits[STEPS], atol=1e-4, rtol=0)
    base, trained = _tensors(moe_run.base), _tensors(out)
    assert set(trained) == set(base) and "model.layers.1.mlp.experts.3.down_proj.weight" in base
    assert max(np.abs(trained[k] - base[k]).max() for k in base if ".experts." in k) > 1e-3


def test_big_models_are_written_in_shards_with_an_index(qwen_run, tmp_path):
    from rlax_tasks.models import load_pretrained

    out = str(tmp_path / "sharded")
    export_checkpoint(qwen_run.run_dir, out, max_shard_bytes=40_000)
    shards = sorted(n for n in os.listdir(out) if n.endswith(".safetensors"))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        assert set(json.load(f)["weight_map"].values()) == set(shards)
    assert not [n for n in os.listdir(out) if n.endswith(".partial")]
    np.testing.assert_allclose(_hf_logits(out), qwen_run.logits[STEPS], atol=1e-4, rtol=0)
    ours = np.asarray(load_pretrained(out).logits(PROBE))  # HF out is HF in again
    np.testing.assert_allclose(ours, qwen_run.logits[STEPS], atol=1e-5, rtol=0)


def test_the_base_models_config_tokenizer_and_generation_config_are_kept(
    qwen_run, tmp_path, capsys
):
    from transformers import AutoTokenizer

    out = str(tmp_path / "hf")
    assert _export(capsys, qwen_run.run_dir, out)[0] == 0
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    assert config["custom_key"] == {"kept": True} and config["torch_dtype"] == "float32"
    copied = ["generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    match, mismatch, errors = filecmp.cmpfiles(qwen_run.base, out, copied, shallow=False)
    assert match == copied, (mismatch, errors)
    text = "Natalia sold 48/2 = 24 clips"
    tok, base_tok = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(qwen_run.base)
    assert tok(text)["input_ids"] == base_tok(text)["input_ids"]
    assert tok.chat_template == base_tok.chat_template is not None


def test_dtype_bfloat16_writes_bfloat16_safetensors(qwen_run, tmp_path, capsys):
    f32, bf16 = str(tmp_path / "f32"), str(tmp_path / "bf16")
    assert _export(capsys, qwen_run.run_dir, f32)[0] == 0
    code, out, _ = _export(capsys, qwen_run.run_dir, bf16, "--dtype", "bfloat16")
    assert code == 0 and "(bfloat16)" in out
    assert _dtypes(bf16) == {"torch.bfloat16"}
    with open(os.path.join(bf16, "config.json")) as f:
        assert json.load(f)["torch_dtype"] == "bfloat16"
    import ml_dtypes

    want = {k: v.astype(ml_dtypes.bfloat16).astype(np.float32) for k, v in _tensors(f32).items()}
    got = _tensors(bf16)
    assert all(np.array_equal(got[k], want[k]) for k in want)


def test_tied_embeddings_bfloat16_master_weights_and_a_value_head(llama_run, tmp_path, caplog):
    """Default dtype = the checkpoint's (bfloat16 here); the PPO value head is left out."""
    default, f32 = str(tmp_path / "default"), str(tmp_path / "f32")
    with caplog.at_level(logging.INFO, logger="rlax_tasks.tools.export"):
        result = export_checkpoint(llama_run.run_dir, default)
    assert (result.step, result.dtype) == (STEPS, "bfloat16")
    assert "value head" in caplog.text and "left out" in caplog.text
    assert _dtypes(default) == {"torch.bfloat16"}
    names = set(_tensors(default))
    assert "lm_head.weight" not in names and not [n for n in names if "value" in n]
    assert "the export has none either" in caplog.text  # no tokenizer in this base model

    assert export_checkpoint(llama_run.run_dir, f32, step=1, dtype="float32").step == 1
    np.testing.assert_allclose(_hf_logits(f32), llama_run.logits[1], atol=1e-4, rtol=0)


def test_relative_paths_of_the_run_resolve_from_where_it_was_started(
    qwen_run, tmp_path, monkeypatch
):
    """run_root and model.path relative (as in the presets): exported from another directory."""
    launch = tmp_path / "project"
    shutil.copytree(qwen_run.base, launch / "models" / "base")
    monkeypatch.chdir(launch)
    checkpoints = os.path.join(qwen_run.run_dir, "checkpoints")
    cfg = _config("runs", "rel", "models/base", "grpo", checkpoint_dir=checkpoints)
    save_resolved(cfg)
    monkeypatch.chdir(tmp_path)
    result = export_checkpoint(str(launch / "runs" / "rel"), "out")
    assert result.step == STEPS and os.path.exists(tmp_path / "out" / "model.safetensors")
    # RUN_DIR and its checkpoints relative, as in `rlax export runs/own out` (Orbax refuses those)
    monkeypatch.chdir(launch)
    save_resolved(_config("runs", "own", "models/base", "grpo"))
    shutil.copytree(checkpoints, launch / "runs" / "own" / "checkpoints")
    result = export_checkpoint(os.path.join("runs", "own"), "out2")
    assert result.step == STEPS and os.path.exists(launch / "out2" / "model.safetensors")


# ------------------------------------------------------------------------------ atomicity
def test_a_failed_export_leaves_out_dir_as_it_was(qwen_run, tmp_path, monkeypatch):
    from rlax_tasks.models import hf_io

    def broken(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(hf_io, "write_hf_config", broken)  # after every tensor was written
    out = tmp_path / "hf"
    with pytest.raises(RuntimeError, match="disk full"):
        export_checkpoint(qwen_run.run_dir, str(out))
    assert os.listdir(tmp_path) == []  # no OUT_DIR, no staging directory
    out.mkdir()
    (out / "keep.txt").write_text("old export")
    with pytest.raises(RuntimeError, match="disk full"):
        export_checkpoint(qwen_run.run_dir, str(out), overwrite=True)
    assert os.listdir(tmp_path) == ["hf"] and os.listdir(out) == ["keep.txt"]


def test_overwrite_replaces_a_non_empty_out_dir(qwen_run, tmp_path, capsys):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "old.txt").write_text("old")
    code, _, err = _export(capsys, qwen_run.run_dir, str(out))
    assert code == 2 and "exists and is not empty" in err and "--overwrite" in err
    assert os.listdir(out) == ["old.txt"]
    assert _export(capsys, qwen_run.run_dir, str(out), "--overwrite")[0] == 0
    assert "old.txt" not in os.listdir(out) and (out / "model.safetensors").exists()
    assert sorted(os.listdir(tmp_path)) == ["hf"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _export(capsys, qwen_run.run_dir, str(empty))[0] == 0  # an empty OUT_DIR is fine


# ------------------------------------------------------------------------------ user mistakes
def test_parse_run_spec():
    assert parse_run_spec("runs/a") == ("runs/a", None)
    assert parse_run_spec("runs/a@20") == ("runs/a", 20)
    assert parse_run_spec("runs/x@y/a") == ("runs/x@y/a", None)  # an @ inside a directory name
    for bad in ("runs/a@", "runs/a@-1", "runs/a@latest", "runs/a@1.5", "@3"):
        with pytest.raises(ExportError, match="RUN_DIR@STEP"):
            parse_run_spec(bad)


def _run_without_checkpoints(root, qwen_run, run_id="empty", **trainer) -> str:
    cfg = _config(str(root / "runs"), run_id, qwen_run.base, "grpo", **trainer)
    save_resolved(cfg)
    return cfg.run_dir


def test_user_mistakes_are_one_line_errors(qwen_run, llama_run, tmp_path, capsys):
    out = str(tmp_path / "out")
    cases = [
        ([str(tmp_path / "missing"), out], ["missing does not exist"]),
        ([str(tmp_path), out], ["has no config.yaml", "not a run directory"]),
        ([f"{qwen_run.run_dir}@7", out], ["step 7", "does not exist", "complete steps: 1, 2"]),
        ([f"{qwen_run.run_dir}@last", out], ["after @ must be a checkpoint step number"]),
        ([qwen_run.run_dir, qwen_run.run_dir, "--overwrite"], ["would replace the run directory"]),
        ([qwen_run.run_dir, qwen_run.base, "--overwrite"], ["would replace the run's base model"]),
    ]
    no_ckpt = _run_without_checkpoints(tmp_path, qwen_run)
    os.makedirs(os.path.join(no_ckpt, "checkpoints", "3", "state"))  # a save cut short
    cases.append(
        ([no_ckpt, out], ["no complete checkpoint", "trainer.checkpoint_every", "steps 3"])
    )
    cases.append(([no_ckpt + "@3", out], ["no complete checkpoint"]))
    # a config whose model.path no longer matches the checkpoints
    mismatch = _config(
        str(tmp_path / "runs"), "mismatch", llama_run.base, "grpo",
        checkpoint_dir=os.path.join(qwen_run.run_dir, "checkpoints"),
    )  # fmt: skip
    save_resolved(mismatch)
    cases.append(([mismatch.run_dir, out], ["does not fit the base model", "model.path"]))
    gone = _run_without_checkpoints(
        tmp_path, qwen_run, "gone", checkpoint_dir=os.path.join(qwen_run.run_dir, "checkpoints")
    )
    with open(os.path.join(gone, "config.yaml")) as f:
        text = f.read().replace(qwen_run.base, str(tmp_path / "deleted-model"))
    with open(os.path.join(gone, "config.yaml"), "w") as f:
        f.write(text)
    cases.append(([gone, out], ["base model", "deleted-model", "is not a directory"]))

    for argv, expected in cases:
        code, _, err = _export(capsys, *argv)
        assert code == 2, (argv, err)
        lines = err.strip().splitlines()  # INFO logs first, then the error
        assert lines[-1].startswith("rlax export: error: "), err
        assert sum("error" in line.lower() for line in lines) == 1, err
        assert "Traceback" not in err and all(e in err for e in expected), (expected, err)
    assert not os.path.exists(out)
    assert os.path.isdir(qwen_run.base) and os.listdir(qwen_run.run_dir)
