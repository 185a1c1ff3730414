"""Weight names: a pytree of arrays <-> a flat dict keyed by its dotted pytree paths.

The names are those of ``Policy.named_params()`` ("layers.self_attn.q_proj.kernel"): one entry
per ``nnx.Variable``, other path keys joined with "."; a flat ``{name: array}`` dict is its own
flattening, so it can be pushed as is."""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def _key_name(key: Any) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def leaf_names(tree: Any) -> list[str]:
    """Dotted names of the leaves of ``tree``, in ``jax.tree_util.tree_leaves`` order."""
    paths = jax.tree_util.tree_leaves_with_path(tree, is_leaf=_is_variable)
    names = [".".join(_key_name(k) for k in path) for path, _ in paths]
    if len(names) != len(jax.tree_util.tree_leaves(tree)):
        raise ValueError("a Variable in the pytree holds more than one array: cannot name it")
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"pytree paths collide after joining with '.': {dup[:5]}")
    return names


def flatten_named(tree: Any) -> dict[str, Any]:
    """{dotted path: array} of a pytree (an nnx.State, nested dicts, a flat name dict, ...)."""
    return dict(zip(leaf_names(tree), jax.tree_util.tree_leaves(tree), strict=True))


def unflatten_named(template: Any, arrays: dict[str, Any]) -> Any:
    """A pytree shaped like ``template`` whose leaves are ``arrays[name]`` (names must match)."""
    names = leaf_names(template)
    missing = [n for n in names if n not in arrays]
    extra = sorted(set(arrays) - set(names))
    if missing or extra:
        raise ValueError(
            f"pulled weights do not match the template: missing {missing[:5]}, "
            f"unexpected {extra[:5]}"
        )
    treedef = jax.tree_util.tree_structure(template)
    return jax.tree_util.tree_unflatten(treedef, [arrays[n] for n in names])
