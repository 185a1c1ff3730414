"""Test shim, put on PYTHONPATH by tests that check which processes start a JAX backend: with
RLAX_TEST_BACKENDS_FILE set, each Python process appends at its exit {"pid", "backends"} (the
JAX backends it started, [] when none or when it never imported JAX) to that file.

JAX clears its backends at exit before this shim's exit hook runs, so the shim records each
backend as ``jax._src.xla_bridge._init_backend`` starts it."""

import atexit
import importlib.abc
import importlib.util
import json
import os
import sys

_PATH = os.environ.get("RLAX_TEST_BACKENDS_FILE")
_MODULE = "jax._src.xla_bridge"
_started: list[str] = []


class _RecordBackends(importlib.abc.MetaPathFinder):
    """Finds ``jax._src.xla_bridge`` as usual and wraps its ``_init_backend`` once loaded."""

    def find_spec(self, name, path, target=None):  # type: ignore[no-untyped-def]
        if name != _MODULE:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        exec_module = spec.loader.exec_module

        def exec_and_wrap(module):  # type: ignore[no-untyped-def]
            exec_module(module)
            init = module._init_backend

            def recorded(platform):  # type: ignore[no-untyped-def]
                _started.append(platform)
                return init(platform)

            module._init_backend = recorded

        spec.loader.exec_module = exec_and_wrap
        return spec


if _PATH:
    sys.meta_path.insert(0, _RecordBackends())

    def _report() -> None:
        with open(_PATH, "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "backends": sorted(set(_started))}) + "\n")

    atexit.register(_report)
