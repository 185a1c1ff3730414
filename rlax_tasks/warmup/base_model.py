"""The cached tiny-arith base model: built once by the supervised warm-up, reused afterwards.

``cache_dir/tiny-arith-<fingerprint>/`` is an HF directory with a ``rlax_warmup.json`` marker
(recipe, fingerprint, stats). A build runs in a temporary directory renamed into place when
complete, under a lock file; leftovers of crashed builds are removed by the next call."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

from rlax_tasks.utils.file_lock import exclusive
from rlax_tasks.warmup.recipe import WarmupRecipe, recipe_for

log = logging.getLogger(__name__)

MARKER = "rlax_warmup.json"


def base_model_name(recipe: WarmupRecipe) -> str:
    """The cache entry name of a recipe: ``tiny-arith-<fingerprint>``."""
    return f"tiny-arith-{recipe.fingerprint()}"


def read_marker(path: str) -> dict[str, Any] | None:
    """The warm-up marker of a model directory, or None when there is none (or it is corrupt)."""
    try:
        with open(os.path.join(path, MARKER)) as f:
            marker = json.load(f)
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def is_cached(cache_dir: str, name: str, recipe: WarmupRecipe | None = None) -> bool:
    """Whether ``cache_dir/name`` holds the recipe's base model, built and complete (JAX-free:
    a caller that only needs the check starts no backend)."""
    marker = read_marker(os.path.join(cache_dir, name))
    want = (recipe or recipe_for(name)).fingerprint()
    return marker is not None and marker.get("fingerprint") == want


def ensure_base_model(
    cache_dir: str,
    recipe: WarmupRecipe | None = None,
    *,
    name: str | None = None,
    log_every_s: float | None = None,
    on_step: Callable[[int, float], None] | None = None,
) -> str:
    """The HF directory of the recipe's base model under ``cache_dir``, built when missing.

    ``name`` overrides the directory name (default ``tiny-arith-<fingerprint>``); a directory
    there built by another recipe is rebuilt, one not built by the warm-up at all (a
    config.json without marker) is an error rather than being overwritten."""
    recipe = recipe or WarmupRecipe()
    if "://" in cache_dir:
        raise ValueError(
            f"model cache dir {cache_dir!r}: the warm-up builds base models on a local path only; "
            "build it locally and copy it, or give a local cache directory"
        )
    name = name or base_model_name(recipe)
    if not name or os.sep in name or name.startswith("."):
        raise ValueError(f"name {name!r} must be a plain directory name")
    fingerprint = recipe.fingerprint()
    os.makedirs(cache_dir, exist_ok=True)
    target = os.path.join(cache_dir, name)
    with exclusive(os.path.join(cache_dir, f".{name}.lock")):
        if is_cached(cache_dir, name, recipe):
            log.info("base model %s is cached (recipe %s): reusing it", target, fingerprint)
            return target
        marker = read_marker(target) if os.path.isdir(target) else None
        if os.path.exists(target):
            if marker is None and os.path.exists(os.path.join(target, "config.json")):
                raise ValueError(
                    f"{target} holds a model that the warm-up did not build (no {MARKER}); "
                    "point model.path elsewhere or turn warmup_if_missing off to use it as is"
                )
            why = "another recipe" if marker is not None else "an incomplete directory"
            log.info("base model %s is %s: rebuilding it", target, why)
        else:
            log.info("base model %s is missing: building it (recipe %s)", target, fingerprint)
        _remove_leftovers(cache_dir, name)
        _build(cache_dir, name, target, recipe, log_every_s, on_step)
    return target


def _build(
    cache_dir: str,
    name: str,
    target: str,
    recipe: WarmupRecipe,
    log_every_s: float | None,
    on_step: Callable[[int, float], None] | None,
) -> None:
    # lazy: checking the cache (``is_cached``) loads no JAX
    from rlax_tasks.warmup.supervised import train_base_policy

    tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=cache_dir)
    try:
        policy, stats = train_base_policy(recipe, log_every_s=log_every_s, on_step=on_step)
        policy.save_pretrained(tmp)
        marker = {
            "fingerprint": recipe.fingerprint(),
            "recipe": recipe.to_dict(),
            "warmup": {
                "steps": stats.steps,
                "final_loss": stats.final_loss,
                "seconds": round(stats.seconds, 2),
                "num_train_problems": stats.num_train_problems,
            },
            "num_parameters": policy.config.num_parameters(),
            "created_unix": time.time(),
        }
        with open(os.path.join(tmp, MARKER), "w") as f:  # last file: the build is complete
            json.dump(marker, f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(target):  # a stale entry: move it aside, put the new one in place
            trash = tempfile.mkdtemp(prefix=f".{name}.old-", dir=cache_dir)
            os.rename(target, os.path.join(trash, "model"))
            os.rename(tmp, target)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.rename(tmp, target)
        log.info(
            "base model built in %.1fs (final loss %.4f): %s",
            stats.seconds,
            stats.final_loss,
            target,
        )
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _remove_leftovers(cache_dir: str, name: str) -> None:
    """Removes temporary directories of crashed builds (we hold the lock: nobody else builds)."""
    for entry in os.listdir(cache_dir):
        if entry.startswith((f".{name}.tmp-", f".{name}.old-")):
            log.info("removing a crashed build's leftovers %s", entry)
            shutil.rmtree(os.path.join(cache_dir, entry), ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """``python -m rlax_tasks.warmup.base_model CACHE_DIR NAME``: ``ensure_base_model`` in a
    process of its own (`rlax run` and the DAG's plan task start no JAX backend themselves);
    a user error is one line on stderr and exit 2."""
    import sys

    from rlax_tasks.process.device_check import check_job_devices

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m rlax_tasks.warmup.base_model CACHE_DIR NAME", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        check_job_devices("warm-up")
        ensure_base_model(args[0], recipe_for(args[1]), name=args[1])
    except ValueError as e:
        print(f"base model warm-up: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
