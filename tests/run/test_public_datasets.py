"""`rlax run` on public dataset layouts with a chat checkpoint (docs/design.md §11), end to end.

A GSM8K-layout file and an APPS-layout code file, each with a prompt too long for the workers,
train with the tokenizer's chat template: the long prompt is skipped and counted (lineage,
metrics), nothing crashes, and for the same problem the sampler receives the same token ids in
training, in the run's held-out evaluation and in `rlax eval --prompt-config` (what the DAGs run).
"""

from __future__ import annotations

import json
import os

import pytest
import yaml

from rlax_tasks.cli import main
from rlax_tasks.config import load_config
from rlax_tasks.controller import read_rollouts
from rlax_tasks.controller.mixture import Prompt, PromptMixture
from rlax_tasks.controller.service import RewardScorer
from rlax_tasks.data import load_dataset
from rlax_tasks.data.prompt_source import FilePrompts
from rlax_tasks.rewards.scoring import score_completions
from rlax_tasks.rollout.requests import Completion, GroupResult, Request
from rlax_tasks.rollout.sampler import Sampler
from rlax_tasks.run.local_run import run_local
from tests.conftest import TEST_XLA_FLAGS
from tests.data.layouts import write_code_apps, write_gsm8k

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
LONG = " ".join(["Natalia sold clips to her friends in April and again in May."] * 40)


def _add_long_row(path: str, row: dict) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")


def _config(tmp_path, model: str, name: str, path: str, fmt: str, instruction: str):
    raw = {
        "run_root": str(tmp_path / "runs"),
        "run_id": name,
        "model": {"path": model},
        "algorithm": {"preset": "grpo", "overrides": {"kl_beta": 0.0}},
        "staleness": {"reload_every": 1, "max_staleness": 2},
        "rollout": {"group_size": 4, "prompts_per_step": 4, "max_new_tokens": 16},
        "prompt": {"template": "chat", "system": "You are a careful solver.",
                   "instruction": instruction},
        "datasets": [{"name": name, "source": {"path": path, "format": fmt}}],
        "trainer": {"learning_rate": 1.0e-4, "checkpoint_every": 2},
        "workers": {"count": 1, "slots": 16, "max_len": 320, "timeout_s": 60.0},
        "eval": {"dataset": {"name": f"{name}-heldout", "source": {"path": path, "format": fmt}},
                 "num_prompts": 16, "num_samples": 2, "ks": [1, 2]},
        "compilation_cache": False,
    }  # fmt: skip
    config_path = tmp_path / f"{name}.yaml"
    config_path.write_text(yaml.safe_dump(raw))
    return load_config(str(config_path))


def _run(cfg, steps: int) -> dict:
    report = run_local(cfg, steps, status_every_s=30.0)
    lineage = [json.loads(x) for x in open(os.path.join(cfg.run_dir, "lineage.jsonl"))]
    metrics = [json.loads(x) for x in open(os.path.join(cfg.run_dir, "metrics.jsonl"))]
    assert [r["step"] for r in lineage] == list(range(1, steps + 1))
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    return {"report": report, "lineage": lineage, "metrics": metrics}


def _skipped_long_prompt(out: dict, cfg, long_index: int) -> None:
    """The long row was drawn, never generated, listed with its reason and counted."""
    name = cfg.datasets[0].name
    skipped = [s for r in out["lineage"] for s in r["skipped_prompts"]]
    assert skipped, "the over-long prompt was never drawn"
    assert all(s["prompt_id"].startswith(f"{name}/") for s in skipped)
    assert {int(s["prompt_id"].rsplit("/", 1)[1]) for s in skipped} == {long_index}
    assert all("a worker takes (workers.max_len" in s["reason"] for s in skipped)
    assert sum(m["prompts_skipped"] for m in out["metrics"]) == len(skipped)
    trained = {p for r in out["lineage"] for p in r["prompt_ids"]}
    assert not trained & {s["prompt_id"] for s in skipped}
    assert out["report"]["before"]["skipped"] == out["report"]["after"]["skipped"] == 1


def _same_tokens_everywhere(cfg, out: dict, tmp_path, monkeypatch) -> None:
    """Training (rollouts/), the run's held-out evaluation and `rlax eval` give the sampler
    the same ids for the same problem."""
    spec = cfg.datasets[0].source
    rows = FilePrompts(spec).prompts  # the usable rows, in file order: prompt index -> content
    training = {}
    for pid, tokens in zip(*[read_rollouts(cfg.run_dir)[c] for c in ("prompt_id", "prompt_tokens")],
                           strict=True):  # fmt: skip
        training[int(pid.rsplit("/", 1)[1])] = [int(t) for t in tokens]
    assert training
    from rlax_tasks.run.report import HeldOutEvaluator

    heldout = HeldOutEvaluator(cfg)
    pairs = zip(heldout.prompts, heldout.prompt_ids, strict=True)
    by_row = {int(p.id.rsplit("/", 1)[1]): ids for p, ids in pairs}
    seen: list[list[int]] = []
    original = Sampler.generate

    def spy(self, prompts, *args, **kwargs):
        seen.extend([list(p) for p in prompts])
        return original(self, prompts, *args, **kwargs)

    monkeypatch.setattr(Sampler, "generate", spy)
    code = main([
        "eval", "--model-dir", cfg.model.path, "--dataset", spec.path, "--format", spec.format,
        "--prompt-config", os.path.join(cfg.run_dir, "config.yaml"), "--n", "1", "--k", "1",
        "--max-new-tokens", str(cfg.rollout.max_new_tokens), "--max-len",
        str(cfg.workers.max_len), "--out", str(tmp_path / f"eval-{cfg.run_id}"),
    ])  # fmt: skip
    assert code == 0
    results = json.loads((tmp_path / f"eval-{cfg.run_id}" / "results.json").read_text())
    assert results["models"][0]["overall"]["skipped"] == 1  # the long row, as in training
    frame = load_dataset(spec.path, spec.format).frame
    usable = [i for i in range(len(frame)) if i in by_row]  # rlax eval skips the long row too
    assert len(seen) == len(usable) == len(rows) - 1
    for i, ids in zip(usable, seen, strict=True):
        assert frame["prompt"].iat[i] == rows[i]
        assert ids == by_row[i], f"row {i}: rlax eval and held-out evaluation differ"
        if i in training:
            assert ids == training[i], f"row {i}: training and evaluation differ"
    assert set(training) <= set(by_row)


def _verifier_saw_decoded_text(cfg) -> None:
    """Each stored verdict is what the verifier says of the decoded completion."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    rollouts = read_rollouts(cfg.run_dir).drop_duplicates("prompt_id")
    refs = FilePrompts(cfg.datasets[0].source).references
    index = [int(p.rsplit("/", 1)[1]) for p in rollouts["prompt_id"]]
    texts = [[tokenizer.decode(list(t), skip_special_tokens=True)] for t in rollouts["tokens"]]
    code = cfg.datasets[0].verifier == "code"
    scores = score_completions(
        [None if code else refs[i] for i in index], [refs[i] if code else None for i in index],
        texts,
    )  # fmt: skip
    assert [s[0].verdict for s in scores] == rollouts["verdict"].tolist()


def _scripted_verdicts(cfg, texts: list[str]) -> list[str]:
    """The verdicts the run's scorer (the controller's ``RewardScorer`` over the run's datasets)
    gives ``texts`` as completions of the file's first row: each encoded with the run's tokenizer,
    ended by its EOS, decoded as a worker decodes. Random-model output is all ``no_answer``; a
    run's scoring path must also tell a right answer from a wrong one."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    spec = cfg.datasets[0]
    rows = FilePrompts(spec.source)
    prompt = Prompt(f"{spec.name}/0", 0, spec.name, 0, 0, rows.prompts[0], rows.references[0],
                    spec.verifier)  # fmt: skip
    ids = [tokenizer.encode(t, add_special_tokens=False) + [tokenizer.eos_token_id] for t in texts]
    completions = [Completion(Request((1,)), t, [0.0] * len(t), "eos") for t in ids]
    decoded = [tokenizer.decode(t, skip_special_tokens=True) for t in ids]
    assert decoded == texts
    result = GroupResult(prompt.id, 0, (1,), completions, decoded, 0.0)
    mixture = PromptMixture.from_specs(cfg.datasets, seed=cfg.seed)
    (scores,) = RewardScorer(mixture).score([prompt], [result])
    return [s.verdict for s in scores]


@pytest.mark.slow
def test_rlax_run_on_a_gsm8k_file_with_the_chat_template(tmp_path, chat_model_dir, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", TEST_XLA_FLAGS)  # the components need one device each
    fx = write_gsm8k(str(tmp_path))
    _add_long_row(fx.path, {"question": LONG + " How many?", "answer": "In all.\n#### 5"})
    long_index = sum(r["bad"] is None for r in fx.rows)  # the usable rows before it
    cfg = _config(tmp_path, chat_model_dir, "gsm8k", fx.path, "gsm8k", INSTRUCTION)
    out = _run(cfg, steps=3)
    _skipped_long_prompt(out, cfg, long_index)
    verdicts = set(read_rollouts(cfg.run_dir)["verdict"])
    assert verdicts <= {"correct", "incorrect", "no_answer"}, verdicts
    _verifier_saw_decoded_text(cfg)
    assert fx.rows[0]["answer"] == "72"  # Natalia's clips
    scripted = ["48/2 = 24 in May, 48 + 24 = 72 in all: \\boxed{72}", "So \\boxed{71}.", "No idea."]
    assert _scripted_verdicts(cfg, scripted) == ["correct", "incorrect", "no_answer"]
    _same_tokens_everywhere(cfg, out, tmp_path, monkeypatch)


@pytest.mark.slow
def test_rlax_run_on_a_code_file_with_the_chat_template(tmp_path, chat_model_dir, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", TEST_XLA_FLAGS)
    fx = write_code_apps(str(tmp_path))
    io = json.dumps({"inputs": ["1\n"], "outputs": ["1\n"]})
    _add_long_row(fx.path, {"problem_id": 99, "question": LONG, "input_output": io})
    long_index = sum(r["bad"] is None for r in fx.rows)
    cfg = _config(tmp_path, chat_model_dir, "apps", fx.path, "code",
                  "Answer with a Python program in a ```python block.")  # fmt: skip
    assert cfg.datasets[0].verifier == "code"  # from the format
    out = _run(cfg, steps=2)
    _skipped_long_prompt(out, cfg, long_index)
    rollouts = read_rollouts(cfg.run_dir)
    assert set(rollouts["verifier"]) == {"code"}
    assert set(rollouts["verdict"]) <= {
        "pass", "wrong_answer", "runtime_error", "compile_error", "timeout", "memory",
        "output_limit", "verifier_error",
    }  # fmt: skip
    _verifier_saw_decoded_text(cfg)
    program = "```python\na, b = map(int, input().split())\nprint(a {} b)\n```"
    scripted = [program.format("+"), program.format("-"), "```python\nprint(\n```"]
    assert _scripted_verdicts(cfg, scripted) == ["pass", "wrong_answer", "compile_error"]
    _same_tokens_everywhere(cfg, out, tmp_path, monkeypatch)
