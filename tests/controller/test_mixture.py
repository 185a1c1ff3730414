"""Prompt mixture: weights, stable ids, exact save/restore mid-stream."""

from __future__ import annotations

import json
import re

import pytest

from rlax_tasks.config import DatasetSpec, FileSource, SyntheticSource
from rlax_tasks.controller import PromptMixture
from rlax_tasks.controller.mixture import SyntheticPrompts
from rlax_tasks.data.compact import compact_prompt
from rlax_tasks.rewards.tasks import Problem
from rlax_tasks.warmup import TinyArith
from tests.controller.fakes import mixture


def test_weights_are_respected_statistically():
    m = mixture(seed=1, sizes={"a": (50, 3.0), "b": (40, 1.0), "c": (30, 1.0)})
    n = 5000
    counts = {"a": 0, "b": 0, "c": 0}
    for p in m.take(n):
        counts[p.dataset] += 1
    for name, share in (("a", 0.6), ("b", 0.2), ("c", 0.2)):
        sd = (share * (1 - share) / n) ** 0.5
        assert abs(counts[name] / n - share) < 4 * sd, counts


def test_ids_are_stable_and_each_epoch_is_a_permutation():
    m = mixture(seed=2, sizes={"a": (9, 1.0)})
    prompts = m.take(27)
    for epoch in range(3):
        chunk = prompts[epoch * 9 : (epoch + 1) * 9]
        assert sorted(p.index for p in chunk) == list(range(9))
        assert all(p.id == f"a/{epoch}/{p.index}" and p.epoch == epoch for p in chunk)
    assert [p.seq for p in prompts] == list(range(27))
    assert [p.index for p in prompts[:9]] != [p.index for p in prompts[9:18]]  # reshuffled
    again = mixture(seed=2, sizes={"a": (9, 1.0)}).take(27)
    assert again == prompts
    assert m.prompt(prompts[5].id, 5) == prompts[5]


def test_state_round_trip_mid_stream_gives_the_same_sequence():
    m = mixture(seed=4)
    m.take(37)
    state = json.loads(json.dumps(m.state_dict()))  # plain JSON
    expected = m.take(60)
    restored = mixture(seed=4)
    restored.load_state_dict(state)
    assert restored.take(60) == expected


def test_restore_into_a_different_mixture_is_an_error():
    state = mixture(seed=4).state_dict()
    with pytest.raises(ValueError, match="datasets"):
        mixture(seed=4, sizes={"a": (13, 2.0)}).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        mixture(seed=5).load_state_dict(state)
    with pytest.raises(ValueError, match="does not belong"):
        mixture(seed=4).prompt("zzz/0/1", 0)


def test_from_specs_synthetic_and_file(tmp_path):
    path = tmp_path / "math.jsonl"
    rows = [
        {"prompt": f"What is {i}+1?", "answer": str(i + 1), "source": "t", "date": "2024-01-01"}
        for i in range(5)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    specs = [
        DatasetSpec("arith", SyntheticSource("arithmetic", {"max_digits": 2}, size=50), 1.0),
        DatasetSpec("file", FileSource(str(path), "math"), 1.0),
    ]
    m = PromptMixture.from_specs(specs, seed=0)
    prompts = m.take(40)
    files = [p for p in prompts if p.dataset == "file"]
    arith = [p for p in prompts if p.dataset == "arith"]
    assert files and arith
    assert all(
        p.verifier == "math" and p.reference == str(int(p.content.split()[2][:-3]) + 1)
        for p in files
    )
    assert all(p.verifier == "task" and "Compute" in p.content for p in arith)


def test_synthetic_source_leaves_out_the_held_out_stream():
    from rlax_tasks.controller.mixture import make_source
    from rlax_tasks.rewards.tasks import make_task

    knobs = {"min_digits": 1, "max_digits": 1, "ops": ["+"]}  # 100 distinct problems only
    spec = DatasetSpec(
        "arith",
        SyntheticSource("arithmetic", knobs, size=300, exclude_seed=1, exclude_size=20),
        1.0,
    )
    source = make_source(spec)
    held = {p.prompt for p in make_task("arithmetic", **knobs).generate(20, seed=1)}
    train = {source.get(i)[0] for i in range(len(source))}
    assert len(source) < 300 and not train & held


def test_compact_prompts_are_the_warmup_kits_format():
    """The controller and the warm-up kit render arithmetic through one format: "12+34="."""
    knobs = {"max_digits": 2, "ops": ["+", "-"]}
    spec = SyntheticSource("arithmetic", knobs, size=20, seed=3, prompt_format="compact")
    source = SyntheticPrompts(spec)
    problems = TinyArith(knobs).problems(20, seed=3)
    got = [source.get(i) for i in range(20)]
    assert got == [(p.prompt, p.reference) for p in problems]
    assert all(re.fullmatch(r"\d+[+-]\d+=", text) for text, _ in got), got[:3]
    assert [TinyArith.answer_text(p) for p in problems] == [a for _, a in got]


def test_the_compact_format_refuses_a_problem_without_an_expression():
    problem = Problem("copy", "copy/0", "repeat abc", "abc")
    with pytest.raises(ValueError, match="not an arithmetic problem"):
        compact_prompt(problem)
