"""A tiny policy that ends its turns (the chat tokenizer's <|im_end|>) after a few tokens, and
a test environment that counts each step it runs in a file outside the product."""

from __future__ import annotations

import hashlib
import json
import os
import time

from benchmarks.tool_wait import ending_turns
from rlax_tasks.environments import StepResult, environment_names, register
from rlax_tasks.models import Policy
from rlax_tasks.models.tokenizer import chat_char_tokenizer
from tests.tiny_model import tiny_model_config

TOKENIZER = chat_char_tokenizer()
CONFIG = tiny_model_config(vocab_size=len(TOKENIZER), eos_token_id=TOKENIZER.eos_token_id)
CALLS_ENV = "RLAX_TEST_STEP_CALLS"  # the file each step appends a line to


def turn_ending_policy(seed: int = 0) -> Policy:
    """A random tiny policy whose sampled turns end (<|im_end|>) after ~5-40 tokens instead of
    running to their budget (``benchmarks.tool_wait.ending_turns``)."""
    return ending_turns(Policy.init(CONFIG, seed=seed, tokenizer=TOKENIZER))


def step_calls() -> list[dict]:
    """Every step the test environment ran, as recorded."""
    path = os.environ[CALLS_ENV]
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f]


class CountedEcho:
    """Answers each turn with a short tool result; a turn containing ``fault`` (a setting:
    "sleep", "crash" or "flood") misbehaves that way. Each step is recorded first."""

    tools = [{"type": "function", "function": {"name": "echo", "description": "echo",
                                               "parameters": {"type": "object"}}}]  # fmt: skip

    def __init__(self, fault: str = "", sleep_s: float = 5.0, delay_s: float = 0.0) -> None:
        self.fault, self.sleep_s, self.delay_s = fault, sleep_s, delay_s

    def reset(self, row: dict) -> list[dict]:
        self.row = row
        return [{"role": "user", "content": str(row["prompt"])}]

    def step(self, turn: str) -> StepResult:
        digest = hashlib.sha256(turn.encode()).hexdigest()[:16]
        with open(os.environ[CALLS_ENV], "a") as f:
            f.write(json.dumps({"row": self.row["prompt"], "turn": digest}) + "\n")
        time.sleep(self.delay_s)  # a tool that takes its time (a step in flight at a kill)
        if self.fault == "sleep":
            time.sleep(self.sleep_s)
        if self.fault == "crash":
            raise RuntimeError("the tool crashed")
        content = "x" * 10_000_000 if self.fault == "flood" else f"ok {len(turn)}"
        return StepResult(({"role": "tool", "content": content},), False, 0.5,
                          {"tool_calls": 1, "valid_calls": 1})  # fmt: skip


def install_test_environments(site: str) -> str:
    """Makes ``site`` an installed distribution whose ``rlax.environments`` entry point is
    ``counted-echo`` (how a user's package adds one); returns the PYTHONPATH that finds it
    (and this repository's tests) in a child process."""
    info = os.path.join(site, "rlax_test_environments-0.1.dist-info")
    os.makedirs(info, exist_ok=True)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: rlax-test-environments\nVersion: 0.1\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as f:
        f.write("[rlax.environments]\ncounted-echo = tests.rollout.episode_helpers:CountedEcho\n")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return os.pathsep.join([site, repo, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)


if "counted-echo" not in environment_names():  # (the entry point, when installed, names it)
    register("counted-echo", CountedEcho)
