"""One trainer process built from the run configuration (the disaggregated layout's trainer, the
command `rlax trainer` in run/cli.py; run/colocated.py builds the colocated one), serving
``rlax_tasks.trainer.service.TrainerService`` to the controller behind the run's token.
It lives in the composition root because the run configuration builds on the trainer's
settings (rlax_tasks/trainer/config.py): the trainer package cannot import it back."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import signal
from collections.abc import Callable, Iterator
from typing import Any

from rlax_tasks.process.device_check import check_job_devices
from rlax_tasks.process.garbage_collection import freeze_startup
from rlax_tasks.services.endpoints import announce, bind_host, listen
from rlax_tasks.services.http import serve_app
from rlax_tasks.trainer.service import TrainerService, batch_body_limit

log = logging.getLogger(__name__)


def load_trainer_policy(cfg: Any) -> Any:
    """The run's base model for its trainer, loaded straight into the trainer's mesh: each
    parameter goes to its shards as it is read, never whole on one device (after
    jax.distributed.initialize on a multi-host trainer: the mesh spans every host)."""
    from rlax_tasks.models import load_pretrained  # after the caller's process tuning (below)
    from rlax_tasks.trainer.trainer import build_mesh

    return load_pretrained(
        cfg.model.path,
        dtype=cfg.model.dtype,
        param_dtype=cfg.model.param_dtype,
        mesh=build_mesh(cfg.trainer.mesh_shape),
    )


def serve_trainer(
    cfg: Any, token: str, ps_url: str | None, host: str, port: int, publish: str | None
) -> int:
    """Runs run config ``cfg``'s trainer (one host of its process group) until stopped: host 0
    serves the controller on ``host``:``port`` (its URL on stdout line 1 and in the service file
    ``publish``) and pushes each version to the PS at ``ps_url``; the others follow host 0. This
    module loads JAX: import it after the process tuning (`rlax trainer`, run/cli.py)."""
    from rlax_tasks.algorithms import make_objective
    from rlax_tasks.paramserver import ParameterServerClient
    from rlax_tasks.trainer.http_app import create_app  # FastAPI: not for every rlax command
    from rlax_tasks.trainer.process_group import CommandChannel, ProcessGroup
    from rlax_tasks.trainer.trainer import Trainer

    group = ProcessGroup.from_env(cfg.trainer.hosts)
    if group is not None:  # before anything touches a device
        group.initialize()
    check_job_devices("trainer")  # exit 2 when JAX's devices are not the placement's
    policy = load_trainer_policy(cfg)
    objective = make_objective(cfg.algorithm.preset, **cfg.objective_overrides())
    run_dir = cfg.run_dir
    # checkpoints at least every step: a trainer without any would replay the whole run
    every = max(1, cfg.trainer.checkpoint_every)
    trainer = Trainer(
        policy,
        objective,
        dataclasses.replace(cfg.trainer, checkpoint_every=every),
        run_dir,
        sampling_temperature=cfg.rollout.logprob_temperature,
    )
    ps = ParameterServerClient(ps_url, token) if ps_url else None
    channel = CommandChannel() if group is not None else None
    service = TrainerService(trainer, ps, channel=channel).start()
    freeze_startup()
    if not service.is_leader:  # host 0 serves the controller; this host does what it sends
        # a stop reaches every host from host 0 (with the group's final checkpoint); a SIGTERM
        # here would leave host 0 waiting in a collective
        signal.signal(signal.SIGTERM, lambda *_: log.info("SIGTERM: host 0 stops the group"))
        service.follow()
        return 0
    sock, url = listen(bind_host(host), port)
    announce(url, publish)  # first-line contract
    rows = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    limit = batch_body_limit(rows, cfg.workers.max_len)
    with _sigterm_after(service.stop):
        serve_app(create_app(service, token, max_body_bytes=limit), sock)
    return 0


@contextlib.contextmanager
def _sigterm_after(cleanup: Callable[[], None]) -> Iterator[None]:
    """Runs ``cleanup`` (the final checkpoint) when the block ends, and only then lets a
    SIGTERM received meanwhile end the process. uvicorn raises the signal that stopped it again
    once it shut down: SIGTERM's default action then killed the trainer before its checkpoint.
    The process still ends by SIGTERM, as its backend expects of a stopped job."""
    received: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, _frame: received.append(signum))
    try:
        yield
    finally:
        try:
            cleanup()
        finally:
            signal.signal(signal.SIGTERM, previous)
            if received:
                log.info("SIGTERM: the trainer has stopped")
                signal.raise_signal(signal.SIGTERM)
