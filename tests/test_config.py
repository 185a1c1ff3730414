"""Run configuration: presets load and validate; errors name the dotted field."""

from __future__ import annotations

import pytest
import yaml

from rlax_tasks.config import ConfigError, RunConfig, load_config, preset_names, save_resolved


def test_presets_load_validate_and_round_trip():
    assert {"tiny-arith", "qwen2.5-math-1.5b-grpo", "qwen2.5-math-1.5b-grpo-tpu",
            "qwq-32b-code"} <= set(preset_names())  # fmt: skip
    for name in preset_names():
        cfg = load_config(name)
        assert cfg.run_id == name
        assert RunConfig.from_dict(yaml.safe_load(cfg.to_yaml())) == cfg
    tiny = load_config("tiny-arith")
    assert tiny.workers.count == 1 and tiny.run_root == "runs"
    assert tiny.placement.mode == "colocated"  # the embedded default: one process
    assert tiny.datasets[0].source.task == "arithmetic" and tiny.model.warmup_if_missing
    qwq = load_config("qwq-32b-code")
    assert (qwq.staleness.reload_every, qwq.staleness.max_staleness) == (16, 32)
    assert qwq.datasets[0].verifier == "code" and qwq.objective_config().dynamic_sampling
    smol = load_config("smollm2-arith")
    assert smol.model.import_if_missing == "smollm2-135m-instruct"
    assert not smol.model.warmup_if_missing and smol.prompt.template == "chat"
    qwen = load_config("qwen2.5-math-1.5b-grpo")
    assert qwen.algorithm.preset == "grpo" and qwen.model.dtype == "bfloat16"


def test_overrides_dotted_and_nested():
    cfg = load_config(
        "tiny-arith",
        {
            "staleness.reload_every": 2,
            "staleness": {"max_staleness": None},
            "run_id": "x1",
            "algorithm": {"overrides": {"eps_high": 0.3}},
            "trainer.learning_rate": "1e-4",
        },
    )
    assert cfg.staleness.reload_every == 2 and cfg.staleness.max_staleness is None
    assert cfg.run_id == "x1" and cfg.objective_config().eps_high == 0.3
    assert cfg.algorithm.overrides == {"eps_high": 0.3}  # replaced, not merged
    assert cfg.trainer.learning_rate == 1e-4


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"staleness.max_staleness": 0},
            "staleness.max_staleness: must be >= reload_every (1), got 0",
        ),
        (
            {"staleness": {"reload_every": 4, "max_staleness": 2}},
            "staleness.max_staleness: must be >= reload_every (4)",
        ),
        ({"staleness.reload_every": 0}, "staleness.reload_every: must be >= 1"),
        ({"rollout.group_sise": 4}, "rollout.group_sise: unknown key (did you mean 'group_size'?)"),
        ({"rollout.group_size": 1}, "rollout.group_size: must be >= 2 for group-relative"),
        ({"rollout.top_p": 0.0}, "rollout.top_p: must lie in (0.0, 1.0]"),
        (
            {"algorithm.preset": "grp"},
            "algorithm.preset: unknown objective preset 'grp' (did you mean 'grpo'?)",
        ),
        (
            {"algorithm.overrides.eps_hgh": 0.3},
            "algorithm.overrides.eps_hgh: unknown objective field (did you mean 'eps_high'?)",
        ),
        ({"algorithm.overrides.kl_beta": -1}, "algorithm.overrides.kl_beta: kl_beta must be"),
        ({"trainer.lr": 1.0}, "trainer.lr: unknown key"),
        ({"trainer.remat": "some"}, "trainer.remat: "),
        ({"trainer.micro_batch_size": 7}, "trainer.micro_batch_size: must divide the batch"),
        ({"model.dtype": "float16"}, "model.dtype: must be one of ['float32', 'bfloat16']"),
        ({"workers.max_len": 8}, "workers.max_len: must exceed rollout.max_new_tokens (8)"),
        ({"eval.ks": [1, 16]}, "eval.ks: each k must be an integer in [1, num_samples=8]"),
        ({"eval.dataset.source.task": "arith"}, "eval.dataset.source.task: unknown task 'arith'"),
        ({"datasets": []}, "datasets: give at least one dataset"),
        (
            {
                "datasets": [
                    {"name": "a", "source": {"task": "arithmetic", "knobs": {"max_digits": 0}}}
                ]
            },
            "datasets[0].source.knobs: need 1 <= min_digits",
        ),
        (
            {"datasets": [{"name": "a", "source": {"path": "x.parquet", "verifer": "math"}}]},
            "datasets[0].source.verifer: unknown key (did you mean 'verifier'?)",
        ),
        (
            {"datasets": [{"name": "a", "weight": 0, "source": {"task": "countdown"}}]},
            "datasets[0].weight: must be > 0.0, got 0",
        ),
        (
            {
                "datasets": [
                    {"name": "a", "source": {"task": "countdown"}},
                    {"name": "a", "source": {"task": "arithmetic"}},
                ]
            },
            "datasets[1].name: duplicate dataset name 'a'",
        ),
        (
            {"datasets": [{"name": "a/b", "source": {"task": "countdown"}}]},
            "datasets[0].name: must be",
        ),
        ({"datasets": [{"name": "a"}]}, "datasets[0].source: is required"),
        ({"seeed": 1}, "seeed: unknown key (did you mean 'seed'?)"),
        (
            {"model.warmup_if_missing": False, "model.import_if_missing": "smollm2-135m"},
            "model.import_if_missing: must be one of ['smollm2-135m-instruct']",
        ),
        (
            {"model.import_if_missing": "smollm2-135m-instruct"},
            "model.import_if_missing: choose one way to build a missing model",
        ),
        (
            {"rollout.top_k": 100, "rollout.support_capacity": 64},
            "rollout.support_capacity: must be >= top_k (100) to record each token's kept ids",
        ),
    ],
)
def test_bad_values_name_the_dotted_field(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config("tiny-arith", overrides)
    assert str(info.value).startswith(message), str(info.value)


def test_unknown_preset_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="did you mean 'tiny-arith'"):
        load_config("tiny-arth")
    with pytest.raises(FileNotFoundError):
        load_config(str(tmp_path / "nope.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(str(bad))


def test_resolved_config_is_written_and_reloads(tmp_path):
    cfg = load_config("tiny-arith", {"run_root": str(tmp_path), "run_id": "r1", "seed": 5})
    path = save_resolved(cfg)
    assert path == str(tmp_path / "r1" / "config.yaml")
    assert load_config(path) == cfg


def test_dr_grpo_runs_normalise_by_the_generation_budget():
    """agg=max_length without max_length would divide by each batch's padded width."""
    cfg = load_config("tiny-arith", {"algorithm.preset": "dr_grpo"})
    assert cfg.objective_overrides()["max_length"] == cfg.rollout.max_new_tokens
    assert cfg.objective_config().max_length == cfg.rollout.max_new_tokens
    pinned = load_config(
        "tiny-arith", {"algorithm.preset": "dr_grpo", "algorithm.overrides": {"max_length": 64}}
    )
    assert pinned.objective_config().max_length == 64
    assert "max_length" not in load_config("tiny-arith").objective_overrides()


def test_validation_helpers_name_the_field_in_the_callers_error():
    """One wording for every configuration class; each keeps its own error type."""
    from rlax_tasks.trainer import TrainerConfig, TrainerConfigError
    from rlax_tasks.utils.validation import check_choice, check_int, check_number, field_error

    with pytest.raises(ConfigError, match=r"^slots: must be >= 1, got 0$"):
        check_int("slots", 0, ConfigError, minimum=1)
    plain = field_error(ValueError)
    with pytest.raises(ValueError, match=r"^top_p must lie in \(0.0, 1.0\], got 1.5$"):
        check_number("top_p", 1.5, plain, low=0.0, high=1.0, open_low=True)
    with pytest.raises(ValueError, match=r"^lr must be a finite number, got nan$"):
        check_number("lr", float("nan"), plain)
    assert check_number("lr", "1e-4", plain, from_text=True) == 1e-4
    with pytest.raises(ValueError, match=r"got 'fulll' \(did you mean 'full'\?\)$"):
        check_choice("remat", "fulll", ("none", "full", "dots"), plain)
    with pytest.raises(TrainerConfigError, match="^remat must be one of"):
        TrainerConfig(remat="fulll")
    with pytest.raises(TrainerConfigError, match="^adam_b2 must lie in \\[0.0, 1.0\\)"):
        TrainerConfig(adam_b2=1.0)


def test_workers_record_kept_ids_only_when_top_k_or_top_p_filters():
    """rollout.support_size: the ids per token a worker records for the trainer's sampling-mask
    replay; none for unfiltered or greedy sampling, or with support_capacity 0."""
    sizes = {
        overrides: load_config("tiny-arith", dict(overrides)).rollout.support_size
        for overrides in (
            (),
            (("rollout.top_k", 20),),
            (("rollout.top_p", 0.95),),
            (("rollout.top_p", 0.95), ("rollout.temperature", 0.0)),
            (("rollout.top_k", 20), ("rollout.support_capacity", 0)),
        )
    }
    assert list(sizes.values()) == [0, 20, 64, 0, 0]
