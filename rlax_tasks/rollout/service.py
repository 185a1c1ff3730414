"""The inference worker as an HTTP service for the controller, plus its client (the command,
`rlax worker`: rollout/cli.py).

POST /v1/groups queues work; GET /v1/results long-polls finished groups (on the event loop, so
open polls never starve other routes); GET /v1/progress says what unfinished groups hold so far;
POST /v1/reset drops all work; GET /v1/status. Every call needs the run's bearer token; bodies
and submissions are bounded (``MAX_*``, docs/design.md §13)."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rlax_tasks.rollout.requests import GroupRequest
from rlax_tasks.services.endpoints import Endpoint
from rlax_tasks.services.http import (
    MAX_WAIT_S,
    TOKEN_ENV,
    JsonClient,
    Reply,
    ReplyTooLargeError,
    authorized_app,
    check_wait_s,
    long_poll,
)

if TYPE_CHECKING:  # the worker loads JAX and Flax: only its command needs them
    from rlax_tasks.rollout.worker import InferenceWorker

log = logging.getLogger(__name__)

# TOKEN_ENV (RLAX_PS_TOKEN, the run's one token) and MAX_WAIT_S: from rlax_tasks.services.http
MAX_BODY_BYTES = 16 << 20  # a submission's JSON
MAX_GROUPS = 4096  # groups in one submission (and results in one answer)
MAX_GROUP_SIZE = 1024  # completions of one prompt
MAX_REPLY_BYTES = 1 << 30  # a worker's answer the controller reads (results, progress)
MAX_SAMPLES = 65536  # completions in one submission
GRACEFUL_S = 2.0  # requests still open this long after a SIGTERM are cancelled
PROGRESS_PATH = "/v1/progress"
PROGRESS_WAIT_S = 2.0  # GET /v1/progress waits this long for the generation thread (a
# busy one, compiling, is asked again at the next snapshot: the records it had stand)


def check_groups(raw: Any) -> list[GroupRequest]:
    """The groups of a ``POST /v1/groups`` body, within this module's bounds; ValueError
    naming the field otherwise."""
    if not isinstance(raw, list):
        raise ValueError('expected {"groups": [...]}')
    if len(raw) > MAX_GROUPS:
        raise ValueError(f"groups: at most {MAX_GROUPS} groups per request, got {len(raw)}")
    groups = [GroupRequest.from_dict(g) for g in raw]
    for g in groups:
        if g.group_size > MAX_GROUP_SIZE:
            raise ValueError(
                f"group_size must be at most {MAX_GROUP_SIZE}, got {g.group_size} "
                f"(prompt_id {g.prompt_id!r})"
            )
    total = sum(g.group_size for g in groups)
    if total > MAX_SAMPLES:
        raise ValueError(
            f"groups: at most {MAX_SAMPLES} completions (sum of group_size) per request, got "
            f"{total}: send fewer groups at a time"
        )
    return groups


def create_app(worker: InferenceWorker, token: str, max_body_bytes: int = MAX_BODY_BYTES) -> Any:
    """The FastAPI application around a started ``InferenceWorker``; every call needs ``token``."""
    from fastapi import HTTPException  # lazy: a colocated run imports this module, serves nothing

    app = authorized_app("RLAX inference worker", token, max_body_bytes=max_body_bytes)

    @app.get("/healthz")
    def healthz() -> dict:
        return {"status": "ok", "version": worker.version}

    @app.get("/v1/status")
    def status() -> dict:
        return worker.status()

    @app.post("/v1/groups")
    def submit(body: dict) -> dict:
        try:  # (400: the controller skips the prompt the message names)
            groups = check_groups(body.get("groups"))
            worker.submit(groups)
        except (ValueError, TypeError) as e:
            raise HTTPException(400, str(e)) from e
        return {"accepted": len(groups)}

    @app.get("/v1/results")
    async def results(wait_s: float = 0.0, max_groups: int | None = None) -> dict:
        try:
            wait_s = check_wait_s(wait_s)
            if max_groups is not None and not 1 <= max_groups <= MAX_GROUPS:
                raise ValueError(f"max_groups must lie in [1, {MAX_GROUPS}], got {max_groups}")
        except ValueError as e:
            raise HTTPException(422, str(e)) from None
        try:  # on the event loop: worker.results(0) only takes the worker's lock briefly
            done = await long_poll(lambda: worker.results(0.0, max_groups), wait_s)
        except RuntimeError as e:
            raise HTTPException(500, str(e)) from e
        return {"results": [r.to_dict() for r in done]}

    @app.get(PROGRESS_PATH)
    def progress() -> dict:
        try:  # (a worker thread: the generation thread answers between two steps)
            groups = worker.progress(timeout_s=PROGRESS_WAIT_S)
        except TimeoutError as e:
            raise HTTPException(503, str(e)) from e
        except RuntimeError as e:
            raise HTTPException(500, str(e)) from e
        return {
            "groups": [
                {"prompt_id": prompt_id, "samples": [r.to_dict() for r in records]}
                for prompt_id, records in groups.items()
            ]
        }

    @app.post("/v1/reset")
    def reset() -> dict:
        return {"dropped": worker.reset()}

    return app


class WorkerClient:
    """The controller's view of one worker; every call has a timeout."""

    def __init__(
        self,
        url: str,
        token: str | None = None,
        timeout_s: float = 10.0,
        max_reply_bytes: int = MAX_REPLY_BYTES,
    ) -> None:
        """``max_reply_bytes``: a longer answer (an oversized rollout) is a failure of the
        worker (ConnectionError), read no further."""
        # a URL, or the service file the worker publishes its address to (followed when it moves)
        self.endpoint, self.timeout_s = Endpoint(url), timeout_s
        self.token = token if token is not None else os.environ.get(TOKEN_ENV)
        self.http = JsonClient(
            self.endpoint, self.token, timeout_s=timeout_s, max_reply_bytes=max_reply_bytes,
            refused=self._refused, unreachable=self._unreachable,
        )  # fmt: skip

    @property
    def url(self) -> str:
        return str(self.endpoint)

    def _refused(self, reply: Reply, what: str) -> Exception:
        """400 / 413: the request is invalid or too large (ValueError: the controller sends its
        groups one by one and skips the one refused); 401 / 403: the run's token is not the
        worker's (RuntimeError: no retry mends it); any other error is the worker's failure
        (ConnectionError, retried elsewhere)."""
        if reply.status in (400, 413):
            return ValueError(f"worker {self.url} rejected the request: {reply.text}")
        if reply.status in (401, 403):
            return RuntimeError(
                f"worker {self.url} refused {what} (HTTP {reply.status}: {reply.text}): give "
                f"every job of the run the same {TOKEN_ENV}"
            )
        return ConnectionError(f"worker {self.url}: HTTP {reply.status}: {reply.text}")

    def _unreachable(self, error: Exception, what: str) -> Exception:
        return ConnectionError(f"worker {self.url} unreachable: {error}")

    def _call(
        self, method: str, path: str, body: Any = None, timeout_s: float | None = None
    ) -> Any:
        try:
            return self.http.call(method, path, body, timeout_s=timeout_s)
        except ReplyTooLargeError as e:
            raise ConnectionError(f"worker {self.url} answered too much: {e}") from e

    def submit(self, groups: Sequence[dict[str, Any]]) -> int:
        return self._call("POST", "/v1/groups", {"groups": list(groups)})["accepted"]

    def results(self, wait_s: float = 0.0, max_groups: int | None = None) -> list[dict[str, Any]]:
        path = self.results_path(wait_s, max_groups)
        reply = self._call(
            "GET", path, timeout_s=self.timeout_s + min(max(wait_s, 0.0), MAX_WAIT_S)
        )
        return reply["results"]

    @staticmethod
    def results_path(wait_s: float = 0.0, max_groups: int | None = None) -> str:
        """The path and query ``results`` asks (for a caller that sends it its own way)."""
        wait_s = min(max(wait_s, 0.0), MAX_WAIT_S)
        return f"/v1/results?wait_s={wait_s}" + (f"&max_groups={max_groups}" if max_groups else "")

    def results_answer(self, status: int, body: bytes) -> list[dict[str, Any]]:
        """The groups of a ``results_path`` reply, or the error ``results`` raises for it."""
        return self._answer(status, body, "results", "GET /v1/results")

    def _answer(self, status: int, body: bytes, key: str, what: str) -> list[dict[str, Any]]:
        """``key`` of the reply to ``what``, read by the caller's own transport."""
        reply = Reply(status, body)
        if status >= 300:
            raise self._refused(reply, what)
        try:
            return reply.json()[key]
        except (ValueError, KeyError, TypeError) as e:
            raise ConnectionError(f"worker {self.url}: unreadable answer to {what} ({e})") from e

    def reset(self) -> int:
        return self._call("POST", "/v1/reset", {})["dropped"]

    def progress(self) -> list[dict[str, Any]]:
        """What the worker's unfinished groups hold so far: [{"prompt_id", "samples"}]."""
        reply = self._call("GET", PROGRESS_PATH, timeout_s=self.progress_timeout_s)
        return reply["groups"]

    @property
    def progress_timeout_s(self) -> float:
        """How long a progress request may take (the worker waits for its generation thread)."""
        return self.timeout_s + PROGRESS_WAIT_S

    def progress_answer(self, status: int, body: bytes) -> list[dict[str, Any]]:
        """The groups of a ``PROGRESS_PATH`` reply, or the error ``progress`` raises for it."""
        return self._answer(status, body, "groups", f"GET {PROGRESS_PATH}")

    def status(self) -> dict[str, Any]:
        return self._call("GET", "/v1/status")


def parse_mesh_shape(text: str) -> tuple[int, ...]:
    """ "DATA,FSDP,TENSOR" or "DATA,FSDP,EXPERT,TENSOR" (one entry may be -1) -> a tuple;
    ValueError naming the flag."""
    try:
        shape = tuple(int(x) for x in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) not in (3, 4) or any(s == 0 or s < -1 for s in shape) or shape.count(-1) > 1:
        raise ValueError(
            f"--mesh-shape {text!r}: give DATA,FSDP,TENSOR (or DATA,FSDP,EXPERT,TENSOR) as "
            "positive integers, at most one of them -1 for 'the remaining devices' (e.g. "
            "1,1,-1: tensor parallel over all)"
        )
    return shape  # type: ignore[return-value]


def worker_mesh(mesh_shape: str) -> Any:
    """The worker's (data, fsdp, tensor) mesh over this process's devices; None for one device
    (weights and cache then simply live on it)."""
    # lazy: the controller imports this module (WorkerClient); only a worker loads JAX
    import jax

    from rlax_tasks.models.sharding import mesh_from_shape

    shape = parse_mesh_shape(mesh_shape)
    devices = jax.local_devices()
    mesh = mesh_from_shape(shape, devices)
    if mesh.size == 1:
        return None
    log.info("worker mesh %s over %d %s devices", dict(mesh.shape), mesh.size, devices[0].platform)
    return mesh
