"""The trainer's HTTP application (``create_app``; the protocol: rlax_tasks/trainer/service.py),
in its own module so that FastAPI loads only in the process that serves the trainer, not in a
colocated run. No ``from __future__ import annotations`` here: FastAPI reads the endpoint's
``Request`` annotation as the class itself.
"""

from typing import Any

from fastapi import HTTPException, Request
from starlette.concurrency import run_in_threadpool

from rlax_tasks.services.http import authorized_app
from rlax_tasks.services.protocol import StepConflictError, TrainerBehindError
from rlax_tasks.trainer.service import (
    DEFAULT_MAX_BODY_BYTES,
    BatchTooLargeError,
    TrainerService,
    decode_batch,
)


def create_app(
    service: TrainerService, token: str, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
) -> Any:
    """The FastAPI application of a started ``TrainerService``; every call needs ``token``."""
    app = authorized_app("RLAX trainer", token, max_body_bytes=max_body_bytes)

    @app.get("/v1/status")
    def status() -> dict:
        return {"step": service.step, "version": service.step}

    @app.post("/v1/steps/{step}")
    async def train(step: int, request: Request) -> dict:
        if step < 1:
            raise HTTPException(422, f"step must be an integer >= 1, got {step}")
        body = await request.body()
        try:
            batch = decode_batch(body, max_body_bytes)
        except BatchTooLargeError as e:
            raise HTTPException(413, str(e)) from e
        except (ValueError, OSError, EOFError) as e:
            raise HTTPException(400, f"the body is not an .npz batch: {e}") from e
        try:
            return await run_in_threadpool(service.train, step, batch)
        except TrainerBehindError as e:
            raise HTTPException(409, {"message": str(e), "trainer_step": e.trainer_step}) from e
        except StepConflictError as e:
            raise HTTPException(409, str(e)) from e
        except ValueError as e:  # a malformed batch (BatchFormatError names the key)
            raise HTTPException(400, str(e)) from e

    return app
