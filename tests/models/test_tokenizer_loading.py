"""load_tokenizer: AutoTokenizer's tokenizer for an HF directory, the class it picks remembered so
later loads (other processes) import that class alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from rlax_tasks.models import Policy, model_cache
from rlax_tasks.models.tokenizer_loading import classes_path, load_tokenizer
from tests.data.chat_model import CORPUS
from tests.tiny_model import tiny_model_config

MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture
def classes_in_tmp(tmp_path, monkeypatch):
    """The remembered classes under tmp_path (beside a model cache there)."""
    monkeypatch.setenv(model_cache.CACHE_ENV, str(tmp_path / "cache" / "models"))
    return tmp_path / "cache" / "tokenizer-classes.json"


def _same_behaviour(got, want, chat: bool) -> None:  # noqa: ANN001 - transformers tokenizers
    assert type(got) is type(want)
    for text in CORPUS:
        assert got(text)["input_ids"] == want(text)["input_ids"]
        ids = want(text, add_special_tokens=False)["input_ids"]
        for skip in (True, False):
            assert got.decode(ids, skip_special_tokens=skip) == want.decode(
                ids, skip_special_tokens=skip
            )
    assert (got.eos_token_id, got.pad_token_id, got.bos_token_id) == (
        want.eos_token_id, want.pad_token_id, want.bos_token_id,
    )  # fmt: skip
    if chat:
        kwargs = {"tokenize": False, "add_generation_prompt": True}
        assert got.apply_chat_template(MESSAGES, **kwargs) == want.apply_chat_template(
            MESSAGES, **kwargs
        )


# (a character tokenizer is loaded as saved, not as AutoTokenizer would: the test below)
@pytest.mark.parametrize("which", ["chat"])
def test_the_remembered_class_loads_what_autotokenizer_loads(
    which, classes_in_tmp, chat_model_dir, monkeypatch
) -> None:  # noqa: ANN001
    path = chat_model_dir
    want = AutoTokenizer.from_pretrained(path)
    first = load_tokenizer(path)  # through AutoTokenizer: remembers its choice
    _same_behaviour(first, want, chat=which == "chat")
    assert os.path.samefile(classes_path(), classes_in_tmp)
    assert list(json.loads(classes_in_tmp.read_text()).values()) == [type(want).__name__]

    def refuse(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("AutoTokenizer called although the class is remembered")

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", refuse)
    _same_behaviour(load_tokenizer(path), want, chat=which == "chat")


def test_changed_files_or_a_bad_entry_go_through_autotokenizer(
    classes_in_tmp, chat_model_dir, tmp_path
) -> None:
    load_tokenizer(chat_model_dir)
    (key,) = json.loads(classes_in_tmp.read_text())
    # another directory with a different tokenizer_config.json: another key, AutoTokenizer
    other = tmp_path / "other"
    other.mkdir()
    for name in os.listdir(chat_model_dir):
        with open(os.path.join(chat_model_dir, name), "rb") as f:
            (other / name).write_bytes(f.read())
    config = json.loads((other / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 64}))
    assert load_tokenizer(str(other)).model_max_length == 64
    assert len(json.loads(classes_in_tmp.read_text())) == 2
    # an entry naming no transformers class: AutoTokenizer again, and the entry corrected
    classes_in_tmp.write_text(json.dumps({key: "NoSuchTokenizer"}))
    want = AutoTokenizer.from_pretrained(chat_model_dir)
    _same_behaviour(load_tokenizer(chat_model_dir), want, chat=True)
    assert json.loads(classes_in_tmp.read_text())[key] == type(want).__name__


def test_a_remembered_load_does_not_import_autotokenizer(classes_in_tmp, chat_model_dir) -> None:
    load_tokenizer(chat_model_dir)
    code = (
        "import sys\n"
        "from rlax_tasks.models.tokenizer_loading import load_tokenizer\n"
        f"tok = load_tokenizer({chat_model_dir!r})\n"
        "print(type(tok).__name__, 'transformers.models.auto.tokenization_auto' in sys.modules,"
        " 'torch' in sys.modules)\n"
    )
    # the child inherits $RLAX_MODEL_CACHE (set by classes_in_tmp), so it reads the same table
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == [type(AutoTokenizer.from_pretrained(chat_model_dir)).__name__, "False", "False"]


def test_a_saved_character_tokenizer_keeps_spaces_newlines_and_chat_tokens(tmp_path) -> None:
    """Our tokenizers-built tokenizers load as saved: AutoTokenizer's pick for a Qwen2 config
    rebuilt them with a pre-tokenizer that dropped every space and newline."""
    from rlax_tasks.models.tokenizer import chat_char_tokenizer

    tok = chat_char_tokenizer()
    config = tiny_model_config(vocab_size=len(tok), eos_token_id=tok.eos_token_id)
    Policy.init(config, seed=0, tokenizer=tok).save_pretrained(str(tmp_path))
    text = "<|im_start|>user\n1 + 2<|im_end|>\n"
    loaded = load_tokenizer(str(tmp_path))
    assert loaded.encode(text, add_special_tokens=False) == tok.encode(
        text, add_special_tokens=False
    )
    assert loaded.eos_token_id == tok.eos_token_id and loaded.chat_template == tok.chat_template


def test_the_chat_tokenizer_encodes_any_tool_output(tmp_path) -> None:
    """A tool's error message quotes what the model wrote ('2^3', '…'): every printable
    character is a token and anything else is <unk>, never an encoding error (saved or not)."""
    from rlax_tasks.models.tokenizer import chat_char_tokenizer

    tok = chat_char_tokenizer()
    text = "error: '2^3' is not supported; try 2**3 ~ `x` @ $5 \\ done…"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids.count(tok.unk_token_id) == 1  # the ellipsis
    assert tok.decode(ids[:-1]) == text[:-1]
    config = tiny_model_config(vocab_size=len(tok), eos_token_id=tok.eos_token_id)
    Policy.init(config, seed=0, tokenizer=tok).save_pretrained(str(tmp_path))
    assert load_tokenizer(str(tmp_path)).encode(text, add_special_tokens=False) == ids
