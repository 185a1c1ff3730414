"""The held-out evaluation of a run's starting weights, computed once per run root and kept under
``<run_root>/base-evals/<fingerprint>/`` for every run from the same model, data and settings (a
resumed or repeated run copies it). The fingerprint: the `rlax eval` settings (paths aside), the
model files' names, sizes and crc32c (gs://) or mtimes with a digest of ``config.json``, the
``eval.dataset`` spec and file identity, and the ``prompt`` section; any change evaluates again."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Callable, Sequence
from typing import Any

from rlax_tasks.config import FileSource
from rlax_tasks.rundir import storage
from rlax_tasks.rundir.paths import EVAL_RESULTS, base_eval_dir, run_paths

log = logging.getLogger(__name__)

# bump when what an evaluation computes changes (the evaluator, the scoring): old entries miss
CACHE_VERSION = 2  # 2: a run whose eval.dataset has an environment evaluates episodes
BASE_VERSION = 0  # the starting weights are weight version 0: eval/v0
INPUTS = "inputs.json"  # beside a cached evaluation: what its fingerprint was computed from
# `rlax eval` flags whose values are paths: hashed by what they name, not by their spelling
_PATH_FLAGS = ("--model-dir", "--dataset", "--out", "--prompt-config", "--environment-from")


@dataclasses.dataclass(frozen=True)
class BaseEvalPlan:
    """One run's base evaluation: the `rlax eval` command line (``argv``) writing ``out_dir``
    (the run's eval/v0) and the cache entry it shares with every run of the root (``cache_dir``,
    named by ``fingerprint``). JSON-able (``to_dict``/``from_dict``) for Airflow's XComs."""

    fingerprint: str
    cache_dir: str
    out_dir: str
    argv: list[str]
    inputs: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BaseEvalPlan:
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls)})

    @property
    def cached(self) -> bool:
        """Whether the cache holds this evaluation (its results.json, written last)."""
        return storage.exists(storage.join(self.cache_dir, EVAL_RESULTS))


def _flags(argv: Sequence[str]) -> dict[str, str]:
    """{"--flag": value} of an `rlax eval` command line (every flag of it takes a value)."""
    if not argv or argv[0] != "eval" or len(argv) % 2 == 0:
        raise ValueError(f"not an `rlax eval` command line of --flag value pairs: {list(argv)}")
    pairs = dict(zip(argv[1::2], argv[2::2], strict=True))
    missing = [f for f in ("--model-dir", "--dataset", "--out") if f not in pairs]
    if missing:
        raise ValueError(f"`rlax eval` command line without {', '.join(missing)}: {list(argv)}")
    if "--weights-from" in pairs:
        raise ValueError("a base evaluation evaluates the model directory alone: no --weights-from")
    return pairs


def _files(path: str) -> list[list[Any]]:
    """[relative name, size, crc32c or mtime] of the file ``path`` or of every file under it."""
    info = storage.stat(path)
    objects = [info] if info is not None else storage.list_objects(path)
    base = path.rstrip("/")
    out = []
    for o in objects:
        name = o.path[len(base) :].lstrip("/") if o.path != base else o.name
        out.append([name, o.size, o.crc32c if o.crc32c is not None else o.updated])
    return sorted(out)


def model_identity(model_dir: str) -> dict[str, Any]:
    """What makes a model directory itself: its files (name, size, crc32c or mtime) and a digest
    of its config.json. A directory that cannot be listed is known by its path alone."""
    files = _files(model_dir)
    try:
        config = hashlib.sha256(storage.read_bytes(storage.join(model_dir, "config.json")))
        digest = config.hexdigest()
    except FileNotFoundError:
        digest = None
    if not files:
        log.warning(
            "%s: no files to fingerprint; its cached evaluation is keyed by path", model_dir
        )
        return {"path": model_dir}
    return {"files": files, "config_sha256": digest}


def fingerprint_inputs(cfg: Any, argv: Sequence[str]) -> dict[str, Any]:
    """What the base evaluation ``argv`` of run config ``cfg`` depends on (the module docstring's
    fingerprint); ValueError for a command line that is not a base `rlax eval`."""
    flags = _flags(argv)
    settings = {k: v for k, v in sorted(flags.items()) if k not in _PATH_FLAGS}
    plain = cfg.to_dict()
    spec = cfg.eval.dataset
    dataset: dict[str, Any] = {"spec": plain["eval"]["dataset"]}
    if spec is None or isinstance(spec.source, FileSource):  # the file itself, whatever names it
        dataset["files"] = _files(flags["--dataset"])
    return {
        "version": CACHE_VERSION,
        "settings": settings,
        "model": model_identity(flags["--model-dir"]),
        "dataset": dataset,
        "prompt": plain["prompt"] if "--prompt-config" in flags else None,
        "episodes": "--environment-from" in flags,  # the environment itself: in the spec
    }


def plan_base_eval(cfg: Any, argv: Sequence[str]) -> BaseEvalPlan:
    """The base evaluation of run ``cfg`` by the `rlax eval` command line ``argv`` (whose
    ``--out`` is the run's eval/v0), with its fingerprint and cache entry."""
    inputs = fingerprint_inputs(cfg, argv)
    text = json.dumps(inputs, sort_keys=True, default=str)
    key = hashlib.sha256(text.encode()).hexdigest()[:20]
    out = _flags(argv)["--out"]
    expected = run_paths(cfg.run_dir).eval_dir(BASE_VERSION)
    if out.rstrip("/") != expected:
        raise ValueError(f"a base evaluation writes {expected}, not --out {out}")
    return BaseEvalPlan(key, base_eval_dir(cfg.run_root, key), out, list(argv), inputs)


def _copy_dir(src: str, dst: str) -> int:
    """Copies the files directly under ``src`` into ``dst``, results.json last (the entry counts
    as present once it exists); the number copied."""
    objects = storage.list_objects(src, recursive=False)
    objects.sort(key=lambda o: o.name == EVAL_RESULTS)
    for o in objects:
        storage.write_bytes(storage.join(dst, o.name), storage.read_bytes(o.path))
    return len(objects)


def restore(plan: BaseEvalPlan) -> bool:
    """Copies the cached evaluation into the run's eval/v0; False when there is none."""
    if not plan.cached:
        return False
    _copy_dir(plan.cache_dir, plan.out_dir)
    log.info("base evaluation %s cached at %s: copied to %s", plan.fingerprint, plan.cache_dir,
             plan.out_dir)  # fmt: skip
    return True


def store(plan: BaseEvalPlan) -> None:
    """Keeps the run's eval/v0 (just evaluated) as the cached evaluation of its fingerprint."""
    results = storage.join(plan.out_dir, EVAL_RESULTS)
    if not storage.exists(results):
        raise FileNotFoundError(
            f"{results} does not exist: the base evaluation (rlax {' '.join(plan.argv)}) wrote "
            "no results; see its job's log"
        )
    storage.write_bytes(
        storage.join(plan.cache_dir, INPUTS), json.dumps(plan.inputs, indent=1).encode()
    )
    _copy_dir(plan.out_dir, plan.cache_dir)
    log.info("base evaluation %s cached at %s", plan.fingerprint, plan.cache_dir)


def evaluate_base(cfg: Any, argv: Sequence[str], run: Callable[[list[str]], Any]) -> bool:
    """The run's eval/v0: copied from the cache, or evaluated by ``run(argv)`` (e.g. the `rlax`
    CLI's main) and then cached; True when it evaluated."""
    plan = plan_base_eval(cfg, argv)
    if restore(plan):
        return False
    run(list(plan.argv))
    store(plan)
    return True
