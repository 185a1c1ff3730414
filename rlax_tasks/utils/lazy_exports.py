"""Package names that load their module on first use (PEP 562), so that importing a package
never loads JAX, Flax, Optax, Orbax or pandas behind the caller's back.

``__all__, __getattr__, __dir__ = lazy_exports(__name__, {"Sampler": ".sampler", ...})`` in a
package ``__init__``; a module path is relative to the package or absolute."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    package: str, exports: Mapping[str, str]
) -> tuple[list[str], Callable[[str], Any], Callable[[], list[str]]]:
    """``(__all__, __getattr__, __dir__)`` for ``package``, whose public name ``n`` is defined in
    the module ``exports[n]`` (".module" relative to the package, or an absolute name)."""
    table = dict(exports)

    def __getattr__(name: str) -> Any:
        if name not in table:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(table[name], package), name)
        setattr(sys.modules[package], name, value)  # later lookups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(table))

    return sorted(table), __getattr__, __dir__
