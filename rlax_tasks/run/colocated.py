"""A whole run in one process on one host's devices (placement.mode colocated; the command,
`rlax colocated`, in run/cli.py).

Trainer, sampler, parameter server and controller share the process (docs/design.md §12); the
sampler takes each version from the trainer's arrays device to device. Recovery is the disaggregated
code's own: after kill -9 the same command resumes exactly. Nothing inside reads the PS."""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import signal
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import jax

from rlax_tasks.controller.rollouts import read_step_batch
from rlax_tasks.controller.service import make_controller
from rlax_tasks.controller.snapshot import SnapshotStore
from rlax_tasks.paramserver import ParameterServerClient
from rlax_tasks.paramserver.client import VersionConflictError
from rlax_tasks.paramserver.server import ParameterServer, ServerConfig
from rlax_tasks.plan.compilation_cache import enable_in_process
from rlax_tasks.process.device_check import check_job_devices
from rlax_tasks.process.garbage_collection import freeze_startup
from rlax_tasks.rollout.service import PROGRESS_WAIT_S, worker_mesh
from rlax_tasks.run.trainer_process import load_trainer_policy
from rlax_tasks.rundir import lock as run_lock
from rlax_tasks.rundir import notices
from rlax_tasks.services.endpoints import bind_host
from rlax_tasks.services.endpoints import publish as publish_address
from rlax_tasks.services.http import run_token
from rlax_tasks.trainer.service import TrainerService, step_arrays

log = logging.getLogger(__name__)

WORKER_ID = "worker-0"  # the sampler, as the controller's snapshots and lineage name it
IDLE_S = 0.005  # the longest the driver waits between two rounds of the controller


class TrainerWeights:
    """The sampler's ``WeightSource`` in a colocated run: the trainer's current weights.

    ``pull`` casts them to the compute dtype onto the sampler's shardings as fresh buffers (the
    trainer's next step donates its own), under the trainer service's lock, so no step runs while
    they are read. ``advanced()`` wakes a pull waiting for a newer version."""

    fresh_arrays = True  # pulls are new device arrays on the sampler's shardings: donated

    def __init__(self, service: Any, shardings: Any, dtype: str, wait_s: float = 1.0) -> None:
        self.service, self.shardings, self.dtype = service, shardings, dtype
        self.wait_s = wait_s
        self._changed = threading.Condition()
        self.pulls = 0
        self.last_pull_s: float | None = None

    def latest_version(self) -> int:
        return self.service.step

    def advanced(self) -> None:
        """The trainer applied a step: wakes pulls waiting for it."""
        with self._changed:
            self._changed.notify_all()

    def pull(self, min_version: int | None = None, *, like: Any = None) -> tuple[int, Any]:
        """(version, weights on the sampler's shardings); waits up to ``wait_s`` for
        ``min_version`` (TimeoutError: the worker keeps generating and asks again)."""
        if self.service.trainer.stopped is not None:  # (its weights may be non-finite)
            raise TimeoutError(f"training stopped: {self.service.trainer.stopped}")
        deadline = time.monotonic() + self.wait_s
        with self._changed:
            while min_version is not None and self.service.step < min_version:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"the trainer is at version {self.service.step}, not {min_version} yet"
                    )
                self._changed.wait(left)
        t0 = time.perf_counter()
        with self.service.lock:
            version = self.service.step
            params = jax.tree.map(self._fresh, self.service.trainer.params, self.shardings)
            jax.block_until_ready(params)
        self.pulls += 1
        self.last_pull_s = time.perf_counter() - t0
        return version, params

    def _fresh(self, a: Any, sharding: Any) -> Any:
        b = a.astype(self.dtype) if a.dtype != self.dtype else a
        # a cast made a buffer of its own; the trainer's array itself is copied
        return jax.device_put(b, sharding, may_alias=None if b is not a else False)

    def ack(self, version: int) -> None:
        pass


class InProcessWorkers:
    """The controller's ``WorkerPool`` over ``InferenceWorker``s of this process."""

    def __init__(self, workers: dict[str, Any]) -> None:
        self.workers = workers

    def worker_ids(self) -> list[str]:
        return list(self.workers)

    def submit(self, worker_id: str, groups: Sequence[Any]) -> None:
        self.workers[worker_id].submit(groups)

    def results(self, worker_id: str) -> list[Any]:
        return self.workers[worker_id].results(wait_s=0.0)

    def reset(self, worker_id: str) -> None:
        self.workers[worker_id].reset()

    def progress(self, worker_id: str) -> dict[str, Any]:
        return self.workers[worker_id].progress(timeout_s=PROGRESS_WAIT_S)


def publish_steps(cfg: Any, steps: int) -> set[int]:
    """The versions the run hands its parameter server: every eval.every_steps-th and the
    last ``steps``."""
    every = cfg.eval.every_steps
    wanted = set(range(every, steps + 1, every)) if every else set()
    wanted.add(steps)
    return wanted


def catch_up(service: Any, run_dir: str) -> int:
    """Replays the steps between the trainer's checkpoint and the controller's newest snapshot
    from ``rollouts/`` (the sampler then starts at the snapshot's version); returns how many."""
    snap = SnapshotStore(run_dir, keep=None).load_latest()
    target = 0 if snap is None else snap.step
    start = service.step
    if start < target:
        log.warning(
            "the trainer restored step %d, the controller's snapshot is at step %d: replaying "
            "steps %d-%d from rollouts/",
            start, target, start + 1, target,
        )  # fmt: skip
    for k in range(start + 1, target + 1):
        service.train(k, step_arrays(read_step_batch(run_dir, k)))
    return max(0, target - start)


def sampler_policy(trainer_policy: Any, mesh_shape: Sequence[int], dtype: str) -> Any:
    """The sampler's policy: the trainer's model in the compute dtype on the sampler's mesh
    (``workers.mesh_shape`` over this process's devices; None for one device)."""
    # lazy: the model's modules load after the process tuning of `rlax colocated` (run/cli.py)
    from rlax_tasks.models.policy import cast_params
    from rlax_tasks.models.sharding import param_shardings

    mesh = worker_mesh(",".join(str(s) for s in mesh_shape))
    params = cast_params(trainer_policy.params, dtype)
    if mesh is None:
        device = jax.local_devices()[0]
        shardings = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(device), params)
    else:
        shardings = param_shardings(params, mesh)
    placed = jax.tree.map(lambda a, s: jax.device_put(a, s, may_alias=False), params, shardings)
    return dataclasses.replace(trainer_policy, params=placed, mesh=mesh, param_dtype=None)


class ColocatedRun:
    """A colocated run's components, built and started in order (``start``), driven by
    ``run(steps)`` and stopped cleanly by ``stop`` (final checkpoint, mirror flushed)."""

    def __init__(self, cfg: Any, ps_host: str | None = None, ps_port: int = 0,
                 ps_args: dict[str, Any] | None = None) -> None:  # fmt: skip
        self.cfg = cfg
        self.ps_host, self.ps_port, self.ps_args = ps_host, ps_port, dict(ps_args or {})
        self.service: Any = None
        self.server: Any = None
        self.ps: Any = None
        self.weights: TrainerWeights | None = None
        self.worker: Any = None
        self.controller: Any = None
        self.replayed = 0
        self._publish: set[int] = set()

    # ------------------------------------------------------------------ start
    def start(self) -> ColocatedRun:
        """Trainer (restored, caught up to the snapshot), parameter server, sampler, controller."""
        # lazy: the model's modules load after the process tuning of `rlax colocated` (run/cli.py)
        from rlax_tasks.algorithms import make_objective
        from rlax_tasks.rollout.sampler import Sampler
        from rlax_tasks.rollout.worker import InferenceWorker
        from rlax_tasks.trainer.trainer import Trainer

        cfg = self.cfg
        policy = load_trainer_policy(cfg)
        objective = make_objective(cfg.algorithm.preset, **cfg.objective_overrides())
        every = max(1, cfg.trainer.checkpoint_every)  # as the disaggregated trainer
        trainer = Trainer(
            policy, objective, dataclasses.replace(cfg.trainer, checkpoint_every=every),
            cfg.run_dir, sampling_temperature=cfg.rollout.logprob_temperature,
        )  # fmt: skip
        self.service = TrainerService(trainer).start()  # restores the newest checkpoint
        self._start_parameter_server()
        self.replayed = catch_up(self.service, cfg.run_dir)
        spolicy = sampler_policy(trainer.policy(), cfg.workers.mesh_shape, cfg.model.dtype)
        sampler = Sampler(
            spolicy,
            cfg.workers.slots,
            cfg.workers.max_len,
            precompile=True,
            support_capacity=cfg.rollout.support_size,
            layer_copies=cfg.workers.decode_layer_copies,
        )
        shardings = jax.tree.map(lambda a: a.sharding, sampler.params)
        self.weights = TrainerWeights(self.service, shardings, cfg.model.dtype)
        self.worker = InferenceWorker(
            sampler, self.weights, reload_every=cfg.staleness.reload_every, poll_interval_s=0.01,
            interrupt=cfg.workers.interrupt_on_reload,
        ).start()  # fmt: skip
        self.controller = make_controller(
            cfg, InProcessWorkers({WORKER_ID: self.worker}), self._train_step
        )
        self.controller.start(initial_version=self.service.step)
        return self

    def _start_parameter_server(self) -> None:
        token = run_token()  # the run's RLAX_PS_TOKEN (or a new one: then only this process has it)
        config = ServerConfig(
            token=token,
            host=bind_host(self.ps_host),
            port=self.ps_port,
            run_root=self.cfg.run_dir,
            **self.ps_args,
        )
        self.server = ParameterServer(config).start()
        self.ps = ParameterServerClient(self.server.address, token=token)

    # ------------------------------------------------------------------ run
    def _train_step(self, batch: Any) -> int:
        out = self.service.train(batch.version, step_arrays(batch))
        self.weights.advanced()
        version = int(out["version"])
        if version in self._publish:
            self.publish()
        return version

    def publish(self) -> None:
        """Pushes the trainer's current version to the parameter server (unless it has it)."""
        from rlax_tasks.models.policy import cast_params  # lazy: as in start()

        version = self.service.step
        if self.service.trainer.stopped is not None:  # never push what a stop left behind
            return
        if (self.ps.latest_version() or -1) >= version:
            return
        t0 = time.perf_counter()
        try:
            self.ps.push(version, cast_params(self.service.trainer.params, self.cfg.model.dtype))
        except VersionConflictError:
            return
        log.info("published version %d in %.2fs", version, time.perf_counter() - t0)

    def run(self, steps: int, status_every_s: float = 10.0, lock: Any = None) -> None:
        """Trains until the controller reached ``steps`` (in total, across restarts); with
        ``lock`` (the run lock, ``run_lock.for_job``), stops when it was lost."""
        self._publish = publish_steps(self.cfg, steps)
        last = time.monotonic()
        while self.controller.step < steps:
            if lock is not None:
                lock.check()
            progressed = self.controller.iterate(last_step=steps)
            if not progressed and not self.controller.wait_for_scoring(IDLE_S):
                # woken by the sampler's next finished group: a fixed sleep would delay every
                # lockstep step, which waits for its whole batch
                self.worker.wait_for_results(IDLE_S)
            if time.monotonic() - last > status_every_s:
                last = time.monotonic()
                log.info("colocated: %s", json.dumps(self.controller.status(), sort_keys=True))
        self.publish()  # the final version (also when a resumed run had nothing left to do)
        log.info("colocated run done at step %d: %s", self.controller.step,
                 self.controller.status())  # fmt: skip

    def stop(self) -> None:
        """Stops the sampler, flushes the mirror, checkpoints the steps since the last one."""
        if self.controller is not None:
            self.controller.close()
        if self.worker is not None:
            self.worker.stop()
        if self.ps is not None:
            self.ps.close()
        if self.server is not None:
            self.server.stop()
        if self.service is not None:
            self.service.stop()


def run_colocated(
    cfg: Any,
    steps: int,
    *,
    host: str,
    port: int,
    publish: str | None,
    ps_args: dict[str, Any],
    status_every_s: float,
) -> int:
    """Runs colocated run config ``cfg`` to step ``steps`` in this process (resuming it), its
    parameter server on ``host``:``port`` with ``ps_args`` (its URL on stdout line 1 and in the
    service file ``publish``). Call it after the process tuning (`rlax colocated`, run/cli.py)."""
    enable_in_process(cfg)
    check_job_devices("colocated")  # exit 2 when JAX's devices are not the placement's

    def terminate(*_: object) -> None:
        raise SystemExit(143)  # unwinds through stop(): final checkpoint, mirror flushed

    signal.signal(signal.SIGTERM, terminate)
    # one live process per run: a second one (a DAG task's retry beside a job still running, a
    # second trigger of the same run id) is refused before it restores anything
    with run_lock.for_job(cfg.run_dir) as lock:
        run = ColocatedRun(cfg, host, port, ps_args)
        try:
            run.start()
            freeze_startup()
            sys.stdout.write(run.server.address + "\n")  # first line: the parameter server's URL
            sys.stdout.flush()
            if publish:
                publish_address(publish, run.server.address)
            run.run(steps, status_every_s, lock)
        except OSError as e:
            if e.errno not in STORAGE_ERRNOS:
                raise
            raise storage_stopped(cfg.run_dir, e) from e  # one line and exit 2, no traceback
        finally:
            run.stop()
    return 0


# the storage refusing to write (full, over quota, read-only, no permission): restarting the
# job would only fail the same way
STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES)


def storage_stopped(run_dir: str, error: OSError) -> ValueError:
    """The run stopped because its storage refused a write: posted as a "fatal" notice; a
    ValueError, so that ``rlax`` reports it in one line and exits 2 (do not restart)."""
    from rlax_tasks.trainer.checkpointing import describe_error  # lazy: Orbax, as in start()

    where = error.filename or run_dir
    message = (
        f"cannot write {where}: {describe_error(error)}. The run stopped; free space on (or "
        "fix the permissions of) its storage and run the same command again to resume from "
        "its last checkpoint and snapshot"
    )
    notices.post(run_dir, "fatal", message, source="colocated")
    return ValueError(message)
