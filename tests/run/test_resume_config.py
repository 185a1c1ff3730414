"""A resume cannot silently change training: ``save_resolved`` compares the new settings with the
run's config.yaml, and `rlax run` refuses a changed resume unless --allow-config-change, which
records each change with its step; a run already at --steps starts nothing."""

from __future__ import annotations

import json
import os

import pytest
import yaml

from rlax_tasks.cli import main
from rlax_tasks.config import (
    ConfigChangeError,
    RunConfig,
    config_changes,
    load_config,
    save_resolved,
)
from rlax_tasks.rundir.paths import run_paths
from tests.plan.test_preflight import model_shapes_only

LR_CHANGE = "trainer.learning_rate 0.0003 → 1000000000.0"


def _cfg(tmp_path, model: str = "unused", **overrides) -> RunConfig:
    return load_config(
        "tiny-arith",
        {"run_root": str(tmp_path / "runs"), "model.path": model,
         "model.warmup_if_missing": False, "compilation_cache": False, **overrides},
    )  # fmt: skip


def _trained_to(cfg: RunConfig, step: int) -> None:
    with open(run_paths(cfg.run_dir).metrics, "w") as f:
        for s in range(1, step + 1):
            f.write(json.dumps({"step": s, "reward_mean": 0.5}) + "\n")


def _changes(cfg: RunConfig) -> list[dict]:
    with open(run_paths(cfg.run_dir).config_changes) as f:
        return [json.loads(line) for line in f]


def test_a_training_change_is_refused_unless_allowed_then_recorded_with_its_step(tmp_path):
    cfg = _cfg(tmp_path)
    path = save_resolved(cfg)
    save_resolved(cfg)  # the same settings again: nothing to compare, nothing recorded
    assert not os.path.exists(run_paths(cfg.run_dir).config_changes)
    _trained_to(cfg, 7)
    before = open(path).read()
    changed = _cfg(tmp_path, **{"trainer.learning_rate": 1e9, "rollout.group_size": 4})
    with pytest.raises(ConfigChangeError) as info:
        save_resolved(changed)
    msg = str(info.value)
    assert isinstance(info.value, ValueError) and "\n" not in msg
    assert f"rollout.group_size 8 → 4, {LR_CHANGE}" in msg
    assert "--allow-config-change" in msg and "after step 7" in msg
    assert open(path).read() == before  # refused: nothing written

    save_resolved(changed, allow_config_change=True)
    assert load_config(path) == changed
    rows = [{k: r[k] for k in ("field", "old", "new", "step", "changes_training")}
            for r in _changes(cfg)]  # fmt: skip
    assert rows == [
        {"field": "rollout.group_size", "old": 8, "new": 4, "step": 7, "changes_training": True},
        {"field": "trainer.learning_rate", "old": 3e-4, "new": 1e9, "step": 7,
         "changes_training": True},
    ]  # fmt: skip


def test_harmless_changes_pass_and_are_recorded(tmp_path):
    cfg = _cfg(tmp_path)
    save_resolved(cfg)
    other = _cfg(
        tmp_path, **{"eval.every_steps": 5, "workers.slots": 64, "trainer.checkpoint_every": 2}
    )
    save_resolved(other)  # not refused
    assert load_config(run_paths(cfg.run_dir).config) == other
    assert [(r["field"], r["changes_training"], r["step"]) for r in _changes(cfg)] == [
        ("eval.every_steps", False, 0),
        ("trainer.checkpoint_every", False, 0),
        ("workers.slots", False, 0),
    ]


@pytest.mark.parametrize(
    ("overrides", "field", "training"),
    [
        ({"model.dtype": "bfloat16"}, "model.dtype", True),
        ({"seed": 3}, "seed", True),
        ({"staleness.max_staleness": 3}, "staleness.max_staleness", True),
        ({"algorithm.preset": "dapo"}, "algorithm.preset", True),
        ({"datasets": [{"name": "arith", "source": {"task": "countdown"}}]},
         "datasets[0].source.task", True),
        ({"workers.max_len": 64}, "workers.max_len", True),  # which prompts fit
        ({"prompt.system": "Be brief."}, "prompt.system", True),
        ({"trainer.remat": "full"}, "trainer.remat", False),
        ({"placement.mode": "disaggregated"}, "placement.mode", False),
        ({"model.warmup_if_missing": True}, "model.warmup_if_missing", False),
        ({"eval.num_prompts": 16}, "eval.num_prompts", False),
    ],
)  # fmt: skip
def test_which_settings_change_training(tmp_path, overrides, field, training):
    old = yaml.safe_load(_cfg(tmp_path).to_yaml())
    changes = {c.field: c for c in config_changes(old, _cfg(tmp_path, **overrides))}
    assert field in changes, sorted(changes)
    assert changes[field].changes_training is training


# --------------------------------------------------------------------------- rlax run
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return model_shapes_only(tmp_path_factory.mktemp("model"))


def _argv(cfg: RunConfig, *extra: str) -> list[str]:
    return ["run", "--preset", "tiny-arith", "--run-root", cfg.run_root, "--no-eval",
            "--set", f"model.path={cfg.model.path}", "--set", "model.warmup_if_missing=false",
            "--set", "compilation_cache=false", *extra]  # fmt: skip


class FinishingSupervisor:
    """Stands in for rlax_tasks.run.supervisor.Supervisor: starts nothing, and reports the
    run's one job done at once."""

    started: list[str] = []

    def __init__(self, log_dir: str) -> None:
        self.components: dict = {}

    def add(self, component):
        FinishingSupervisor.started.append(component.name)
        self.components[component.name] = component
        return component

    def poll(self) -> dict:
        return {name: 0 for name in self.components}

    def stop(self) -> None:
        pass


def test_rlax_run_refuses_a_changed_resume_before_anything_starts(tmp_path, model_dir, capsys):
    cfg = _cfg(tmp_path, model_dir)
    save_resolved(cfg)
    _trained_to(cfg, 2)
    code = main(_argv(cfg, "--steps", "5", "--set", "trainer.learning_rate=1e9"))
    err = capsys.readouterr().err
    assert code == 2, err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"rlax run: error: run {cfg.run_dir} was started with other")
    assert LR_CHANGE in last and "Traceback" not in err
    assert not os.path.exists(run_paths(cfg.run_dir).logs)  # no component started


def test_rlax_run_allow_config_change_records_it(tmp_path, model_dir, monkeypatch, capsys):
    from rlax_tasks.run import local_run

    monkeypatch.setattr(local_run, "Supervisor", FinishingSupervisor)
    FinishingSupervisor.started.clear()
    cfg = _cfg(tmp_path, model_dir)
    save_resolved(cfg)
    _trained_to(cfg, 2)
    argv = _argv(cfg, "--steps", "5", "--set", "trainer.learning_rate=1e9")
    assert main([*argv, "--allow-config-change"]) == 0, capsys.readouterr().err
    assert FinishingSupervisor.started == ["colocated"]
    assert load_config(run_paths(cfg.run_dir).config).trainer.learning_rate == 1e9
    (row,) = _changes(cfg)
    assert (row["field"], row["old"], row["new"], row["step"]) == (
        "trainer.learning_rate", 3e-4, 1e9, 2,
    )  # fmt: skip


def test_a_run_already_at_steps_says_so_and_starts_nothing(tmp_path, model_dir, capsys):
    cfg = _cfg(tmp_path, model_dir)
    save_resolved(cfg)
    _trained_to(cfg, 220)
    assert main(_argv(cfg, "--steps", "5")) == 0
    out = capsys.readouterr().out
    assert f"run {cfg.run_dir} is already at step 220 of 5: nothing to train" in out
    assert not os.path.exists(run_paths(cfg.run_dir).logs)
