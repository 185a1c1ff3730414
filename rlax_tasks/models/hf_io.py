"""Hugging Face checkpoint I/O: config.json + safetensors (single file or sharded index) <-> params.

Every HF tensor maps to one parameter path of ``Transformer`` (layer tensors are stacked on a
leading axis, a mixture-of-experts layer's experts on the next: ``mlp.experts.{e}.*``); a
missing, unexpected or mis-shaped tensor is a ``CheckpointError`` naming it.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack
from typing import Any

import jax
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from rlax_tasks.models.config import ModelConfig
from rlax_tasks.utils.progress_meter import ProgressMeter, format_si

log = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# tensors some checkpoints carry that are derived, not learned
_IGNORABLE_SUFFIXES = ("rotary_emb.inv_freq",)
NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


class CheckpointError(ValueError):
    """An HF directory that cannot be loaded: missing files or bad/unexpected/mis-shaped tensors."""


# ------------------------------------------------------------------------------ name mapping
def _hf_name(path: tuple[str, ...], layer: int | None) -> str:
    """HF tensor name of our parameter ``path`` (for layer ``layer`` when stacked)."""
    *module, leaf = path
    suffix = "bias" if leaf == "bias" else "weight"
    if module == ["lm_head"]:
        return "lm_head.weight"
    if module[0] == "layers":
        return f"model.layers.{layer}.{'.'.join(module[1:])}.{suffix}"
    return f"model.{'.'.join(module)}.{suffix}"


def _is_experts(path: tuple[str, ...]) -> bool:
    """Whether ``path`` is a stacked expert weight ([L, E, in, out], one HF Linear per expert)."""
    return len(path) >= 2 and path[-2] == "experts"


def _expert_name(path: tuple[str, ...], layer: int, expert: int) -> str:
    """HF tensor name of expert ``expert``'s ``path[-1]`` in layer ``layer``."""
    return f"model.layers.{layer}.{'.'.join(path[1:-1])}.{expert}.{path[-1]}.weight"


def _layer_tensors(path: tuple[str, ...], layer: int, value: np.ndarray) -> Iterator[tuple]:
    """(HF name, HF-layout array) of one layer's slice of a stacked parameter."""
    if _is_experts(path):
        for e in range(value.shape[0]):
            yield _expert_name(path, layer, e), np.ascontiguousarray(value[e].T)
    else:
        yield _hf_name(path, layer), _to_hf(path, value)


def _n_in(path: tuple[str, ...]) -> int:
    """How many leading kernel dims are input dims (o_proj contracts heads and head_dim)."""
    return 2 if path[-2] == "o_proj" else 1


def _to_ours(path: tuple[str, ...], tensor: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """HF layout ([out, in] for Linear) -> our layout of the given (unstacked) shape."""
    if path[-1] == "kernel":
        return tensor.T.reshape(shape)
    return tensor.reshape(shape)


def _to_hf(path: tuple[str, ...], array: np.ndarray) -> np.ndarray:
    """Our layout -> HF layout (inverse of ``_to_ours``)."""
    if path[-1] == "kernel":
        n = _n_in(path)
        return np.ascontiguousarray(
            array.reshape(math.prod(array.shape[:n]), math.prod(array.shape[n:])).T
        )
    if path[-1] == "bias":
        return array.reshape(-1)
    return array


def _hf_shape(path: tuple[str, ...], shape: tuple[int, ...]) -> tuple[int, ...]:
    if path[-1] == "kernel":
        n = _n_in(path)
        return (math.prod(shape[n:]), math.prod(shape[:n]))
    if path[-1] == "bias":
        return (math.prod(shape),)
    return shape


def _leaves(tree: dict[str, Any], prefix: tuple[str, ...] = ()) -> Iterator[tuple[tuple, Any]]:
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _leaves(value, (*prefix, str(key)))
        else:
            yield (*prefix, str(key)), value


def _set(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value


# ------------------------------------------------------------------------------ reading
def read_hf_config(path: str) -> dict[str, Any]:
    """The parsed config.json of an HF directory, with a clear error when absent or broken."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isdir(path):
        raise CheckpointError(f"{path!r} is not a directory (expected an HF model directory)")
    if not os.path.exists(cfg_path):
        raise CheckpointError(f"{path!r} has no config.json")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_path}: invalid JSON ({e})") from e


GENERATION_CONFIG = "generation_config.json"


def read_generation_config(path: str) -> dict[str, Any]:
    """generation_config.json of an HF directory ({} when absent; broken JSON is an error)."""
    gen_path = os.path.join(path, GENERATION_CONFIG)
    if not os.path.exists(gen_path):
        return {}
    try:
        with open(gen_path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{gen_path}: invalid JSON ({e})") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{gen_path}: expected a JSON object")
    return data


def token_ids(value: Any, where: str) -> tuple[int, ...]:
    """An ``eos_token_id`` value (int, list of ints or null) as a tuple of ids."""
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise CheckpointError(f"{where}: eos_token_id must be token ids, got {value!r}")
    return tuple(values)


def _tensor_files(path: str) -> dict[str, str]:
    """Tensor name -> safetensors file, from the sharded index or the single file."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no 'weight_map'")
        missing = sorted({v for v in weight_map.values()} - set(os.listdir(path)))
        if missing:
            raise CheckpointError(f"{index} refers to missing shard files: {missing}")
        return {name: os.path.join(path, file) for name, file in weight_map.items()}
    single = os.path.join(path, SINGLE_FILE)
    if os.path.exists(single):
        with safe_open(single, framework="numpy") as f:
            return {name: single for name in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    found = sorted(os.listdir(path))
    raise CheckpointError(
        f"{path!r} has neither {SINGLE_FILE} nor {INDEX_FILE} (found: {found}); "
        "convert PyTorch .bin checkpoints to safetensors first"
    )


def read_params(
    path: str,
    abstract_params: nnx.State,
    dtype: str,
    place: Callable[[tuple[str, ...], np.ndarray], jax.Array] | None = None,
) -> nnx.State:
    """Fills ``abstract_params`` (shapes from ``nnx.eval_shape``) with the tensors of an HF dir.
    ``place`` puts each host array on devices (default ``jax.device_put``). Host memory peaks at
    one parameter (all its layers); progress is logged every few seconds and once when done.
    """
    files = _tensor_files(path)
    np_dtype = NP_DTYPES[dtype]
    place = place or (lambda _p, a: jax.device_put(a))
    pure = nnx.to_pure_dict(abstract_params)
    used: set[str] = set()
    total = sum(math.prod(a.shape) for _, a in _leaves(pure))
    meter = ProgressMeter(
        f"loading {path}", total, logger=log, unit="params", format_count=format_si
    )
    with ExitStack() as stack:
        handles: dict[str, Any] = {}

        def get(name: str, expected: tuple[int, ...]) -> np.ndarray:
            if name not in files:
                raise CheckpointError(f"tensor {name!r} is missing from the checkpoint at {path!r}")
            file = files[name]
            if file not in handles:
                handles[file] = stack.enter_context(safe_open(file, framework="numpy"))
            tensor = handles[file].get_tensor(name)
            if tuple(tensor.shape) != expected:
                raise CheckpointError(
                    f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {expected} "
                    "from config.json"
                )
            used.add(name)
            meter.update(tensor.size)
            return tensor

        for leaf_path, abstract in _leaves(pure):
            shape = tuple(abstract.shape)
            if _is_experts(leaf_path):  # [L, E, in, out] from E Linear [out, in] per layer
                hf_shape = shape[:1:-1]
                value = np.stack([
                    np.stack([get(_expert_name(leaf_path, i, e), hf_shape).T
                              for e in range(shape[1])])
                    for i in range(shape[0])
                ]).astype(np_dtype)  # fmt: skip
            elif leaf_path[0] == "layers":
                per_layer = shape[1:]
                hf_shape = _hf_shape(leaf_path, per_layer)
                arrays = [
                    _to_ours(leaf_path, get(_hf_name(leaf_path, i), hf_shape), per_layer)
                    for i in range(shape[0])
                ]
                value = np.stack(arrays).astype(np_dtype)
            else:
                hf_shape = _hf_shape(leaf_path, shape)
                value = _to_ours(leaf_path, get(_hf_name(leaf_path, None), hf_shape), shape)
                value = value.astype(np_dtype)
            _set(pure, leaf_path, place(leaf_path, value))
    unexpected = sorted(
        n
        for n in set(files) - used
        if not n.endswith(_IGNORABLE_SUFFIXES) and n != "lm_head.weight"
    )
    if unexpected:
        raise CheckpointError(
            f"checkpoint at {path!r} has tensors this architecture does not use: {unexpected[:8]}"
            + (f" (+{len(unexpected) - 8} more)" if len(unexpected) > 8 else "")
        )
    if "lm_head.weight" in files and "lm_head.weight" not in used:
        log.warning("tie_word_embeddings=true: ignoring the checkpoint's lm_head.weight")
    meter.finish()
    nnx.replace_by_pure_dict(abstract_params, pure)
    return abstract_params


# ------------------------------------------------------------------------------ writing
def hf_tensors(params: nnx.State, dtype: str) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, host array) per parameter, layer by layer; one parameter on host at a time."""
    np_dtype = NP_DTYPES[dtype]
    for leaf_path, value in _leaves(nnx.to_pure_dict(params)):
        host = np.asarray(jax.device_get(value)).astype(np_dtype)
        if leaf_path[0] == "layers":
            for i in range(host.shape[0]):
                yield from _layer_tensors(leaf_path, i, host[i])
        else:
            yield _hf_name(leaf_path, None), _to_hf(leaf_path, host)


def write_hf(
    path: str,
    config: ModelConfig,
    params: nnx.State,
    dtype: str,
    extra_config: dict[str, Any] | None = None,
    max_shard_bytes: int = 2 * 1024**3,
) -> None:
    """Writes config.json and safetensors (sharded with an index when over ``max_shard_bytes``)."""
    os.makedirs(path, exist_ok=True)
    hf_cfg = {**(extra_config or {}), **config.to_hf_dict(dtype)}
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    total = 0
    for name, tensor in hf_tensors(params, dtype):
        if shards[-1] and size + tensor.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += tensor.nbytes
        total += tensor.nbytes
    for stale in (SINGLE_FILE, INDEX_FILE):
        if os.path.exists(os.path.join(path, stale)):
            os.remove(os.path.join(path, stale))
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], os.path.join(path, SINGLE_FILE), metadata=meta)
    else:
        weight_map = {}
        for i, shard in enumerate(shards, start=1):
            file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, os.path.join(path, file), metadata=meta)
            weight_map.update({name: file for name in shard})
        with open(os.path.join(path, INDEX_FILE), "w", encoding="utf-8") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(hf_cfg, f, indent=2, sort_keys=True)


def has_tokenizer(path: str) -> bool:
    """Whether an HF directory carries tokenizer files."""
    return any(os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES)


# ------------------------------------------------------------------------------ streaming writing
def param_hf_tensors(
    leaf_path: tuple[str, ...], value: np.ndarray, dtype: str
) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, host array in ``dtype``) of one parameter, layer by layer: ``leaf_path`` is its
    path in ``nnx.to_pure_dict(params)``, ``value`` its array (stacked for ``layers``). Each layer
    is cast on its own, so the cast never copies the whole stacked parameter.
    """
    np_dtype = NP_DTYPES[dtype]
    if leaf_path[0] == "layers":
        for i in range(value.shape[0]):
            yield from _layer_tensors(leaf_path, i, np.asarray(value[i]).astype(np_dtype))
    else:
        yield _hf_name(leaf_path, None), _to_hf(leaf_path, np.asarray(value).astype(np_dtype))


def write_hf_tensors(
    path: str,
    tensors: Iterable[tuple[str, np.ndarray]],
    max_shard_bytes: int = 2 * 1024**3,
) -> int:
    """Writes (HF name, array) pairs into ``path`` as they come; returns the bytes written.
    Same files as ``write_hf`` (one file, or shards of ``max_shard_bytes`` and the index); each
    shard is written once full, so host memory peaks at one shard, not the whole model.
    """
    os.makedirs(path, exist_ok=True)
    parts: list[tuple[str, list[str]]] = []  # (temporary file, tensor names), in order
    shard: dict[str, np.ndarray] = {}
    size = total = 0

    def flush() -> None:
        part = os.path.join(path, f"model-{len(parts) + 1:05d}.safetensors.partial")
        save_file(shard, part, metadata={"format": "pt"})
        parts.append((part, list(shard)))
        log.info("wrote safetensors shard %d (%.2f GB)", len(parts), size / 1e9)

    for name, tensor in tensors:
        if shard and size + tensor.nbytes > max_shard_bytes:
            flush()
            shard, size = {}, 0
        shard[name] = tensor
        size += tensor.nbytes
        total += tensor.nbytes
    if shard or not parts:
        flush()
    if len(parts) == 1:
        os.replace(parts[0][0], os.path.join(path, SINGLE_FILE))
        return total
    weight_map = {}
    for i, (part, names) in enumerate(parts, start=1):
        file = f"model-{i:05d}-of-{len(parts):05d}.safetensors"
        os.replace(part, os.path.join(path, file))
        weight_map.update({name: file for name in names})
    with open(os.path.join(path, INDEX_FILE), "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return total


def write_hf_config(
    path: str, config: ModelConfig, dtype: str, extra_config: dict[str, Any] | None = None
) -> None:
    """Writes ``path``/config.json as ``write_hf`` does: ``extra_config`` (keys of a source
    config.json we do not model) under the model's own fields, with ``dtype`` as torch_dtype."""
    hf_cfg = {**(extra_config or {}), **config.to_hf_dict(dtype)}
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(hf_cfg, f, indent=2, sort_keys=True)
