"""`rlax export RUN_DIR[@STEP] OUT_DIR`: a run's trained policy as a Hugging Face directory
(docs/design.md §12), beside the base model's config, generation config and tokenizer files. Only
the policy's parameters are read, one at a time as host arrays (no Trainer, no mesh, no optimizer
state), and shards are written as they fill, so host memory peaks near one parameter plus one
shard; a hidden sibling directory is renamed to OUT_DIR at the end (a failed export leaves none)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
from etils import epath

from rlax_tasks.config import load_config
from rlax_tasks.models.config import SUPPORTED_DTYPES
from rlax_tasks.models.model_cache import local_model_dir
from rlax_tasks.rundir import storage
from rlax_tasks.rundir.paths import CONFIG as RUN_CONFIG
from rlax_tasks.rundir.paths import run_paths

# Modules that load JAX (hf_io, policy, the trainer's, Orbax, Flax) are imported inside the
# functions that use them: importing this module loads no JAX.

log = logging.getLogger(__name__)

# the array tree Trainer._state saves: {"params": {MODEL: ..., VALUE_HEAD: ...}, "opt_state", "rng"}
PARAMS_KEY = "params"
# files of the base model that are not copied: config.json is written anew, weights replaced
_NOT_COPIED_SUFFIXES = (
    ".safetensors",
    ".safetensors.index.json",
    ".bin",
    ".bin.index.json",
    ".pt",
    ".pth",
    ".ckpt",
    ".h5",
    ".msgpack",
    ".gguf",
    ".onnx",
    ".partial",
)
_STEP_RE = re.compile(r"[0-9]+")


class ExportError(ValueError):
    """A run, step or output directory that cannot be exported; the message says what to do."""


@dataclasses.dataclass(frozen=True)
class ExportResult:
    """What ``export_checkpoint`` wrote."""

    step: int
    out_dir: str
    dtype: str
    checkpoint: str  # the checkpoint's step directory


def parse_run_spec(spec: str) -> tuple[str, int | None]:
    """ "RUN_DIR" or "RUN_DIR@STEP" -> (run_dir, step or None)."""
    run_dir, sep, step = spec.rpartition("@")
    if not sep or "/" in step:  # no @, or an @ inside a directory name
        return spec, None
    if not run_dir:
        raise ExportError(f"{spec!r}: give the run directory before @ (RUN_DIR@STEP)")
    if not _STEP_RE.fullmatch(step):
        raise ExportError(
            f"{spec!r}: the part after @ must be a checkpoint step number (RUN_DIR@STEP), "
            f"got {step!r}"
        )
    return run_dir, int(step)


def export_checkpoint(
    run_dir: str,
    out_dir: str,
    step: int | None = None,
    dtype: str | None = None,
    overwrite: bool = False,
    max_shard_bytes: int = 2 * 1024**3,
) -> ExportResult:
    """Writes the policy of ``run_dir``'s checkpoint ``step`` (default: the newest complete one)
    as an HF directory at ``out_dir``, its tensors in ``dtype`` (default: the checkpoint's, i.e.
    the run's ``model.param_dtype``). ``out_dir`` must be absent or empty unless ``overwrite``.
    """
    if dtype is not None and dtype not in SUPPORTED_DTYPES:
        raise ExportError(f"dtype {dtype!r} is not one of {list(SUPPORTED_DTYPES)}")
    cfg = _run_config(run_dir)
    _check_out_dir(out_dir, overwrite)
    _refuse_replacing(out_dir, "the run directory", run_dir)
    ckpt_dir = cfg.trainer.checkpoint_dir or run_paths(run_dir).checkpoints
    _refuse_replacing(out_dir, "the run's checkpoints", ckpt_dir)
    step = _pick_step(ckpt_dir, step, cfg.trainer.checkpoint_every)
    step_dir = storage.join(ckpt_dir, str(step))
    base = _base_model_dir(cfg, run_dir)
    _refuse_replacing(out_dir, "the run's base model", base)
    config, raw = _base_config(base, run_dir)
    with _CheckpointReader(step_dir) as ckpt:
        ckpt.check_meta(step)
        leaves = ckpt.model_leaves()
        _check_shapes(leaves, config, step, base)
        dtype = dtype or _checkpoint_dtype(leaves)
        log.info(
            "exporting step %d of %s (%d parameters, %.2f GB in %s) to %s",
            step,
            run_dir,
            len(leaves),
            sum(math.prod(shape) for _, shape, _ in leaves.values()) * _itemsize(dtype) / 1e9,
            dtype,
            out_dir,
        )
        with _staging(out_dir, overwrite) as tmp:
            from rlax_tasks.models import hf_io  # loads JAX: see the imports

            hf_io.write_hf_tensors(tmp, _hf_tensors(ckpt, leaves, dtype), max_shard_bytes)
            hf_io.write_hf_config(tmp, config, dtype, _extra_config(raw, config))
            _copy_side_files(base, tmp)
    log.info("exported step %d to %s", step, out_dir)
    return ExportResult(step=step, out_dir=out_dir, dtype=dtype, checkpoint=step_dir)


# ------------------------------------------------------------------------------ the run
def _run_config(run_dir: str) -> Any:
    """The run's resolved config (RUN_DIR/config.yaml), with errors naming what is missing."""
    if not storage.is_gcs(run_dir) and not os.path.isdir(run_dir):
        raise ExportError(f"run directory {run_dir} does not exist (give run_root/<run_id>)")
    path = run_paths(run_dir).config
    if not storage.exists(path):
        raise ExportError(
            f"{run_dir} has no {RUN_CONFIG}: not a run directory (give run_root/<run_id>, "
            "where rlax run / the trainer wrote config.yaml and checkpoints/)"
        )
    try:
        return load_config(path)
    except ValueError as e:
        raise ExportError(f"{path}: {e}") from None


def _launch_dir(cfg: Any, run_dir: str) -> str | None:
    """The directory the run was started from, when its run_root is relative and RUN_DIR still
    ends in run_root/run_id (relative paths of the config are relative to it)."""
    if storage.is_gcs(run_dir) or os.path.isabs(cfg.run_root) or storage.is_gcs(cfg.run_root):
        return None
    tail = os.path.normpath(os.path.join(cfg.run_root, cfg.run_id))
    here = os.path.abspath(run_dir)
    if tail.startswith("..") or not here.endswith(os.sep + tail):
        return None
    return here[: -len(tail) - 1] or os.sep


def _base_model_dir(cfg: Any, run_dir: str) -> str:
    """A local directory holding the run's base model (``model.path``)."""
    path = cfg.model.path
    if storage.is_gcs(path):
        return local_model_dir(path)
    if os.path.isabs(path) or os.path.isdir(path):
        return path
    launch = _launch_dir(cfg, run_dir)
    if launch is not None and os.path.isdir(os.path.join(launch, path)):
        return os.path.join(launch, path)
    return path  # missing: _base_config says so


def _base_config(base: str, run_dir: str) -> tuple[Any, dict[str, Any]]:
    """(ModelConfig, raw config.json) of the base model."""
    from rlax_tasks.models import ModelConfig, hf_io  # loads JAX: see the imports

    try:
        raw = hf_io.read_hf_config(base)
    except hf_io.CheckpointError as e:
        raise ExportError(
            f"the run's base model: {e}. The export takes config.json and the tokenizer from it "
            f"(model.path in {run_paths(run_dir).config})"
        ) from None
    return ModelConfig.from_hf_dict(raw), raw


def _extra_config(raw: dict[str, Any], config: Any) -> dict[str, Any]:
    """Keys of the base config.json the model config does not cover (kept, as load_pretrained)."""
    known = set(config.to_hf_dict())
    return {k: v for k, v in raw.items() if k not in known and k != "transformers_version"}


# ------------------------------------------------------------------------------ checkpoints
def _checkpoint_steps(ckpt_dir: str) -> tuple[list[int], list[int]]:
    """(complete steps, incomplete steps) under ``ckpt_dir``, ascending; never changes it."""
    # loads JAX: see the imports
    from rlax_tasks.trainer.checkpointing import is_complete_checkpoint

    if storage.is_gcs(ckpt_dir):
        storage.configure_gcs_clients()  # before etils / Orbax first touch gs:// (see there)
    try:
        entries = list(epath.Path(ckpt_dir).iterdir())
    except FileNotFoundError:  # no directory (on GCS: no object under the prefix yet)
        entries = []
    steps = {int(p.name): p for p in entries if _STEP_RE.fullmatch(p.name)}
    complete = sorted(s for s, p in steps.items() if is_complete_checkpoint(p))
    return complete, sorted(set(steps) - set(complete))


def _pick_step(ckpt_dir: str, step: int | None, every: int) -> int:
    complete, incomplete = _checkpoint_steps(ckpt_dir)
    if not complete:
        partial = f" (incomplete, not exported: steps {_listed(incomplete)})" if incomplete else ""
        raise ExportError(
            f"no complete checkpoint under {ckpt_dir}{partial}: the trainer writes one every "
            f"trainer.checkpoint_every steps (this run: {every}) and when it stops cleanly; "
            "train that far first"
        )
    if step is None:
        return complete[-1]
    if step not in complete:
        state = " is incomplete" if step in incomplete else " does not exist"
        raise ExportError(
            f"checkpoint step {step} under {ckpt_dir}{state}; complete steps: {_listed(complete)}"
        )
    return step


def _listed(steps: list[int]) -> str:
    return ", ".join(map(str, steps))


class _CheckpointReader:
    """Reads the meta item and single model parameters of one trainer checkpoint step."""

    def __init__(self, step_dir: str) -> None:
        import orbax.checkpoint as ocp  # loads JAX: see the imports

        from rlax_tasks.trainer.checkpointing import META_ITEM, STATE_ITEM

        self._ocp = ocp
        self._state_item, self._meta_item = STATE_ITEM, META_ITEM
        # Orbax reads through TensorStore, which refuses relative paths (a relative run_root)
        self.step_dir = step_dir if storage.is_gcs(step_dir) else os.path.abspath(step_dir)
        handlers = {
            STATE_ITEM: ocp.PyTreeCheckpointHandler(),
            META_ITEM: ocp.JsonCheckpointHandler(),
        }
        self._ckptr = ocp.Checkpointer(ocp.CompositeCheckpointHandler(**handlers))
        self._tree = self._ckptr.metadata(self.step_dir).item_metadata[STATE_ITEM].tree

    def __enter__(self) -> _CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self._ckptr.close()

    def check_meta(self, step: int) -> None:
        """The step's meta must be the trainer's, of this checkpoint format and step."""
        from rlax_tasks.trainer.trainer import CHECKPOINT_FORMAT  # loads JAX: see the imports

        args = self._ocp.args.Composite(**{self._meta_item: self._ocp.args.JsonRestore()})
        meta = dict(self._ckptr.restore(self.step_dir, args=args)[self._meta_item])
        if meta.get("format") != CHECKPOINT_FORMAT:
            raise ExportError(
                f"{self.step_dir}: checkpoint format {meta.get('format')!r}, this version reads "
                f"format {CHECKPOINT_FORMAT}"
            )
        if meta.get("step") != step:
            raise ExportError(f"{self.step_dir}: its meta says step {meta.get('step')!r}")

    def model_leaves(self) -> dict[tuple[str, ...], tuple[tuple, tuple[int, ...], np.dtype]]:
        """Parameter path (as in ``nnx.to_pure_dict``) -> (checkpoint key path, shape, dtype)."""
        from rlax_tasks.trainer.train_step import MODEL, VALUE_HEAD  # loads JAX: see the imports

        params = self._tree.get(PARAMS_KEY) if isinstance(self._tree, dict) else None
        if not isinstance(params, dict) or MODEL not in params:
            raise ExportError(
                f"{self.step_dir} holds no policy parameters ({PARAMS_KEY}.{MODEL}): not a "
                "checkpoint of the rlax trainer"
            )
        if VALUE_HEAD in params:
            log.info("the checkpoint's PPO value head is not part of the HF model: left out")
        out = {}
        for key_path, meta in _walk(params[MODEL], (PARAMS_KEY, MODEL)):
            path = key_path[2:-1] if key_path[-1] == "value" else key_path[2:]
            out[path] = (key_path, tuple(meta.shape), np.dtype(meta.dtype))
        return out

    def read(self, key_path: tuple) -> np.ndarray:
        """One array of the state, restored on the host (no device, no mesh)."""
        item: Any = _leaf_metadata(self._tree, key_path)
        restore: Any = self._ocp.RestoreArgs(restore_type=np.ndarray)
        for key in reversed(key_path):
            item, restore = {key: item}, {key: restore}
        args = self._ocp.args.PyTreeRestore(item=item, restore_args=restore, partial_restore=True)
        out = self._ckptr.restore(
            self.step_dir, args=self._ocp.args.Composite(**{self._state_item: args})
        )[self._state_item]
        for key in key_path:
            out = out[key]
        return np.asarray(out)


def _walk(tree: Any, prefix: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    """(key path, leaf) of a nested dict, in key order."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _walk(value, (*prefix, key))
    else:
        yield prefix, tree


def _leaf_metadata(tree: Any, key_path: tuple) -> Any:
    for key in key_path:
        tree = tree[key]
    return tree


def _check_shapes(leaves: dict, config: Any, step: int, base: str) -> None:
    """The checkpoint's parameters must be the base model's, name for name and shape for shape."""
    from flax import nnx  # loads JAX: see the imports

    from rlax_tasks.models.policy import abstract_model

    _, abstract = abstract_model(config, "float32")
    want = {path: tuple(x.shape) for path, x in _walk(nnx.to_pure_dict(abstract))}
    got = {path: shape for path, (_, shape, _) in leaves.items()}
    problems = [f"{'.'.join(p)} is missing" for p in sorted(set(want) - set(got))]
    problems += [f"{'.'.join(p)} is not in the model" for p in sorted(set(got) - set(want))]
    problems += [
        f"{'.'.join(p)} has shape {got[p]}, the model {want[p]}"
        for p in sorted(set(want) & set(got))
        if want[p] != got[p]
    ]
    if problems:
        raise ExportError(
            f"checkpoint step {step} does not fit the base model {base} (model.path of the run's "
            f"config): {'; '.join(problems[:4])}"
            f"{f' (+{len(problems) - 4} more)' if len(problems) > 4 else ''}. Was model.path "
            "changed after training?"
        )


def _checkpoint_dtype(leaves: dict) -> str:
    """The dtype the checkpoint's parameters are stored in (the run's model.param_dtype)."""
    names = sorted({dt.name for _, _, dt in leaves.values()})
    if len(names) == 1 and names[0] in SUPPORTED_DTYPES:
        return names[0]
    raise ExportError(
        f"the checkpoint's parameters are {', '.join(names)}: choose the output dtype with "
        f"--dtype ({' or '.join(SUPPORTED_DTYPES)})"
    )


def _itemsize(dtype: str) -> int:
    from rlax_tasks.models.hf_io import NP_DTYPES  # loads JAX: see the imports

    return np.dtype(NP_DTYPES[dtype]).itemsize


def _hf_tensors(
    ckpt: _CheckpointReader, leaves: dict, dtype: str
) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, array) of every parameter, read one parameter at a time."""
    from rlax_tasks.models import hf_io  # loads JAX: see the imports

    for i, (path, (key_path, shape, stored)) in enumerate(sorted(leaves.items()), start=1):
        log.info(
            "reading %d/%d %s %s (%.2f GB)",
            i,
            len(leaves),
            ".".join(path),
            shape,
            np.prod(shape) * stored.itemsize / 1e9,
        )
        yield from hf_io.param_hf_tensors(path, ckpt.read(key_path), dtype)


# ------------------------------------------------------------------------------ the output
def _check_out_dir(out_dir: str, overwrite: bool) -> None:
    if storage.is_gcs(out_dir):
        raise ExportError(
            f"OUT_DIR {out_dir} must be a local directory: export locally, then copy it "
            "(gcloud storage cp -r)"
        )
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ExportError(f"OUT_DIR {out_dir} exists and is not a directory")
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not overwrite:
        raise ExportError(
            f"OUT_DIR {out_dir} exists and is not empty: choose another directory, or pass "
            "--overwrite to replace it"
        )


def _refuse_replacing(out_dir: str, name: str, other: str) -> None:
    """OUT_DIR must not be ``other`` or hold it (``--overwrite`` would delete it)."""
    if storage.is_gcs(other):
        return
    out, other = os.path.realpath(out_dir), os.path.realpath(other)
    if out == other or other.startswith(out.rstrip(os.sep) + os.sep):
        raise ExportError(f"OUT_DIR {out_dir} would replace {name} ({other}): choose another")


@contextlib.contextmanager
def _staging(out_dir: str, overwrite: bool) -> Iterator[str]:
    """A hidden sibling directory of ``out_dir`` to write into, renamed to ``out_dir`` when the
    block ends without an error (and removed when it raises)."""
    out_dir = os.path.abspath(out_dir)
    parent, name = os.path.split(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{name}.export-{uuid.uuid4().hex[:12]}")
    os.mkdir(tmp)
    try:
        yield tmp
        _replace(tmp, out_dir, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _replace(tmp: str, out_dir: str, overwrite: bool) -> None:
    """Renames ``tmp`` to ``out_dir``; a previous ``out_dir`` is moved aside first and removed
    after, so ``out_dir`` is at every moment either the old directory or the new one."""
    aside = None
    if os.path.isdir(out_dir):
        if not os.listdir(out_dir):
            os.rmdir(out_dir)
        elif overwrite:
            aside = f"{tmp}.old"
            os.rename(out_dir, aside)
        else:  # filled while we were writing
            raise ExportError(f"OUT_DIR {out_dir} was filled by someone else during the export")
    os.rename(tmp, out_dir)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def _copy_side_files(base: str, out: str) -> None:
    """Copies the base model's other files (tokenizer, generation_config.json, license...)
    as they are: every top-level file except config.json and weights."""
    from rlax_tasks.models import hf_io  # loads JAX: see the imports

    copied = []
    for name in sorted(os.listdir(base)):
        src = os.path.join(base, name)
        if (
            name.startswith(".")
            or name == "config.json"
            or name.endswith(_NOT_COPIED_SUFFIXES)
            or not os.path.isfile(src)
        ):
            continue
        shutil.copy2(src, os.path.join(out, name))
        copied.append(name)
    log.info("copied from the base model %s: %s", base, ", ".join(copied) or "nothing")
    if not hf_io.has_tokenizer(base):
        log.warning("the base model %s has no tokenizer files: the export has none either", base)
