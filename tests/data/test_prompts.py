"""Prompt rendering (docs/design.md §11) with a real chat checkpoint layout: one BOS, the system
prompt and instruction in place, raw text as the tokenizer encodes any text, clear errors; and the
EOS ids of generation_config.json ending generation."""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import pytest

from rlax_tasks.data import PromptRenderer, PromptSettings, PromptSettingsError
from rlax_tasks.models import load_pretrained
from rlax_tasks.rollout import Sampler

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
QUESTION = "How many clips did Natalia sell?"


@pytest.fixture(scope="module")
def tokenizer(chat_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(chat_model_dir)


def test_chat_template_renders_once_with_a_single_bos(tokenizer):
    settings = PromptSettings(template="chat", system="You are terse.", instruction=INSTRUCTION)
    renderer = PromptRenderer(settings, tokenizer)
    text = renderer.text(QUESTION)
    assert text == (
        "<|bos|><|im_start|>system\nYou are terse.<|im_end|>\n"
        f"<|im_start|>user\n{QUESTION}\n\n{INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = renderer.encode(QUESTION)
    assert ids.count(tokenizer.bos_token_id) == 1 and ids[0] == tokenizer.bos_token_id
    # the same ids transformers' own chat tokenization gives
    want = tokenizer.apply_chat_template(
        renderer.messages(QUESTION), add_generation_prompt=True, tokenize=True
    )
    assert ids == list(want["input_ids"] if hasattr(want, "keys") else want)
    assert tokenizer.decode(ids) == text


def test_message_prompts_keep_their_own_system_message(tokenizer):
    renderer = PromptRenderer(PromptSettings("chat", "Default system.", INSTRUCTION), tokenizer)
    chat = [
        {"role": "system", "content": "Row system."},
        {"role": "user", "content": "First."},
        {"role": "assistant", "content": "Ok."},
        {"role": "user", "content": QUESTION},
    ]
    messages = renderer.messages(chat)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[0]["content"] == "Row system."
    assert messages[1]["content"] == "First."  # the instruction goes to the last user message
    assert messages[3]["content"] == f"{QUESTION}\n\n{INSTRUCTION}"
    assert chat[3]["content"] == QUESTION  # the row itself is not changed


def test_raw_template_is_plain_text_with_the_tokenizers_own_special_tokens(tokenizer):
    renderer = PromptRenderer(PromptSettings("raw", "Sys.", INSTRUCTION), tokenizer)
    assert renderer.text(QUESTION) == f"Sys.\n\n{QUESTION}\n\n{INSTRUCTION}"
    ids = renderer.encode(QUESTION)
    # this tokenizer adds BOS to any text (as Llama's does): raw keeps exactly that one
    assert ids == tokenizer(renderer.text(QUESTION))["input_ids"]
    assert ids.count(tokenizer.bos_token_id) == 1
    # messages render as their contents
    chat = [{"role": "user", "content": "A"}, {"role": "assistant", "content": "B"},
            {"role": "user", "content": "C"}]  # fmt: skip
    assert PromptRenderer(PromptSettings(), tokenizer).text(chat) == "A\n\nB\n\nC"


def test_a_model_without_a_chat_template_is_a_clear_error(tmp_path, chat_model_dir):
    model = tmp_path / "no-template"
    shutil.copytree(chat_model_dir, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="prompt.template: 'chat' needs a tokenizer with a chat"):
        PromptRenderer.for_model(PromptSettings(template="chat"), str(model))
    PromptRenderer.for_model(PromptSettings(template="raw"), str(model))  # raw needs none
    with pytest.raises(FileNotFoundError, match="no such model directory"):
        PromptRenderer.for_model(PromptSettings(), str(tmp_path / "missing"))


def test_a_template_that_refuses_a_prompt_is_a_value_error(tokenizer):
    """Some templates raise for roles they do not support: one prompt fails, with the reason
    (the controller skips and counts it), not the run."""
    strict = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    strict.chat_template = (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not "
        "supported') }}{% endif %}{{ bos_token }}{{ messages[-1]['content'] }}"
    )
    renderer = PromptRenderer(PromptSettings("chat", system="Be brief."), strict)
    with pytest.raises(ValueError, match=r"render this prompt \(system/user\): System role"):
        renderer.encode(QUESTION)
    plain = PromptRenderer(PromptSettings("chat"), strict)  # no system message: it renders
    assert plain.text(QUESTION) == f"<|bos|>{QUESTION}"


def test_prompt_settings_errors_name_the_field():
    for raw, field in (
        ({"template": "chatml"}, "template"),
        ({"system": ""}, "system"),
        ({"stop": "</s>"}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"instructions": "x"}, "instructions"),
    ):
        with pytest.raises(PromptSettingsError) as err:
            PromptSettings.from_dict(raw)
        assert err.value.field == field
    assert PromptSettings.from_dict({"stop": ["</answer>"]}).stop == ("</answer>",)


def test_generation_config_eos_ids_end_generation(tmp_path, chat_model_dir, tokenizer):
    policy = load_pretrained(chat_model_dir)
    im_end, pad = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert policy.config.eos_token_ids == (im_end,)  # config.json lists only the turn end
    assert policy.eos_token_ids == (im_end, pad)  # generation_config.json adds <|endoftext|>
    # all-zero weights: every logit is equal, so greedy decoding picks token 0, <|endoftext|>,
    # which only generation_config.json names as an EOS
    zero = policy.with_params(jax.tree.map(jnp.zeros_like, policy.params))
    prompt = PromptRenderer(PromptSettings("chat"), tokenizer).encode(QUESTION)
    (out,) = Sampler(zero, max_slots=2, max_len=128).generate([prompt], max_new_tokens=8)
    assert out.tokens == [pad] and out.finish_reason == "eos"
    # without generation_config.json the same model runs to its budget
    bare = tmp_path / "bare"
    shutil.copytree(chat_model_dir, bare)
    os.remove(bare / "generation_config.json")
    policy = load_pretrained(str(bare))
    zero = policy.with_params(jax.tree.map(jnp.zeros_like, policy.params))
    (out,) = Sampler(zero, max_slots=2, max_len=128).generate([prompt], max_new_tokens=8)
    assert len(out.tokens) == 8 and out.finish_reason == "length"


def test_save_pretrained_keeps_generation_config(tmp_path, chat_model_dir):
    policy = load_pretrained(chat_model_dir)
    policy.save_pretrained(str(tmp_path / "out"))
    saved = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert saved["eos_token_id"] == policy.generation_config["eos_token_id"]
    assert load_pretrained(str(tmp_path / "out")).eos_token_ids == policy.eos_token_ids
