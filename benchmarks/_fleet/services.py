"""The fleet simulation's services, each in a child process: a parameter-server replica (the real
``ParameterServer``, its link modelled by ``egress_bytes_per_s``) and the fake trainer (the real
``TrainerService`` behind the real trainer HTTP app, over a trainer that computes nothing and
pushes random weights of a set size to replica 0)."""

from __future__ import annotations

import dataclasses
import logging
import resource
import threading
import time
from typing import Any

import numpy as np

log = logging.getLogger(__name__)


def _maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# --------------------------------------------------------------------------- replicas
@dataclasses.dataclass(frozen=True)
class ReplicaSettings:
    token: str
    replica: int
    egress_bytes_per_s: int | None
    upstreams: tuple[str, ...] = ()  # empty: replica 0, which takes the trainer's pushes
    worker_timeout_s: float = 60.0


def replica_main(conn: Any, settings: ReplicaSettings) -> None:
    """One replica: sends its URL on ``conn``, serves until told "stop", answers with its
    status and peak RSS."""
    from rlax_tasks.paramserver.server import ParameterServer, ServerConfig

    config = ServerConfig(
        token=settings.token,
        keep_versions=2,
        worker_timeout_s=settings.worker_timeout_s,
        shared_memory=False,  # every puller is "remote": its bytes pass the egress limit
        egress_bytes_per_s=settings.egress_bytes_per_s,
        upstreams=settings.upstreams,
        replica_id=f"ps-{settings.replica}" if settings.upstreams else "",
    )
    server = ParameterServer(config).start()
    conn.send(server.address)
    while True:
        try:
            command, _ = conn.recv()
        except EOFError:
            break
        conn.send({"status": server.status(), "maxrss": _maxrss()})  # "status" or "stop"
        if command == "stop":
            break
    server.stop()


# --------------------------------------------------------------------------- the trainer
@dataclasses.dataclass(frozen=True)
class TrainerSettings:
    token: str
    ps_url: str
    run_dir: str
    version_bytes: int
    arrays: int = 8
    dtype: str = "bfloat16"
    step_s: float = 0.0  # how long a step takes (no compute: a sleep)


class FakeTrainer:
    """What ``TrainerService`` needs of a ``Trainer``: step numbers, checkpoints that cost
    nothing, and a count of the groups and rows each step trained on."""

    def __init__(self, settings: TrainerSettings) -> None:
        self.settings = settings
        self.run_dir = settings.run_dir
        self.step_count = 0
        self.saved_step = 0
        self.trained: list[dict[str, Any]] = []

    def restore_latest(self) -> bool:
        return False

    def step(self, arrays: dict[str, np.ndarray], extra_metrics: Any = None) -> dict[str, Any]:
        groups = int(arrays["group_ids"].max()) + 1 if arrays["group_ids"].size else 0
        if self.settings.step_s > 0:
            time.sleep(self.settings.step_s)
        self.step_count += 1
        self.trained.append(
            {"step": self.step_count, "groups": groups, "rows": int(arrays["rewards"].size)}
        )
        return {"loss": 0.0}

    def save(self) -> None:
        self.saved_step = self.step_count

    def close(self) -> None:
        pass


def random_params(version: int, settings: TrainerSettings) -> dict[str, np.ndarray]:
    """``settings.arrays`` arrays of ``settings.version_bytes`` in all, new bytes per version."""
    import ml_dtypes

    dtype = np.dtype(getattr(ml_dtypes, settings.dtype, None) or settings.dtype)
    n = max(settings.version_bytes // (dtype.itemsize * settings.arrays), 1)
    rng = np.random.default_rng(version)
    raw = rng.integers(0, 256, n * dtype.itemsize * settings.arrays, dtype=np.uint8)
    return {
        f"layers.{i}.w": raw[i * n * dtype.itemsize : (i + 1) * n * dtype.itemsize].view(dtype)
        for i in range(settings.arrays)
    }


def trainer_main(conn: Any, settings: TrainerSettings) -> None:
    """The fake trainer: sends its URL on ``conn``, serves the trainer protocol until told
    "stop", answers with its pushes (version, start, end) and the groups it trained on."""
    from rlax_tasks.paramserver import ParameterServerClient
    from rlax_tasks.services.endpoints import listen
    from rlax_tasks.services.http import serve_app
    from rlax_tasks.trainer.http_app import create_app
    from rlax_tasks.trainer.service import TrainerService

    pushes: list[tuple[int, float, float]] = []

    class SimTrainerService(TrainerService):
        """The real service; only the weights it publishes are made up (no policy)."""

        def _published_params(self) -> Any:
            return random_params(self.step, settings)

        def _push(self, version: int) -> None:
            t0 = time.monotonic()
            super()._push(version)
            pushes.append((version, t0, time.monotonic()))

    trainer = FakeTrainer(settings)
    ps = ParameterServerClient(settings.ps_url, settings.token, shared_memory=False)
    service = SimTrainerService(trainer, ps).start()
    sock, url = listen("127.0.0.1", 0)
    until = threading.Event()

    def wait_for_stop() -> None:
        try:
            conn.recv()
        except EOFError:
            pass
        until.set()

    threading.Thread(target=wait_for_stop, daemon=True).start()
    conn.send(url)
    serve_app(create_app(service, settings.token), sock, graceful_s=1.0, until=until)
    conn.send({"pushes": pushes, "trained": trainer.trained, "maxrss": _maxrss()})
