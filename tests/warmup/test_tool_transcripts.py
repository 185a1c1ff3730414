"""The tool-chat warm-up: its episodes are the ones the tiny-calc run's calculator environment
renders, and only the model's turns are trained (docs/design.md §15)."""

from __future__ import annotations

import numpy as np

from rlax_tasks.config import load_config
from rlax_tasks.controller.mixture import Prompt, make_source
from rlax_tasks.environments import ChatRenderer
from rlax_tasks.rewards.tasks import Problem
from rlax_tasks.rollout.episodes import episode_prompt
from rlax_tasks.warmup.recipe import NAMED_RECIPES, recipe_for
from rlax_tasks.warmup.supervised import encode_pool, training_problems
from rlax_tasks.warmup.tool_transcripts import (
    ENVIRONMENT_SETTINGS,
    calculator_renderer,
    episode_tokens,
)

RECIPE = recipe_for("tiny-calc")
TOKENIZER = RECIPE.tokenizer()


def _renderer() -> ChatRenderer:
    return calculator_renderer(TOKENIZER)


def test_a_tool_episode_trains_the_call_and_the_answer_not_the_observation() -> None:
    problem = training_problems(RECIPE)[0]
    ids, mask = episode_tokens(_renderer(), problem, use_tool=True)
    text = TOKENIZER.decode(ids)
    expression = problem.prompt[:-1]
    assert text.count(f'"expression": "{expression}"') == 1
    trained = TOKENIZER.decode([t for t, m in zip(ids, mask, strict=True) if m])
    masked = TOKENIZER.decode([t for t, m in zip(ids, mask, strict=True) if not m])
    # the call, then the answer; the prompt and the calculator's turn are masked
    assert trained.startswith("<tool_call>") and trained.endswith(f"{problem.reference}<|im_end|>")
    assert f"<|im_start|>tool\n{problem.reference}<|im_end|>" in masked
    assert problem.prompt in masked and problem.prompt not in trained


def test_a_direct_episode_trains_only_the_answer() -> None:
    problem = training_problems(RECIPE)[1]
    ids, mask = episode_tokens(_renderer(), problem, use_tool=False)
    trained = TOKENIZER.decode([t for t, m in zip(ids, mask, strict=True) if m])
    assert trained == f"{problem.reference}<|im_end|>"


def test_the_warmup_prompt_is_the_one_the_preset_run_samples_from() -> None:
    """A base model taught another rendering of the prompt than the run's would not call the
    tool in the run: the warm-up's prompt tokens are the episode prompt of the preset's rows."""
    cfg = load_config("tiny-calc")
    (dataset,) = cfg.datasets
    source = make_source(dataset)
    for index in range(20):
        content, reference = source.get(index)
        row = Prompt(f"calc/{index}", index, dataset.name, index, 0, content, reference,
                     "task").episode_row()  # fmt: skip
        run_tokens = list(episode_prompt(TOKENIZER, dataset.environment, row))
        problem = Problem("arithmetic", f"calc/{index}", content, reference)
        ids, mask = episode_tokens(_renderer(), problem, use_tool=False)
        assert ids[: len(run_tokens)] == run_tokens and not any(mask[: len(run_tokens)])
        assert mask[len(run_tokens)] == 1
    assert dict(dataset.environment.settings) == ENVIRONMENT_SETTINGS


def test_the_pool_calls_the_tool_in_its_fraction_of_episodes() -> None:
    problems = training_problems(RECIPE)[:400]
    ids, attn, target = encode_pool(RECIPE, problems, TOKENIZER)
    assert ids.shape == (400, RECIPE.max_tokens()) and (target <= attn).all()
    call = TOKENIZER.convert_tokens_to_ids("<tool_call>")
    calls = (ids == call).any(axis=1).mean()
    assert abs(calls - RECIPE.tool_fraction) < 0.1
    again = encode_pool(RECIPE, problems, TOKENIZER)
    assert all(np.array_equal(a, b) for a, b in zip((ids, attn, target), again, strict=True))


def test_the_compact_recipes_build_what_they_built_before() -> None:
    """The tool-chat fields stay out of a compact recipe's fingerprint: cached base models of
    tiny-arith and tiny-arith-moe are not rebuilt."""
    assert NAMED_RECIPES["tiny-arith"].fingerprint() == "7103385cb79d"
    assert NAMED_RECIPES["tiny-arith-moe"].fingerprint() == "693eefb983c4"
    assert "format" not in NAMED_RECIPES["tiny-arith"].to_dict()
    assert RECIPE.to_dict()["format"] == "tool-chat"
