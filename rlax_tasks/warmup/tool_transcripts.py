"""Warm-up transcripts of calculator episodes (the ``tool-chat`` format, docs/design.md §15).

Each problem becomes the episode the run's ``calculator`` environment renders: the prompt (the
compact expression as the user's turn, the tool listed by the chat template), then either a
Hermes tool call, the calculator's real output as the observation and the result as the final
turn, or the answer written directly. Only the model's turns are targets; the observation is
masked, as in training. A recipe's ``tool_fraction`` of problems call the tool: the base model
learns both ways, and RL learns which one is rewarded.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rlax_tasks.environments import (
    CalculatorEnvironment,
    ChatRenderer,
    ToolCall,
    format_tool_call,
)
from rlax_tasks.rewards.tasks import Problem

# the environment's settings in the preset (no system prompt: the tiny model's prompt stays
# short; the template still lists the tool)
ENVIRONMENT_SETTINGS: dict[str, Any] = {"system": None}


def calculator_renderer(tokenizer: Any) -> ChatRenderer:
    """The chat renderer of the preset's calculator environment (its tools listed)."""
    return ChatRenderer(tokenizer, CalculatorEnvironment(**ENVIRONMENT_SETTINGS).tools)


def episode_tokens(
    renderer: ChatRenderer, problem: Problem, use_tool: bool
) -> tuple[list[int], list[int]]:
    """(ids, target mask) of one episode on ``problem`` (compact prompt in ``.prompt``)."""
    env = CalculatorEnvironment(**ENVIRONMENT_SETTINGS)
    messages = env.reset({"prompt": problem.prompt, "answer": problem.reference})
    end = renderer.end_of_turn_ids()[0]
    ids = renderer.initial_tokens(messages)
    mask = [0] * len(ids)

    def model_turn(text: str) -> None:
        turn = [*renderer.encode(text), end]
        ids.extend(turn)
        mask.extend([1] * len(turn))

    if use_tool:
        call = format_tool_call(ToolCall("calculator", {"expression": problem.prompt[:-1]}))
        model_turn(call)
        result = env.step(call)
        if result.done or result.info.get("tool_errors"):
            raise AssertionError(f"the calculator refused {problem.prompt!r}: {result}")
        observation = renderer.observation_tokens(messages, call, result.messages)
        ids.extend(observation)
        mask.extend([0] * len(observation))
    model_turn(problem.reference)
    return ids, mask


def encode_transcripts(
    problems: list[Problem], tokenizer: Any, tool_fraction: float, seed: int, width: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids, attention_mask, target_mask) [N, width] of the problems' episodes; which ones call
    the tool is drawn from ``seed`` with probability ``tool_fraction``."""
    renderer = calculator_renderer(tokenizer)
    uses = np.random.default_rng(seed).random(len(problems)) < tool_fraction
    n = len(problems)
    ids = np.full((n, width), tokenizer.pad_token_id, np.int32)
    attn = np.zeros((n, width), np.int32)
    target = np.zeros((n, width), np.int32)
    for i, (problem, use) in enumerate(zip(problems, uses, strict=True)):
        seq, mask = episode_tokens(renderer, problem, bool(use))
        if len(seq) > width:
            raise AssertionError(f"the episode of {problem.prompt!r} exceeds {width} tokens")
        ids[i, : len(seq)] = seq
        attn[i, : len(seq)] = 1
        target[i, : len(seq)] = mask
    return ids, attn, target


def max_episode_tokens(max_prompt_tokens: int, max_answer_tokens: int, tokenizer: Any) -> int:
    """A bound on an episode's length: the tool episode of the longest prompt whose result and
    answer are as long as the longest answer or expression (whichever is longer)."""
    chars = max(max_prompt_tokens - 1, max_answer_tokens - 1)  # the prompt's "=", the <eos>
    expression = "1" * chars  # the calculator's result of it is as many characters
    problem = Problem("arithmetic", "bound", expression + "=", expression)
    renderer = calculator_renderer(tokenizer)
    return len(episode_tokens(renderer, problem, use_tool=True)[0])
