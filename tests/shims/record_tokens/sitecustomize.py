"""Test shim, put on PYTHONPATH by tests that count regenerated tokens outside the product: with
RLAX_TEST_TOKENS_FILE set, every token a Sampler draws (``Sampler._emit``: a prefill's first
token and each decoded one) is appended to that file as one JSON line {"job", "pid", "request",
"position", "token"}, written unbuffered, so a process killed with SIGKILL has recorded every
token it drew. ``request``: the request's id (a worker's [prompt_id, sample]); ``position``:
the token's index in its completion.

Python imports only the first ``sitecustomize`` on the path: this one then runs the next one
(e.g. tests/run/slow_decode), so the shims compose."""

import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys

_PATH = os.environ.get("RLAX_TEST_TOKENS_FILE")
_MODULE = "rlax_tasks.rollout.sampler"


class _RecordTokens(importlib.abc.MetaPathFinder):
    """Finds ``rlax_tasks.rollout.sampler`` as usual and wraps ``Sampler._emit`` once loaded
    (a process that never samples pays nothing)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def find_spec(self, name, path, target=None):  # type: ignore[no-untyped-def]
        if name != _MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        exec_module = spec.loader.exec_module

        def exec_and_wrap(module):  # type: ignore[no-untyped-def]
            exec_module(module)
            _wrap(module.Sampler, self.path)

        spec.loader.exec_module = exec_and_wrap
        return spec


def _wrap(sampler: type, path: str) -> None:
    emit = sampler._emit
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    job, pid = os.environ.get("RLAX_JOB_NAME", ""), os.getpid()

    def recorded(self, slot, token, *args, **kwargs):  # type: ignore[no-untyped-def]
        state = self._slots[slot]
        request, position = state.request.request_id, len(state.tokens)
        line = {"job": job, "pid": pid, "request": request, "position": position, "token": token}
        os.write(fd, (json.dumps(line, default=str) + "\n").encode())
        return emit(self, slot, token, *args, **kwargs)

    sampler._emit = recorded


def _run_next_sitecustomize() -> None:
    """Runs the first ``sitecustomize`` on the path entries after this shim's."""
    here = os.path.dirname(os.path.abspath(__file__))
    entries = [os.path.abspath(p) if p else p for p in sys.path]
    rest = sys.path[entries.index(here) + 1 :] if here in entries else []
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


if _PATH:
    sys.meta_path.insert(0, _RecordTokens(_PATH))
_run_next_sitecustomize()
