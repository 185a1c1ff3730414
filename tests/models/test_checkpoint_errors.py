"""Bad checkpoints and configs fail with an error that names the problem."""

from __future__ import annotations

import json

import pytest
from safetensors.numpy import load_file, save_file

from rlax_tasks.models import CheckpointError, ModelConfig, ModelConfigError, load_pretrained
from tests.models.hf_models import tiny_hf_model


@pytest.fixture
def checkpoint(tmp_path):
    tiny_hf_model("qwen2").save_pretrained(tmp_path)
    return tmp_path


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_unsupported_architecture_is_named(checkpoint):
    _edit_config(checkpoint, model_type="gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(ModelConfigError, match=r"model_type='gpt2'.*GPT2LMHeadModel"):
        load_pretrained(str(checkpoint))


def test_missing_tensor_is_named(checkpoint):
    tensors = load_file(checkpoint / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, checkpoint / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*missing"):
        load_pretrained(str(checkpoint))


def test_mismatched_tensor_shape_is_named(checkpoint):
    _edit_config(checkpoint, intermediate_size=128)
    with pytest.raises(
        CheckpointError, match=r"model\.layers\.0\.mlp\.\w+_proj\.weight. has shape .* expected"
    ):
        load_pretrained(str(checkpoint))


def test_unexpected_tensor_is_named(checkpoint):
    tensors = load_file(checkpoint / "model.safetensors")
    tensors["model.layers.0.self_attn.extra.weight"] = tensors["model.norm.weight"]
    save_file(tensors, checkpoint / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"self_attn\.extra\.weight"):
        load_pretrained(str(checkpoint))


def test_missing_weights_file(checkpoint):
    (checkpoint / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="neither model.safetensors nor"):
        load_pretrained(str(checkpoint))


def test_missing_directory_and_config(tmp_path):
    with pytest.raises(CheckpointError, match="not a directory"):
        load_pretrained(str(tmp_path / "nope"))
    with pytest.raises(CheckpointError, match="no config.json"):
        load_pretrained(str(tmp_path))


def test_unsupported_dtype_and_rope_type(checkpoint):
    with pytest.raises(ValueError, match="dtype='float16'"):
        load_pretrained(str(checkpoint), dtype="float16")
    _edit_config(
        checkpoint, rope_scaling={"rope_type": "yarn", "factor": 4.0}, rope_parameters=None
    )
    with pytest.raises(ModelConfigError, match="rope_type='yarn'"):
        load_pretrained(str(checkpoint))


def test_sliding_window_is_rejected(checkpoint):
    _edit_config(checkpoint, use_sliding_window=True)
    with pytest.raises(ModelConfigError, match="use_sliding_window"):
        load_pretrained(str(checkpoint))


def test_config_validation_names_the_field():
    base = dict(
        model_type="llama",
        vocab_size=10,
        hidden_size=8,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=3,
        head_dim=2,
    )
    with pytest.raises(ModelConfigError, match="num_key_value_heads=3"):
        ModelConfig(**base)
    with pytest.raises(ModelConfigError, match="vocab_size must be >= 1, got 0"):
        ModelConfig(**{**base, "num_key_value_heads": 2, "vocab_size": 0})


def test_v4_style_config_fields_are_read():
    cfg = ModelConfig.from_hf_dict(
        {
            "model_type": "llama",
            "vocab_size": 10,
            "hidden_size": 8,
            "intermediate_size": 8,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "rope_theta": 123.0,
            "rope_scaling": {"type": "linear", "factor": 2.0},
        }
    )
    assert cfg.rope_theta == 123.0
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert cfg.num_key_value_heads == 2 and cfg.head_dim == 4
