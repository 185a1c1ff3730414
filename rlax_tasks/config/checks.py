"""The run configuration's error and field checks: every section validates through these.

A ``ConfigError`` (a ValueError) names the dotted field first (``staleness.max_staleness: ...``);
``build`` makes a section from a mapping, refusing unknown keys (with a did-you-mean) and
missing ones, and prefixes nested errors with the path."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

from rlax_tasks.utils import validation

# a run id or dataset name: it names a directory and prefixes prompt ids
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class ConfigError(ValueError):
    """An invalid run configuration; ``field`` is the dotted path of the offending value."""

    def __init__(self, field: str, message: str) -> None:
        self.field, self.message = field, message
        super().__init__(f"{field}: {message}" if field else message)

    def under(self, prefix: str) -> ConfigError:
        """The same error with ``prefix`` prepended to its field path."""
        if not prefix:
            return self
        if not self.field:
            return ConfigError(prefix, self.message)
        sep = "" if self.field.startswith("[") else "."
        return ConfigError(f"{prefix}{sep}{self.field}", self.message)


def set_field(obj: Any, name: str, value: Any) -> None:
    object.__setattr__(obj, name, value)


def check_int(obj: Any, name: str, low: int | None = None, optional: bool = False) -> None:
    validation.check_int(name, getattr(obj, name), ConfigError, minimum=low, optional=optional)


def check_float(
    obj: Any, name: str, low: float = -math.inf, high: float = math.inf, open_low: bool = False
) -> None:
    value = getattr(obj, name)
    bounds = {"low": low, "high": high, "open_low": open_low, "from_text": True}
    set_field(obj, name, validation.check_number(name, value, ConfigError, **bounds))


def check_str(obj: Any, name: str, choices: tuple[str, ...] | None = None) -> None:
    validation.check_text(name, getattr(obj, name), ConfigError)
    if choices is not None:
        validation.check_choice(name, getattr(obj, name), choices, ConfigError)


def check_bool(obj: Any, name: str) -> None:
    validation.check_bool(name, getattr(obj, name), ConfigError)


def check_mesh_shape(obj: Any, name: str) -> None:
    set_field(obj, name, validation.check_mesh_shape(name, getattr(obj, name), ConfigError))


def field_named(message: str, fields: Any) -> str:
    """The field a validation message starts with (longest match), or ""."""
    best = ""
    for f in fields:
        if message.startswith(f) and len(f) > len(best):
            nxt = message[len(f) : len(f) + 1]
            if not (nxt.isalnum() or nxt == "_"):
                best = f
    return best


def plain(value: Any) -> Any:
    """Tuples → lists and dataclasses → dicts, for YAML output."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


def build(
    cls: type, raw: Any, path: str, nested: Callable[[dict[str, Any]], dict[str, Any]] | None = None
) -> Any:
    """``cls(**raw)`` with unknown/missing keys checked and errors prefixed with ``path``;
    ``nested`` turns the values of nested sections into their classes first."""
    if not isinstance(raw, Mapping):
        raise ConfigError(path, f"must be a mapping, got {raw!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    try:
        validation.check_known(raw, fields, ConfigError)
    except ConfigError as e:
        raise e.under(path) from None
    missing = [
        n
        for n, f in fields.items()
        if n not in raw
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING  # type: ignore[misc]
    ]
    if missing:
        raise ConfigError(missing[0], "is required").under(path)
    try:
        values = nested(dict(raw)) if nested is not None else dict(raw)
        return cls(**values)
    except ConfigError as e:
        raise e.under(path) from None
