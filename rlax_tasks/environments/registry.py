"""The table of environments by name: built-ins register at import, user packages through the
entry point group ``rlax.environments`` (name = environment name, value = its factory), loaded
on first lookup (docs/design.md §15)."""

from __future__ import annotations

import importlib.metadata
import inspect
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from rlax_tasks.utils.validation import did_you_mean

if TYPE_CHECKING:
    from rlax_tasks.environments.base import Environment, EnvironmentSpec

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "rlax.environments"
Factory = Callable[..., Any]
F = TypeVar("F", bound=Factory)

_FACTORIES: dict[str, Factory] = {}


def register(name: str, factory: F | None = None) -> Any:
    """Enter ``factory`` (a class or function returning an Environment) under ``name``; without
    ``factory``, a decorator. A name taken by another factory is a ValueError."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"an environment name must be a non-empty string, got {name!r}")
    if factory is None:
        return lambda f: register(name, f)
    if not callable(factory):
        raise ValueError(f"environment {name!r}: the factory must be callable, got {factory!r}")
    taken = _FACTORIES.get(name)
    if taken is not None and taken is not factory:
        raise ValueError(
            f"environment {name!r} is already registered to {_describe(taken)}; register "
            f"{_describe(factory)} under another name"
        )
    _FACTORIES[name] = factory
    return factory


def environment_names() -> list[str]:
    """Every environment name: registered ones and those of installed entry points (unloaded)."""
    return sorted(set(_FACTORIES) | set(_entry_points()))


def make_environment(spec: EnvironmentSpec) -> Environment:
    """A fresh environment for ``spec``: its factory called with ``spec.settings``; a setting
    the factory does not take is a ValueError naming the environment and the setting."""
    factory = _factory(spec.name)
    settings = dict(spec.settings)
    _check_settings(spec.name, factory, settings)
    try:
        env = factory(**settings)
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"environment {spec.name!r}: settings {settings!r} rejected: {exc}; fix "
            f"datasets[].environment.settings"
        ) from exc
    from rlax_tasks.environments.base import Environment  # base imports this module

    if not isinstance(env, Environment):
        raise TypeError(
            f"environment {spec.name!r}: {_describe(factory)} returned {type(env).__name__}, "
            "which is not an Environment (it needs reset(row), step(turn) and tools)"
        )
    return env


def _factory(name: str) -> Factory:
    """The factory of ``name``, loading its entry point the first time it is asked for."""
    if name in _FACTORIES:
        return _FACTORIES[name]
    points = _entry_points()
    if name not in points:
        names = environment_names()
        raise ValueError(
            f"unknown environment {name!r}{did_you_mean(name, names)}; registered: "
            f"{', '.join(names)}"
        )
    point = points[name]
    try:
        factory = point.load()
    except Exception as exc:  # noqa: BLE001 - any import failure of a user package
        logger.warning("entry point %s = %s failed to load: %r", name, point.value, exc)
        raise ValueError(
            f"environment {name!r}: its entry point {point.value!r} (group "
            f"{ENTRY_POINT_GROUP!r}{_distribution(point)}) failed to load: "
            f"{type(exc).__name__}: {exc}; fix or reinstall that package"
        ) from exc
    if not callable(factory):
        raise ValueError(
            f"environment {name!r}: its entry point {point.value!r} is {factory!r}, not a class "
            "or function that makes an environment"
        )
    return register(name, factory)


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    """The installed ``rlax.environments`` entry points by name (the first of duplicates)."""
    try:
        found = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    except Exception as exc:  # noqa: BLE001 - broken metadata must not break lookups
        logger.warning("cannot list the %s entry points: %r", ENTRY_POINT_GROUP, exc)
        return {}
    points: dict[str, importlib.metadata.EntryPoint] = {}
    for point in found:
        if point.name in points and points[point.name].value != point.value:
            logger.warning(
                "two entry points named %r in %s: %s and %s; using the first",
                point.name,
                ENTRY_POINT_GROUP,
                points[point.name].value,
                point.value,
            )
        points.setdefault(point.name, point)
    return points


def _check_settings(name: str, factory: Factory, settings: dict[str, Any]) -> None:
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # no signature (a builtin): the call itself will tell
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    valid = [n for n, p in params.items() if p.kind is not inspect.Parameter.VAR_POSITIONAL]
    for key in settings:
        if key not in valid:
            raise ValueError(
                f"environment {name!r}: unknown setting {key!r}{did_you_mean(key, valid)}; "
                f"valid settings: {', '.join(valid) or '(none)'}"
            )


def _describe(factory: Factory) -> str:
    module = getattr(factory, "__module__", None)
    qualname = getattr(factory, "__qualname__", None)
    return f"{module}.{qualname}" if module and qualname else repr(factory)


def _distribution(point: importlib.metadata.EntryPoint) -> str:
    dist = getattr(point, "dist", None)
    name = getattr(dist, "name", None) if dist is not None else None
    return f", distribution {name!r}" if name else ""
