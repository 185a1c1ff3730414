"""Where a pulled version's arrays go: onto the devices of ``shardings`` or a ``like`` template.

``shardings``: one ``jax.sharding.Sharding`` for all, or a pytree of them by name, over the
template's leaves' own; both are checked against the version before any block is read, and the
result takes the template's structure. Without either, arrays stay numpy host arrays by name."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from rlax_tasks.paramserver.naming import flatten_named, unflatten_named
from rlax_tasks.paramserver.wire import Manifest, resolve_dtype


class Placement:
    """Where each array of one pulled version goes (validated at once), and the result's shape."""

    def __init__(self, manifest: Manifest, shardings: Any = None, like: Any = None) -> None:
        self.like = like
        template = flatten_named(like) if like is not None else None
        self._targets = _target_shardings(manifest, shardings, template)

    def place(self, name: str, host: np.ndarray) -> Any:
        """The complete host array ``name``, put where it goes (itself when it stays on host)."""
        sharding = self._targets.get(name)
        return host if sharding is None else jax.device_put(host, sharding)

    def result(self, arrays: dict[str, Any]) -> Any:
        """The placed arrays by name, in the template's structure when there is one."""
        return arrays if self.like is None else unflatten_named(self.like, arrays)


def _target_shardings(
    manifest: Manifest, shardings: Any, template: dict[str, Any] | None
) -> dict[str, Any]:
    """{name: Sharding or None} for the arrays of a pulled version (validated against them)."""
    specs = {a.name: a for a in manifest.arrays}
    out: dict[str, Any] = {}
    if template is not None:
        missing = sorted(set(template) - set(specs))
        extra = sorted(set(specs) - set(template))
        if missing or extra:
            raise ValueError(
                f"version {manifest.version} does not match the template: "
                f"template-only {missing[:5]}, version-only {extra[:5]}"
            )
        for name, leaf in template.items():
            spec = specs[name]
            if tuple(leaf.shape) != spec.shape or np.dtype(leaf.dtype) != resolve_dtype(spec.dtype):
                raise ValueError(
                    f"array {name!r}: version {manifest.version} has "
                    f"{spec.dtype}{list(spec.shape)}, "
                    f"the template {np.dtype(leaf.dtype)}{list(leaf.shape)}"
                )
            if isinstance(leaf, jax.Array):
                out[name] = leaf.sharding
    if shardings is None:
        return out
    if isinstance(shardings, jax.sharding.Sharding):
        return {name: shardings for name in specs}
    named = flatten_named(shardings)
    unknown = sorted(set(named) - set(specs))
    if unknown:
        raise ValueError(f"shardings name arrays the version lacks: {unknown[:5]}")
    out.update(named)
    return out
