"""RewardScorer (the controller's Scorer in a run): math rows go to math-verify, code rows to the
sandboxed judge under their CodeTests suite; every completion gets a SampleScore with a verdict,
a verifier failure is named as one, and a broken sandbox is a retried ScorerError."""

from __future__ import annotations

import pytest

from rlax_tasks.controller import MixtureComponent, PromptMixture, ScorerError
from rlax_tasks.controller.mixture import Prompt
from rlax_tasks.controller.service import RewardScorer
from rlax_tasks.data.code_tests import CodeCase, CodeTests
from rlax_tasks.rewards import math as math_verifier
from rlax_tasks.rewards import scoring
from rlax_tasks.rewards.sandbox import SandboxError
from rlax_tasks.rewards.scoring import SampleScore
from rlax_tasks.rollout.requests import Completion, GroupResult, Request, SamplingParams
from tests.controller.fakes import ListSource

TOTAL = CodeTests(
    (CodeCase("[[1, 2, 3]]", "6"), CodeCase("[[]]", "0")), fn_name="total", time_limit_s=0.5
).to_json()
MATH = Prompt("m/0/0", 0, "m", 0, 0, "What is 6 * 7?", "42", "math")
CODE = Prompt(
    "c/0/0", 1, "c", 0, 0, [{"role": "user", "content": "Write total(xs)."}], TOTAL, "code"
)


def scorer() -> RewardScorer:
    components = [
        MixtureComponent("m", 1.0, ListSource("m", 1), "math"),
        MixtureComponent("c", 1.0, ListSource("c", 1), "code"),
    ]
    return RewardScorer(PromptMixture(components), max_parallel=2)


def result(prompt: Prompt, texts: list[str]) -> GroupResult:
    completions = [
        Completion(Request((1, 2), SamplingParams(), i, (prompt.id, i)), [3], [-0.5], "eos")
        for i in range(len(texts))
    ]
    return GroupResult(prompt.id, 0, (1, 2), completions, texts, 0.0)


def test_math_and_code_rows_get_sample_scores_with_verdicts():
    programs = [
        "```python\ndef total(xs):\n    return sum(xs)\n```",
        "def total(xs):\n    return len(xs)\n",
        "import time\n\ndef total(xs):\n    time.sleep(5)\n    return sum(xs)\n",
    ]
    scores = scorer().score(
        [MATH, CODE],
        [result(MATH, ["6 * 7 = \\boxed{42}", "I think \\boxed{41}"]), result(CODE, programs)],
    )
    assert all(isinstance(s, SampleScore) for row in scores for s in row)
    assert [[(s.reward, s.verdict) for s in row] for row in scores] == [
        [(1.0, "correct"), (0.0, "incorrect")],
        # a program over the suite's time limit is the model's failure, not the verifier's
        [(1.0, "pass"), (0.0, "wrong_answer"), (0.0, "timeout")],
    ]


def test_math_verifier_failures_are_named_verifier_failures(monkeypatch):
    def check_batch(pairs, max_parallel=None):
        verdicts = ["timeout", "error", "correct"]
        return [math_verifier.MathResult(float(v == "correct"), v, "42") for v in verdicts]

    monkeypatch.setattr(math_verifier, "check_batch", check_batch)
    scores = scorer().score([MATH], [result(MATH, ["\\boxed{42}"] * 3)])
    assert [s.verdict for s in scores[0]] == ["verifier_timeout", "verifier_error", "correct"]
    assert [s.reward for s in scores[0]] == [0.0, 0.0, 1.0]


def test_a_broken_sandbox_is_a_scorer_error(monkeypatch):
    def judge_batch(submissions, max_parallel=None):
        raise SandboxError("bwrap: setting up uid map: Permission denied")

    monkeypatch.setattr(scoring, "judge_batch", judge_batch)
    with pytest.raises(ScorerError, match="sandbox is broken.*uid map"):
        scorer().score([CODE], [result(CODE, ["def total(xs):\n    return 0\n"])])
