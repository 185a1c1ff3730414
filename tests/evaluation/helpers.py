"""Synthetic datasets (from the arithmetic task) and tiny models for curation/eval tests."""

from __future__ import annotations

import json

from rlax_tasks.models import Policy
from rlax_tasks.models.tokenizer import DIGITS_AND_SYMBOLS, char_tokenizer
from rlax_tasks.rewards.tasks import make_task
from tests.tiny_model import tiny_model_config


def arithmetic_rows(n: int, seed: int = 0, level: int | None = None, **knobs) -> list[dict]:
    """Rows in the curation schema from `make_task("arithmetic")`."""
    task = make_task("arithmetic", **knobs)
    rows = []
    for i, p in enumerate(task.generate(n, seed)):
        rows.append(
            {
                "prompt": p.prompt,
                "answer": p.reference,
                "source": f"arith-{i % 2}",
                "date": f"2024-0{1 + i % 6}-15",
                "metadata": {"id": p.id, **({"level": level} if level is not None else {})},
            }
        )
    return rows


def write_jsonl(path, rows) -> str:
    with open(path, "w") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")
    return str(path)


def tiny_policy(seed: int = 0) -> Policy:
    """A 1-layer random Llama with a character tokenizer covering the arithmetic prompts."""
    tok = char_tokenizer(DIGITS_AND_SYMBOLS + "\\{}")
    config = tiny_model_config(
        "one_layer", model_type="llama", vocab_size=len(tok), qkv_bias=False, eos_token_id=2
    )
    return Policy.init(config, seed=seed, tokenizer=tok)
