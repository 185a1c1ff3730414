"""`rlax demo`: load an HF model directory and generate greedily, as a first end-to-end check.

This is the project's main job until `rlax run` (the RL loop) exists. With no model given it
builds a tiny random Qwen2-shaped model with a character tokenizer, so the output is gibberish by
design: it shows that loading, the forward pass and decoding work on this machine.
"""

from __future__ import annotations

import logging
import os
import time

from rlax_tasks.models import ModelConfig, Policy, load_pretrained
from rlax_tasks.models.reference_decode import greedy_decode
from rlax_tasks.models.tokenizer import char_tokenizer

log = logging.getLogger(__name__)

DEFAULT_PROMPTS = ("12+34=", "7*8=", "100-1=")


def build_demo_model(path: str, seed: int = 0) -> None:
    """Writes a tiny random Qwen2-shaped model + character tokenizer as an HF directory."""
    tokenizer = char_tokenizer()
    config = ModelConfig(
        model_type="qwen2",
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        qkv_bias=True,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    Policy.init(config, seed=seed, tokenizer=tokenizer).save_pretrained(path)
    log.info("built a random demo model at %s", path)


def run_demo(
    model_dir: str, prompts: list[str], max_new_tokens: int, dtype: str = "float32"
) -> list[str]:
    """Loads ``model_dir`` (building the tiny demo model there first if absent) and decodes."""
    if not os.path.exists(model_dir) or not os.listdir(model_dir):
        print(f"[demo] no model at {model_dir}: building a tiny random Qwen2-shaped model")
        build_demo_model(model_dir)
    policy = load_pretrained(model_dir, dtype=dtype)
    if policy.tokenizer is None:
        raise ValueError(f"{model_dir} has no tokenizer files; the demo needs one to encode text")
    cfg = policy.config
    print(
        f"[demo] loaded {cfg.model_type}: {cfg.num_parameters() / 1e6:.2f}M parameters, "
        f"{cfg.num_hidden_layers} layers, vocab {cfg.vocab_size}, {dtype}"
    )
    encoded = [policy.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    start = time.perf_counter()
    completions = greedy_decode(policy, encoded, max_new_tokens)
    elapsed = time.perf_counter() - start
    texts = [policy.tokenizer.decode(c, skip_special_tokens=True) for c in completions]
    for prompt, text in zip(prompts, texts, strict=True):
        print(f"  {prompt!r} -> {text!r}")
    n_tokens = sum(len(c) for c in completions)
    print(
        f"[demo] generated {n_tokens} tokens in {elapsed:.2f}s (compile included; "
        "reference decoder without KV cache)"
    )
    return texts
