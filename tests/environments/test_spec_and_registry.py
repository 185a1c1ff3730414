"""EnvironmentSpec validation (each field's message names it) and the registry: decorators,
name clashes, settings errors, and a user package's entry point found through real metadata."""

from __future__ import annotations

import importlib
import sys
import textwrap

import pytest

from rlax_tasks.config.checks import ConfigError
from rlax_tasks.environments import (
    ENTRY_POINT_GROUP,
    CalculatorEnvironment,
    Environment,
    EnvironmentSpec,
    StepResult,
    check_environment,
    environment_names,
    make_environment,
    register,
)

BUILTINS = ("calculator", "code", "python")


def test_a_spec_round_trips_and_has_the_documented_defaults() -> None:
    spec = EnvironmentSpec.from_dict({"name": "code", "settings": {"show_failures": 1}})
    assert (spec.max_turns, spec.max_tokens, spec.tool_timeout_s) == (4, None, 10.0)
    assert spec.max_observation_tokens == 512
    raw = spec.to_dict()
    assert raw == {
        "name": "code",
        "max_turns": 4,
        "max_tokens": None,
        "tool_timeout_s": 10.0,
        "max_observation_tokens": 512,
        "settings": {"show_failures": 1},
    }
    assert EnvironmentSpec.from_dict(raw) == spec
    assert EnvironmentSpec.from_dict("calculator") == EnvironmentSpec("calculator")


@pytest.mark.parametrize(
    "raw, field, words",
    [
        ({"max_turns": 2}, "name", "is required"),
        ({"name": "calculator", "max_turn": 2}, "max_turn", "valid: name, max_turns"),
        ({"name": "calculator", "max_turns": 0}, "max_turns", ">= 1"),
        ({"name": "calculator", "max_turns": 2.5}, "max_turns", "integer"),
        ({"name": "calculator", "max_tokens": 0}, "max_tokens", ">= 1"),
        ({"name": "calculator", "tool_timeout_s": 0}, "tool_timeout_s", "> 0"),
        ({"name": "calculator", "max_observation_tokens": -1}, "max_observation_tokens", ">= 1"),
        ({"name": "calculator", "settings": ["x"]}, "settings", "mapping"),
        ({"name": "calculator", "settings": {"not a name": 1}}, "settings", "keyword"),
        ({"name": ""}, "name", "non-empty string"),
    ],
)
def test_every_invalid_field_is_named(raw: dict, field: str, words: str) -> None:
    with pytest.raises(ConfigError) as caught:
        EnvironmentSpec.from_dict(raw)
    assert caught.value.field == field
    assert words in caught.value.message


def test_an_unknown_name_lists_the_registered_ones_with_a_did_you_mean() -> None:
    check_environment(EnvironmentSpec("calculator"))
    with pytest.raises(ConfigError) as caught:
        check_environment(EnvironmentSpec.from_dict({"name": "calculater"}))
    assert caught.value.field == "name"
    assert "(did you mean 'calculator'?)" in caught.value.message
    registered = caught.value.message.split("registered: ", 1)[1]
    # (every built-in; another test's environment may be registered in this process too)
    assert all(name in registered.split(" (")[0].split(", ") for name in BUILTINS)
    with pytest.raises(ValueError, match=r"unknown environment 'nope'; registered: calculator"):
        make_environment(EnvironmentSpec("nope"))


def test_make_environment_passes_the_settings_and_names_a_bad_one() -> None:
    env = make_environment(EnvironmentSpec("calculator", settings={"system": "Use tools."}))
    assert isinstance(env, CalculatorEnvironment) and isinstance(env, Environment)
    assert env.reset({"prompt": "1+1?", "answer": "2"})[0] == {
        "role": "system",
        "content": "Use tools.",
    }
    with pytest.raises(ValueError, match=r"'calculator': unknown setting 'sytem' \(did you mean"):
        make_environment(EnvironmentSpec("calculator", settings={"sytem": "x"}))
    with pytest.raises(ValueError, match=r"'code'.*show_failures must be an integer >= 0"):
        make_environment(EnvironmentSpec("code", settings={"show_failures": -1}))


class _Echo:
    """An environment that ends every episode at once."""

    tools: list[dict] = []

    def __init__(self, reward: float = 1.0) -> None:
        self.reward = reward

    def reset(self, row: dict) -> list[dict]:
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, turn: str) -> StepResult:
        return StepResult((), True, self.reward)


def test_register_as_a_decorator_and_directly_and_a_clash_is_refused() -> None:
    decorated = register("test-echo-decorated")(_Echo)
    assert decorated is _Echo
    assert register("test-echo-direct", _Echo) is _Echo
    assert register("test-echo-direct", _Echo) is _Echo  # the same factory again: fine
    assert {"test-echo-decorated", "test-echo-direct"} <= set(environment_names())
    env = make_environment(EnvironmentSpec("test-echo-direct", settings={"reward": 0.5}))
    assert env.step("x") == StepResult((), True, 0.5)
    with pytest.raises(ValueError, match=r"'test-echo-direct' is already registered to .*_Echo"):
        register("test-echo-direct", CalculatorEnvironment)

    @register("test-not-an-env")
    def broken_factory() -> object:
        return object()

    with pytest.raises(TypeError, match=r"'test-not-an-env'.*not an Environment"):
        make_environment(EnvironmentSpec("test-not-an-env"))


@pytest.fixture
def user_package(tmp_path, monkeypatch):
    """A distribution installed on a temporary sys.path entry: a module with an environment,
    and entry points for it and for a module that does not exist."""
    module = "rlax_test_user_envs"
    (tmp_path / f"{module}.py").write_text(
        textwrap.dedent(
            """
            from rlax_tasks.environments import StepResult

            class Countdown:
                tools = []

                def __init__(self, start=3):
                    self.start = start

                def reset(self, row):
                    return [{"role": "user", "content": f"count down from {self.start}"}]

                def step(self, turn):
                    return StepResult((), True, float(turn.strip() == "done"))
            """
        )
    )
    info = tmp_path / "rlax_test_user_envs-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: rlax-test-user-envs\nVersion: 0.1\n"
    )
    (info / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\n"
        f"test-countdown = {module}:Countdown\n"
        "test-broken = rlax_test_no_such_module:Nothing\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    yield module
    sys.modules.pop(module, None)


def test_an_entry_point_environment_is_found_and_loaded_on_first_use(user_package) -> None:
    assert user_package not in sys.modules
    assert {"test-countdown", "test-broken"} <= set(environment_names())
    assert user_package not in sys.modules  # listing the names loads nothing
    spec = EnvironmentSpec.from_dict({"name": "test-countdown", "settings": {"start": 5}})
    env = make_environment(spec)
    assert type(env).__module__ == user_package
    assert env.reset({}) == [{"role": "user", "content": "count down from 5"}]
    assert env.step("done").reward == 1.0


def test_a_broken_entry_point_is_named_when_asked_for_and_harms_no_other(user_package) -> None:
    with pytest.raises(ValueError) as caught:
        make_environment(EnvironmentSpec("test-broken"))
    message = str(caught.value)
    assert "'test-broken'" in message and "rlax_test_no_such_module:Nothing" in message
    assert "ModuleNotFoundError" in message and "'rlax-test-user-envs'" in message
    assert isinstance(make_environment(EnvironmentSpec("test-countdown")), Environment)
    assert isinstance(make_environment(EnvironmentSpec("calculator")), CalculatorEnvironment)
