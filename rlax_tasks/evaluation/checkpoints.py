"""Loading the policy to evaluate: an HF directory, optionally with the weights of a version
mirrored by the parameter server (`run_root/weights/v<version>/`). Orbax run checkpoints are not
read here (`rlax export RUN_DIR[@STEP] OUT_DIR` makes one an HF directory); other loaders plug in
through `register_loader`, so `rlax eval` picks them up."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rlax_tasks.models import load_pretrained
from rlax_tasks.paramserver import mirror
from rlax_tasks.paramserver.wire import resolve_dtype
from rlax_tasks.rundir.paths import CHECKPOINTS

logger = logging.getLogger(__name__)

# (path) -> Policy or None when the loader does not recognise the path; tried in order
Loader = Callable[[str], Any]
_LOADERS: list[tuple[str, Loader]] = []


def register_loader(name: str, loader: Loader) -> None:
    """Adds a model loader (e.g. for Orbax run checkpoints), tried before the HF one."""
    _LOADERS.insert(0, (name, loader))


def unregister_loader(name: str) -> None:
    """Removes the loader registered as `name` (no-op when there is none)."""
    _LOADERS[:] = [(n, f) for n, f in _LOADERS if n != name]


def _is_orbax_checkpoint(path: str) -> bool:
    if not os.path.isdir(path):
        return False
    names = set(os.listdir(path))
    return bool(names & {"_CHECKPOINT_METADATA", "_METADATA", "state", "params"}) and (
        "config.json" not in names
    )


def _export_command(path: str) -> str:
    """The `rlax export` command for a checkpoint step directory (RUN_DIR/checkpoints/<step>)."""
    checkpoints, step = os.path.split(os.path.normpath(path))
    if step.isdigit() and os.path.basename(checkpoints) == CHECKPOINTS:
        return f"rlax export {os.path.dirname(checkpoints) or '.'}@{step} OUT_DIR"
    return "rlax export RUN_DIR[@STEP] OUT_DIR"


def load_policy(path: str, dtype: str = "float32") -> Any:
    """The policy at `path`: a registered loader's, else an HF directory."""
    for name, loader in _LOADERS:
        policy = loader(path)
        if policy is not None:
            logger.info("loaded %s with the %s loader", path, name)
            return policy
    if not path.startswith("gs://") and not os.path.exists(path):
        raise FileNotFoundError(f"--model-dir {path}: no such directory")
    if _is_orbax_checkpoint(path):
        raise ValueError(
            f"{path} looks like an Orbax run checkpoint; `rlax eval` reads HF directories "
            "(and parameter-server mirrors via --weights-from). Export it to an HF directory "
            f"first with `{_export_command(path)}` (or register a loader with "
            "rlax_tasks.evaluation.register_loader)"
        )
    return load_pretrained(path, dtype=dtype)


def mirror_arrays(run_root: str, version: int | None = None) -> tuple[int, dict[str, np.ndarray]]:
    """(version, name -> array) of a version mirrored under run_root/weights (the newest
    committed one when `version` is None), every block checked against its CRC32C (its sha256
    in a mirror written before wire format 2) and the version digest."""
    if version is None:
        weights = mirror.load_latest(run_root)
        if weights is None:
            raise FileNotFoundError(f"{run_root}: no committed weight version under weights/")
    else:
        committed, _ = mirror.mirrored_versions(run_root)
        if version not in committed:
            raise FileNotFoundError(
                f"{run_root}: no committed weight version {version} (committed: "
                f"{', '.join(map(str, committed)) or 'none'})"
            )
        weights = mirror.read_version(run_root, version)
    arrays = {}
    for spec in weights.manifest.arrays:
        arrays[spec.name] = np.empty(spec.shape, resolve_dtype(spec.dtype))
    specs = weights.manifest.arrays
    for block in weights.blocks:
        spec = specs[block.header.array]
        dtype = resolve_dtype(spec.dtype)
        arrays[spec.name][block.header.region] = block.data.view(dtype).reshape(block.header.shape)
    return weights.version, arrays


def with_named_arrays(policy: Any, arrays: dict[str, np.ndarray]) -> Any:
    """`policy` with its parameters replaced by arrays named as in `policy.named_params()`."""
    pure = nnx.to_pure_dict(policy.params)
    names = {}
    for keypath, leaf in jax.tree_util.tree_leaves_with_path(pure):
        names[".".join(str(getattr(k, "key", k)) for k in keypath)] = (keypath, leaf)
    missing = sorted(set(names) - set(arrays))
    unexpected = sorted(set(arrays) - set(names))
    if missing or unexpected:
        raise ValueError(
            "the mirrored weights do not match the model: "
            f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )
    flat = {}
    for name, (keypath, leaf) in names.items():
        value = arrays[name]
        if tuple(value.shape) != tuple(leaf.shape):
            raise ValueError(
                f"mirrored array {name} has shape {value.shape}, the model "
                f"expects {tuple(leaf.shape)}"
            )
        flat[keypath] = jnp.asarray(value, leaf.dtype)
    new_pure = jax.tree_util.tree_map_with_path(lambda kp, _: flat[kp], pure)
    params = nnx.State(policy.params)  # a copy of the structure to fill
    nnx.replace_by_pure_dict(params, new_pure)
    return policy.with_params(params)


def parse_weights_from(spec: str) -> tuple[str, int | None]:
    """ "RUN_ROOT" or "RUN_ROOT@VERSION" -> (run_root, version or None)."""
    root, sep, version = spec.rpartition("@")
    if not sep or "/" in version:
        return spec, None
    try:
        return root, int(version)
    except ValueError as exc:
        raise ValueError(
            f"--weights-from {spec!r}: the part after @ must be a version number"
        ) from exc


def load_model(model_dir: str, weights_from: str | None = None, dtype: str = "float32") -> Any:
    """The policy at `model_dir`, with a parameter-server mirror's weights when given
    (`RUN_ROOT` for the newest committed version, `RUN_ROOT@VERSION` for one)."""
    policy = load_policy(model_dir, dtype)
    if weights_from:
        run_root, version = parse_weights_from(weights_from)
        version, arrays = mirror_arrays(run_root, version)
        policy = with_named_arrays(policy, arrays)
        logger.info("weights of version %d from %s", version, run_root)
    return policy
