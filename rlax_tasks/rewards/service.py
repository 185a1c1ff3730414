"""The math and code verifiers as a local HTTP service, plus its client, so verification can run
off the inference workers (the command, `rlax verify serve`: rewards/cli.py). Binds 127.0.0.1 by
default (--port 0 prints the address first); it runs code, so it needs the run's token
(``RLAX_PS_TOKEN``: missing 401, wrong 403; unset: exit 2). A body over ``--max-body-mb`` is
refused (413), every field bounded (422).
"""

import logging
import os
from collections.abc import Sequence
from contextlib import asynccontextmanager
from typing import Any

from rlax_tasks.rewards import judge as judge_mod
from rlax_tasks.rewards import sandbox
from rlax_tasks.rewards.judge import Checker, JudgeResult, Submission, TestCase, TestVerdict
from rlax_tasks.rewards.math import VERIFIER_VERSION, MathResult, MathVerifier
from rlax_tasks.rewards.sandbox_types import ExecResult
from rlax_tasks.services.endpoints import announce, listen
from rlax_tasks.services.http import (
    TOKEN_ENV,
    JsonClient,
    Reply,
    authorized_app,
    serve_app,
)

logger = logging.getLogger(__name__)

_MAX_ITEMS = 4096
_MAX_TEXT = 1 << 20  # characters of a response, reference or program
_MAX_NAME = 64  # characters of a language or comparison name
_MAX_TESTS = 16384  # test cases in one judge request, over all its submissions
MAX_BODY_MB = 128  # default body limit: code problems carry their test cases


def create_app(
    token: str,
    math_workers: int | None = None,
    math_timeout_s: float = 5.0,
    max_parallel: int | None = None,
    max_body_bytes: int = MAX_BODY_MB << 20,
) -> Any:
    """The FastAPI application, every call needing ``token``; verifiers (and their worker
    processes) start with the app."""
    # lazy: the CLI imports this module, and FastAPI loads only where the service runs
    from fastapi import FastAPI, HTTPException
    from pydantic import BaseModel, Field

    parallel = max(1, max_parallel or os.cpu_count() or 1)
    sandbox.set_max_concurrency(parallel)
    state: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):  # noqa: ANN202 - FastAPI lifespan protocol
        state["math"] = MathVerifier(workers=math_workers, timeout_s=math_timeout_s)
        try:
            yield
        finally:
            state["math"].close()

    app = authorized_app("RLAX verifiers", token, max_body_bytes=max_body_bytes, lifespan=lifespan)

    class MathItem(BaseModel):
        response: str = Field(max_length=_MAX_TEXT)
        reference: str = Field(max_length=_MAX_TEXT)

    class MathRequest(BaseModel):
        items: list[MathItem] = Field(max_length=_MAX_ITEMS)

    class RunRequest(BaseModel):
        source: str = Field(max_length=_MAX_TEXT)
        language: str = Field("python", max_length=_MAX_NAME)
        stdin: str = ""
        timeout_s: float = Field(2.0, gt=0, le=60)
        memory_mb: int = Field(256, gt=0, le=16384)

    class TestModel(BaseModel):
        input: str
        expected: str

    class CheckerModel(BaseModel):
        source: str = Field(max_length=_MAX_TEXT)
        language: str = Field("python", max_length=_MAX_NAME)
        timeout_s: float = Field(5.0, gt=0, le=60)
        memory_mb: int = Field(512, gt=0, le=16384)

    class SubmissionModel(BaseModel):
        source: str = Field(max_length=_MAX_TEXT)
        tests: list[TestModel] = Field(min_length=1, max_length=_MAX_ITEMS)
        language: str = Field("python", max_length=_MAX_NAME)
        comparison: str = Field("tokens", max_length=_MAX_NAME)
        checker: CheckerModel | None = None
        timeout_s: float = Field(2.0, gt=0, le=60)
        memory_mb: int = Field(256, gt=0, le=16384)
        fn_name: str | None = Field(None, max_length=200)  # call-based (Python) when set

    class JudgeRequest(BaseModel):
        submissions: list[SubmissionModel] = Field(max_length=_MAX_ITEMS)

    @app.get("/healthz")
    def healthz() -> dict:
        info = sandbox.sandbox_info()
        return {
            "status": "ok",
            "math_verifier_version": VERIFIER_VERSION,
            "sandbox": info,
            "max_parallel": parallel,
        }

    @app.post("/v1/math/verify")
    def math_verify(req: MathRequest) -> dict:
        pairs = [(item.response, item.reference) for item in req.items]
        results = state["math"].check_batch(pairs)
        return {"version": VERIFIER_VERSION, "results": [r.to_dict() for r in results]}

    @app.post("/v1/code/run")
    def code_run(req: RunRequest) -> dict:
        try:
            sandbox.normalize_language(req.language)
            result = sandbox.run(req.source, req.language, req.stdin, req.timeout_s, req.memory_mb)
        except ValueError as exc:
            raise HTTPException(status_code=400, detail=str(exc)) from exc
        return result.to_dict()

    @app.post("/v1/code/judge")
    def code_judge(req: JudgeRequest) -> dict:
        tests = sum(len(s.tests) for s in req.submissions)
        if tests > _MAX_TESTS:
            raise HTTPException(
                422, f"submissions: at most {_MAX_TESTS} tests per request in all, got {tests}"
            )
        subs = [
            Submission(
                s.source,
                tuple(TestCase(t.input, t.expected) for t in s.tests),
                s.language,
                s.comparison,
                Checker(**s.checker.model_dump()) if s.checker else None,
                s.timeout_s,
                s.memory_mb,
                s.fn_name,
            )
            for s in req.submissions
        ]
        try:
            results = judge_mod.judge_batch(subs, max_parallel=parallel)
        except ValueError as exc:
            raise HTTPException(status_code=400, detail=str(exc)) from exc
        return {"results": [r.to_dict() for r in results]}

    return app


def serve(
    token: str,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    math_workers: int | None = None,
    math_timeout_s: float = 5.0,
    max_parallel: int | None = None,
    max_body_bytes: int = MAX_BODY_MB << 20,
    log_level: str = "info",
) -> None:
    """Run the service until interrupted; prints its URL on the first line of stdout."""
    app = create_app(token, math_workers, math_timeout_s, max_parallel, max_body_bytes)
    sock, url = listen(host, port)
    announce(url)  # first-line contract
    serve_app(app, sock, log_level=log_level, lifespan="on")


class VerifierError(RuntimeError):
    """The verifier service answered with an error."""


def _verifier_error(reply: Reply, what: str) -> VerifierError:
    return VerifierError(f"{what} -> HTTP {reply.status}: {reply.text[:2000]}")


class VerifierClient:
    """Small stdlib client of the verifier service."""

    def __init__(self, url: str, token: str | None = None, timeout_s: float = 300.0) -> None:
        """`url` as printed by `rlax verify serve`, e.g. http://127.0.0.1:8000; ``token``: the
        run's (None: ``RLAX_PS_TOKEN``)."""
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        token = token if token is not None else os.environ.get(TOKEN_ENV)
        # no retries; a connection error is raised as it is (an OSError)
        self.http = JsonClient(self.url, token, timeout_s=timeout_s, refused=_verifier_error)

    def _request(self, method: str, path: str, body: dict | None = None) -> dict:
        return self.http.call(method, path, body)

    def health(self) -> dict:
        return self._request("GET", "/healthz")

    def check_math(self, pairs: Sequence[tuple[str, str]]) -> list[MathResult]:
        items = [{"response": r, "reference": ref} for r, ref in pairs]
        out = self._request("POST", "/v1/math/verify", {"items": items})
        return [MathResult(**r) for r in out["results"]]

    def verify_math(self, response: str, reference: str) -> float:
        return self.check_math([(response, reference)])[0].reward

    def run(
        self,
        source: str,
        language: str = "python",
        stdin: str = "",
        timeout_s: float = 2.0,
        memory_mb: int = 256,
    ) -> ExecResult:
        out = self._request(
            "POST",
            "/v1/code/run",
            {
                "source": source,
                "language": language,
                "stdin": stdin,
                "timeout_s": timeout_s,
                "memory_mb": memory_mb,
            },
        )
        return ExecResult(**out)

    def judge_batch(self, submissions: Sequence[Submission]) -> list[JudgeResult]:
        body = {
            "submissions": [
                {
                    "source": s.source,
                    "language": s.language,
                    "comparison": s.comparison,
                    "tests": [{"input": t.input, "expected": t.expected} for t in s.tests],
                    "checker": None
                    if s.checker is None
                    else {
                        "source": s.checker.source,
                        "language": s.checker.language,
                        "timeout_s": s.checker.timeout_s,
                        "memory_mb": s.checker.memory_mb,
                    },
                    "timeout_s": s.timeout_s,
                    "memory_mb": s.memory_mb,
                    "fn_name": s.fn_name,
                }
                for s in submissions
            ]
        }
        out = self._request("POST", "/v1/code/judge", body)
        return [
            JudgeResult(
                r["reward"],
                r["verdict"],
                [TestVerdict(**t) for t in r["tests"]],
                r["compile_output"],
            )
            for r in out["results"]
        ]
