"""Datasets are checked before anything starts: a missing path or a damaged row is one line
naming the file (and the row), `rlax run` exits 2 and writes nothing."""

from __future__ import annotations

import json
import os

import pytest
import yaml

from rlax_tasks.cli import main
from rlax_tasks.config import RunConfig
from rlax_tasks.plan.preflight import DatasetError, check_datasets

PRESETS = os.path.join(os.path.dirname(__file__), "..", "..", "rlax_tasks", "presets")

# the one-layer test model's config.json: all the memory plan reads of a model
MODEL_SHAPES = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 78,
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-06, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "torch_dtype": "float32",
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}  # fmt: skip
GOOD = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(3)]


def _jsonl(path, rows: list, raw_lines: dict[int, str] | None = None) -> str:
    """Writes ``rows`` as JSONL; ``raw_lines`` puts text as it is at those 1-based lines."""
    lines = [json.dumps(r) for r in rows]
    for at, text in sorted((raw_lines or {}).items()):
        lines.insert(at - 1, text)
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def model_shapes_only(path) -> str:
    """A model directory with only config.json: enough for a run refused before the model
    loads (the memory plan reads the shapes), and much cheaper than a model."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(MODEL_SHAPES, f)
    return str(path)


def _raw(tmp_path, train: str, heldout: str | None = None, **source) -> dict:
    """The tiny-arith preset with a file dataset for training and held-out evaluation."""
    raw = yaml.safe_load(open(os.path.join(PRESETS, "tiny-arith.yaml")))
    raw["run_root"], raw["run_id"] = str(tmp_path / "runs"), "preflight"
    raw["datasets"] = [{"name": "train", "source": {"path": train, **source}}]
    raw["eval"]["dataset"] = {"name": "heldout", "source": {"path": heldout or train, **source}}
    return raw


def _config(tmp_path, train: str, heldout: str | None = None, **source) -> RunConfig:
    return RunConfig.from_dict(_raw(tmp_path, train, heldout, **source))


def test_good_datasets_pass_and_unfit_rows_are_skipped_as_in_training(tmp_path):
    check_datasets(_config(tmp_path, _jsonl(tmp_path / "a.jsonl", GOOD)))
    gsm8k = [{"question": "1+1?", "answer": "1+1=2\n#### 2"},
             {"question": "2+2?", "answer": "no final answer marker"}]  # fmt: skip
    check_datasets(_config(tmp_path, _jsonl(tmp_path / "g.jsonl", gsm8k), format="gsm8k"))


def test_a_missing_path_names_the_field_and_the_file(tmp_path):
    missing = str(tmp_path / "nowhere" / "train.jsonl")
    with pytest.raises(DatasetError) as info:
        check_datasets(_config(tmp_path, missing))
    assert str(info.value).startswith(f"datasets[0] ('train', {missing}, format rlax): ")
    assert "no such file" in str(info.value) and info.value.file == missing
    good = _jsonl(tmp_path / "a.jsonl", GOOD)
    with pytest.raises(DatasetError, match=r"^eval\.dataset \('heldout', .*no such file"):
        check_datasets(_config(tmp_path, good, heldout=missing))


def test_a_broken_row_names_the_file_and_the_row(tmp_path):
    path = _jsonl(tmp_path / "b.jsonl", GOOD, {3: '{"prompt": "7+1=", "answer": '})
    with pytest.raises(DatasetError) as info:
        check_datasets(_config(tmp_path, path))
    msg = str(info.value)
    assert f"{path} row 3 cannot be read: broken JSON" in msg and "(1 such row(s))" in msg
    assert (info.value.file, info.value.row) == (path, 3)


def test_no_usable_row_or_no_reference_for_the_verifier_is_refused(tmp_path):
    no_answer = _jsonl(tmp_path / "n.jsonl", [{"prompt": "1+1="}, {"prompt": "2+2="}])
    with pytest.raises(DatasetError, match=rf"{no_answer} row 1: no answer and no tests"):
        check_datasets(_config(tmp_path, no_answer))
    # answers, but a code verifier needs test suites
    path = _jsonl(tmp_path / "m.jsonl", GOOD)
    with pytest.raises(DatasetError, match=rf"have no tests for verifier 'code'; first: {path}"):
        check_datasets(_config(tmp_path, path, verifier="code"))


def test_an_unknown_environment_or_bad_settings_name_the_field(tmp_path):
    from rlax_tasks.config import ConfigError

    raw = _raw(tmp_path, _jsonl(tmp_path / "a.jsonl", GOOD))
    raw["datasets"][0]["environment"] = {"name": "calculater", "max_turns": 3}
    with pytest.raises(DatasetError) as info:
        check_datasets(RunConfig.from_dict(raw))
    msg = str(info.value)
    assert msg.startswith("datasets[0].environment.name: unknown environment 'calculater'")
    assert "did you mean 'calculator'" in msg
    raw["datasets"][0]["environment"] = {"name": "calculator", "settings": {"sistem": "x"}}
    with pytest.raises(DatasetError, match=r"^datasets\[0\]\.environment: .*sistem"):
        check_datasets(RunConfig.from_dict(raw))
    raw["datasets"][0]["environment"] = {"name": "calculator", "max_turns": 0}
    with pytest.raises(ConfigError, match=r"datasets\[0\]\.environment\.max_turns"):
        RunConfig.from_dict(raw)
    raw["datasets"][0]["environment"] = {"name": "calculator", "max_turns": 2}
    check_datasets(RunConfig.from_dict(raw))


def test_rlax_run_exits_2_before_anything_starts(tmp_path, capsys):
    model = model_shapes_only(tmp_path / "model")
    broken = _jsonl(tmp_path / "b.jsonl", GOOD, {2: "not json"})
    raw = _raw(tmp_path, broken)
    raw["model"] = {"path": model}
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(raw))
    run_root = tmp_path / "runs"
    argv = ["run", "--config", str(config), "--run-root", str(run_root), "--steps", "2"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"rlax run: error: datasets[0] ('train', {broken}, format rlax): {broken} row 2" in err
    assert "Traceback" not in err
    assert not run_root.exists()  # nothing written, nothing started
