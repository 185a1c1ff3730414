"""ensure_base_model: built once then reused, loadable, crash-safe, rebuilt on a new recipe."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from rlax_tasks.models import load_pretrained
from rlax_tasks.warmup import (
    MARKER,
    TinyArith,
    WarmupRecipe,
    WarmupRecipeError,
    base_model_name,
    ensure_base_model,
    read_marker,
    training_problems,
)

# a reduced recipe: a few steps of a very small model (the real one trains for a minute)
SMALL = WarmupRecipe(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    steps=12,
    batch_size=16,
    lr_warmup_steps=2,
    num_train_problems=400,
    heldout_size=100,
    label_smoothing=0.1,
)


class Counter:
    def __init__(self) -> None:
        self.steps = 0

    def __call__(self, step: int, loss: float) -> None:
        self.steps += 1


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    cache = str(tmp_path_factory.mktemp("cache"))
    return cache, ensure_base_model(cache, SMALL)


def _weights(path: str) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in load_pretrained(path).named_params()}


def test_builds_an_hf_directory_with_marker(built: tuple[str, str]) -> None:
    cache, path = built
    assert path == os.path.join(cache, base_model_name(SMALL))
    files = set(os.listdir(path))
    assert {"config.json", MARKER, "tokenizer.json"} <= files
    assert any(f.endswith(".safetensors") for f in files)
    marker = read_marker(path)
    assert marker is not None and marker["fingerprint"] == SMALL.fingerprint()
    assert marker["warmup"]["steps"] == SMALL.steps
    assert not [e for e in os.listdir(cache) if ".tmp-" in e]  # nothing half-written left


def test_loadable_and_speaks_the_compact_format(built: tuple[str, str]) -> None:
    policy = load_pretrained(built[1])
    assert policy.config.model_type == "qwen2"
    assert policy.config.num_hidden_layers == SMALL.num_hidden_layers
    problem = TinyArith(SMALL.task()).problems(1, seed=5)[0]
    ids = TinyArith.encode_prompt(policy.tokenizer, problem)
    assert policy.tokenizer.decode(ids) == problem.prompt
    assert policy.logits([ids]).shape == (1, len(ids), policy.config.vocab_size)


def test_second_call_reuses_without_training(built: tuple[str, str]) -> None:
    cache, path = built
    counter = Counter()
    mtime = os.path.getmtime(os.path.join(path, MARKER))
    again = ensure_base_model(cache, SMALL, on_step=counter)
    assert again == path
    assert counter.steps == 0  # no training step ran
    assert os.path.getmtime(os.path.join(path, MARKER)) == mtime  # nothing rewritten


def test_crash_during_build_leaves_no_model_and_next_call_rebuilds(
    built: tuple[str, str], tmp_path: os.PathLike
) -> None:
    cache = str(tmp_path)

    def crash(step: int, loss: float) -> None:
        if step == 3:
            raise KeyboardInterrupt("simulated crash")

    with pytest.raises(KeyboardInterrupt):
        ensure_base_model(cache, SMALL, on_step=crash)
    assert not os.path.exists(os.path.join(cache, base_model_name(SMALL)))
    assert not [e for e in os.listdir(cache) if ".tmp-" in e]

    # a hard kill leaves a temp dir and a half-written final dir behind: both are replaced
    name = base_model_name(SMALL)
    os.makedirs(os.path.join(cache, f".{name}.tmp-dead"))
    os.makedirs(os.path.join(cache, name))
    with open(os.path.join(cache, name, "model.safetensors"), "wb") as f:
        f.write(b"\0" * 10)  # truncated weights, no config.json, no marker
    counter = Counter()
    path = ensure_base_model(cache, SMALL, on_step=counter)
    assert counter.steps == SMALL.steps
    assert read_marker(path)["fingerprint"] == SMALL.fingerprint()
    assert not [e for e in os.listdir(cache) if ".tmp-" in e]
    # deterministic by seed: the rebuild equals the first build bit for bit
    first, second = _weights(built[1]), _weights(path)
    assert first.keys() == second.keys()
    for key in first:
        np.testing.assert_array_equal(first[key], second[key], err_msg=key)


def test_changed_recipe_rebuilds_under_a_fixed_name(tmp_path: os.PathLike) -> None:
    cache = str(tmp_path)
    path = ensure_base_model(cache, SMALL, name="tiny-arith")
    changed = WarmupRecipe(**{**SMALL.to_dict(), "steps": 6})
    assert changed.fingerprint() != SMALL.fingerprint()
    counter = Counter()
    assert ensure_base_model(cache, changed, name="tiny-arith", on_step=counter) == path
    assert counter.steps == 6
    assert read_marker(path)["fingerprint"] == changed.fingerprint()
    assert sorted(os.listdir(cache)) == [".tiny-arith.lock", "tiny-arith"]


def test_never_overwrites_a_model_it_did_not_build(tmp_path: os.PathLike) -> None:
    user_model = tmp_path / "tiny-arith"
    user_model.mkdir()
    (user_model / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    with pytest.raises(ValueError, match="did not build"):
        ensure_base_model(str(tmp_path), SMALL, name="tiny-arith")
    assert (user_model / "config.json").exists()


def test_recipe_validation_names_the_field() -> None:
    with pytest.raises(WarmupRecipeError, match="label_smoothing"):
        WarmupRecipe(label_smoothing=1.5)
    with pytest.raises(WarmupRecipeError, match="hidden_size"):
        WarmupRecipe(hidden_size=30, num_attention_heads=4)
    with pytest.raises(WarmupRecipeError, match="unknown warm-up recipe field"):
        WarmupRecipe.from_dict({"stepz": 3})
    with pytest.raises(WarmupRecipeError, match="task knobs"):
        WarmupRecipe(ops=("/",))
    with pytest.raises(ValueError, match="local path"):
        ensure_base_model("gs://bucket/models", SMALL)


def test_warmup_data_excludes_the_heldout_stream() -> None:
    fmt = TinyArith(SMALL.task())
    held = {p.prompt for p in fmt.problems(SMALL.heldout_size, seed=SMALL.heldout_seed)}
    pool = training_problems(SMALL)
    assert pool and not held & {p.prompt for p in pool}
