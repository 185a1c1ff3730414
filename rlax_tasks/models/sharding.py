"""Sharding of parameters and activations over a (data, fsdp, expert, tensor) device mesh.

Parameters get a PartitionSpec from one name-based rule table; activations are constrained in the
forward pass while a mesh is active (``jax.set_mesh``). A mesh axis that does not divide a
dimension is dropped for it (replicated), so tiny test models run on any mesh. The ``expert``
axis splits a mixture-of-experts model's experts and, everywhere else, the batch
(docs/design.md §14)."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

log = logging.getLogger(__name__)

MESH_AXES = ("data", "fsdp", "expert", "tensor")
# batch dimension of activations is split over the data-parallel axes (the expert axis is one
# outside the experts)
BATCH = ("data", "fsdp", "expert")

AxisSpec = str | tuple[str, ...] | None

# (module name, parameter name) -> per-dimension mesh axes, for an unstacked parameter.
_PARAM_RULES: dict[tuple[str, str], tuple[AxisSpec, ...]] = {
    ("embed_tokens", "embedding"): ("tensor", "fsdp"),
    ("lm_head", "kernel"): ("fsdp", "tensor"),
    ("q_proj", "kernel"): ("fsdp", "tensor", None),
    ("k_proj", "kernel"): ("fsdp", "tensor", None),
    ("v_proj", "kernel"): ("fsdp", "tensor", None),
    ("q_proj", "bias"): ("tensor", None),
    ("k_proj", "bias"): ("tensor", None),
    ("v_proj", "bias"): ("tensor", None),
    ("o_proj", "kernel"): ("tensor", None, "fsdp"),
    ("gate_proj", "kernel"): ("fsdp", "tensor"),
    ("up_proj", "kernel"): ("fsdp", "tensor"),
    ("gate_proj", "bias"): ("tensor",),
    ("up_proj", "bias"): ("tensor",),
    ("down_proj", "kernel"): ("tensor", "fsdp"),
    # mixture of experts: the router, and the experts' stacked weights [E, in, out]
    ("gate", "kernel"): ("fsdp", None),
    ("experts", "gate_proj"): ("expert", "fsdp", "tensor"),
    ("experts", "up_proj"): ("expert", "fsdp", "tensor"),
    ("experts", "down_proj"): ("expert", "tensor", "fsdp"),
}


def make_mesh(
    data: int = 1,
    fsdp: int = -1,
    tensor: int = 1,
    devices: Sequence[Any] | None = None,
    *,
    expert: int = 1,
) -> Mesh:
    """A (data, fsdp, expert, tensor) mesh; one axis may be -1 to take the remaining devices."""
    devices = list(devices if devices is not None else jax.devices())
    sizes = [data, fsdp, expert, tensor]
    if sizes.count(-1) > 1:
        raise ValueError("at most one of data/fsdp/expert/tensor may be -1")
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if len(devices) % known:
            raise ValueError(f"{len(devices)} devices do not split into mesh axes {sizes}")
        sizes[sizes.index(-1)] = len(devices) // known
    if math.prod(sizes) != len(devices):
        raise ValueError(
            f"mesh data={sizes[0]} x fsdp={sizes[1]} x expert={sizes[2]} x tensor={sizes[3]} "
            f"needs {math.prod(sizes)} devices, have {len(devices)}"
        )
    return Mesh(np.asarray(devices).reshape(sizes), MESH_AXES)


def mesh_from_shape(shape: Sequence[int], devices: Sequence[Any] | None = None) -> Mesh:
    """The mesh of a config's ``mesh_shape``: (data, fsdp, tensor) or (data, fsdp, expert,
    tensor), over ``devices`` (default: all)."""
    if len(shape) == 3:
        data, fsdp, tensor = shape
        return make_mesh(data, fsdp, tensor, devices=devices)
    data, fsdp, expert, tensor = shape
    return make_mesh(data, fsdp, tensor, devices=devices, expert=expert)


def rlax_mesh(mesh: Mesh) -> Mesh:
    """``mesh`` as the model shards over it: axes named from data, fsdp, tensor (any subset, any
    order), every axis Auto (``jax.make_mesh`` makes Explicit ones, under which the embedding
    lookup's gather has no sharding rule). Other axis names are a ValueError saying what to do."""
    names = tuple(mesh.axis_names)
    unknown = [n for n in names if n not in MESH_AXES]
    if unknown or len(set(names)) != len(names):
        raise ValueError(
            f"mesh axes {names}: RLAX shards over axes named {', '.join(MESH_AXES)} (any of "
            f"them, each once); build it as jax.make_mesh((1, {mesh.size}), ('fsdp', 'tensor')) "
            "or rlax_tasks.models.make_mesh(data, fsdp, tensor, expert=1)"
        )
    auto = jax.sharding.AxisType.Auto
    if all(t == auto for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, names, axis_types=(auto,) * len(names))


def fit_spec(shape: Sequence[int], spec: Sequence[AxisSpec], mesh_shape: dict[str, int]) -> P:
    """The spec with each axis that does not divide its dimension (or is absent) set to None."""
    fitted: list[AxisSpec] = []
    for dim, axes in zip(shape, spec, strict=True):
        names = (axes,) if isinstance(axes, str) else tuple(axes or ())
        names = tuple(n for n in names if n in mesh_shape)
        size = math.prod(mesh_shape[n] for n in names)
        if not names or dim % size:
            fitted.append(None)
        else:
            fitted.append(names[0] if len(names) == 1 else names)
    return P(*fitted)


def param_spec(path: Sequence[str], shape: Sequence[int]) -> tuple[AxisSpec, ...]:
    """Mesh axes of a parameter from its path in the model state (stacked layers get None)."""
    names = [str(p) for p in path]
    stacked = "layers" in names
    key = (names[-2], names[-1]) if len(names) >= 2 else ("", names[-1])
    rule = _PARAM_RULES.get(key)
    if rule is None:  # norms, output bias: small, replicated
        rule = (None,) * (len(shape) - int(stacked))
    if stacked:
        rule = (None, *rule)
    if len(rule) != len(shape):
        raise ValueError(f"sharding rule {rule} does not fit parameter {'/'.join(names)} {shape}")
    return rule


def param_shardings(params: Any, mesh: Mesh) -> Any:
    """A pytree of NamedSharding matching ``params`` (an nnx.State or nested dict of arrays)."""
    mesh_shape = dict(mesh.shape)

    def one(path: tuple[Any, ...], leaf: Any) -> NamedSharding:
        keys = [getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path]
        keys = [k for k in keys if k != "value"]
        spec = fit_spec(leaf.shape, param_spec(keys, leaf.shape), mesh_shape)
        return NamedSharding(mesh, spec)

    return jax.tree_util.tree_map_with_path(one, params)


def shard_params(params: Any, mesh: Mesh) -> Any:
    """Places ``params`` on ``mesh`` following the rule table."""
    return jax.device_put(params, param_shardings(params, mesh))


def constrain(x: jax.Array, *spec: AxisSpec) -> jax.Array:
    """with_sharding_constraint on the active mesh; a no-op when no mesh is set (single device)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    fitted = fit_spec(x.shape, spec, dict(mesh.shape))
    return jax.lax.with_sharding_constraint(x, fitted)
