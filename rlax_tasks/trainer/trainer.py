"""The Trainer: sharded train state, the jitted step, metrics and Orbax checkpoints in one
object, with no network code (the controller moves batches in and weights out). Training stops
for good (``TrainingStoppedError``, a "fatal" notice) when a step makes a value non-finite or
``MAX_FAILED_CHECKPOINTS`` checkpoints in a row fail: ``rlax`` exits 2 (do not restart), from a
request thread by ending the process itself (an exception would only become an HTTP error)."""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from rlax_tasks.models import Policy
from rlax_tasks.models.logprob_options import LogProbOptions
from rlax_tasks.models.policy import cast_params
from rlax_tasks.models.sharding import BATCH, fit_spec, mesh_from_shape, param_shardings
from rlax_tasks.rundir import notices
from rlax_tasks.rundir.paths import run_paths
from rlax_tasks.trainer.batch_format import BatchFormatError, checked_ids, host_batch
from rlax_tasks.trainer.checkpointing import MAX_FAILED_CHECKPOINTS, Checkpointer
from rlax_tasks.trainer.config import TrainerConfig, keep_logits_mb
from rlax_tasks.trainer.metrics import MetricsWriter
from rlax_tasks.trainer.optimizer import learning_rate_schedule, make_optimizer
from rlax_tasks.trainer.packing import pack_batch, row_multiple, row_width
from rlax_tasks.trainer.train_step import (
    MODEL,
    NONFINITE,
    NONFINITE_BITS,
    PACKED_KEYS,
    SUPPORT_KEY,
    VALUE_HEAD,
    StepSettings,
    init_value_head,
    make_logprobs_fn,
    make_train_step,
)

log = logging.getLogger(__name__)

CHECKPOINT_FORMAT = 1
EXIT_DO_NOT_RESTART = 2  # rlax's exit code for "restarting will not help" (the supervisor stops)


class TrainingStoppedError(ValueError):
    """Training cannot go on and a restart would not help; the message says what to do.

    A ValueError, so that ``rlax`` reports it in one line and exits 2 (do not restart).
    """


class NonFiniteError(TrainingStoppedError):
    """A step made the loss, the gradient norm or a weight NaN or infinite."""


class CheckpointWriteError(TrainingStoppedError):
    """``MAX_FAILED_CHECKPOINTS`` checkpoints in a row could not be written."""


@dataclasses.dataclass(frozen=True)
class RestoredCheckpoint:
    """What ``Trainer.restore_latest`` brought back besides the arrays."""

    step: int
    data_cursor: dict[str, Any] | None


def build_mesh(mesh_shape: tuple[int, ...]) -> Mesh:
    """The (data, fsdp[, expert], tensor) mesh; without a -1 entry it uses the first
    prod(shape) devices."""
    devices = jax.devices()
    if -1 not in mesh_shape:
        need = math.prod(mesh_shape)
        if need > len(devices):
            raise ValueError(
                f"mesh_shape={list(mesh_shape)} needs {need} devices, only {len(devices)} exist"
            )
        devices = devices[:need]
    return mesh_from_shape(mesh_shape, devices)


def fresh_copy(tree: Any, shardings: Any) -> Any:
    """``tree`` placed on ``shardings`` in newly allocated buffers (never aliasing the input).

    The train step donates its parameter buffers, so anything that must outlive a step (the
    caller's policy, the frozen reference, an in-flight checkpoint) needs its own buffers;
    ``device_put`` may reuse a source buffer for one of the shards."""
    placed = jax.tree.map(place_global, tree, shardings)
    leaves, treedef = jax.tree.flatten(shardings)
    return _copier(treedef, tuple(leaves))(placed)


@functools.lru_cache(maxsize=16)
def _copier(treedef: Any, shardings: tuple) -> Callable[[Any], Any]:
    """The jitted copy onto these shardings, made once: a new jit per call was traced and
    compiled again at every checkpoint."""
    out = jax.tree.unflatten(treedef, shardings)
    return jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=out)


def place_global(x: Any, sharding: jax.sharding.Sharding) -> jax.Array:
    """``x`` placed on ``sharding``; on a multi-host mesh each process builds its own shards
    from its host copy of ``x`` (every process holds the same value: a loaded model, a batch)."""
    if sharding.is_fully_addressable or (isinstance(x, jax.Array) and not x.is_fully_addressable):
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


class Trainer:
    """Trains a copy of ``policy`` with ``objective`` under ``config``; checkpoints and
    metrics.jsonl go to ``run_dir`` (run_root/<run_id>). With a KL term the policy given is the
    frozen reference: pass the base model also when resuming. One optimizer update per ``step``.
    On a multi-host mesh every process makes the same calls with the same batch; each places and
    checkpoints its own shards, and process 0 writes the metrics."""

    def __init__(
        self,
        policy: Policy,
        objective: Any,
        config: TrainerConfig,
        run_dir: str,
        metrics_writer: MetricsWriter | None = None,
        exit_on_stop: bool | None = None,
        sampling_temperature: float = 1.0,
    ) -> None:
        self.config = config
        self.objective = objective
        self.run_dir = run_dir
        self.mesh = build_mesh(config.mesh_shape)
        self._graphdef = policy.graphdef
        self._template = dataclasses.replace(policy, params=None, mesh=self.mesh)
        # the lr metric of each step, as one compiled call: the schedule's eager jnp ops
        # compiled op by op at the first step, then dispatched op by op at every step
        self._schedule = jax.jit(learning_rate_schedule(config))
        self._optimizer = make_optimizer(config)
        self._rng = jax.random.key(config.seed)
        self.step_count = 0
        self.saved_step = 0  # the step of the newest checkpoint started or restored
        # when training stopped for good (non-finite values, checkpoints that cannot be
        # written): why; nothing is checkpointed or handed out any more
        self.stopped: TrainingStoppedError | None = None
        # on a stop: end the process (exit 2) instead of raising; None = when the step runs
        # outside the main thread (a service's request thread)
        self.exit_on_stop = exit_on_stop

        params: dict[str, Any] = {MODEL: policy.params}
        if objective.needs_values:
            params[VALUE_HEAD] = init_value_head(policy.config.hidden_size)
        self._replicated = NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        self._param_shardings = param_shardings(params, self.mesh)
        self._params = fresh_copy(params, self._param_shardings)
        self._ref_params = None
        if objective.needs_reference:  # frozen copy of the initial policy, in the compute dtype
            # (the forward casts every weight to it anyway: float32 here would only cost memory)
            ref = cast_params(policy.params, policy.dtype)
            self._ref_params = fresh_copy(ref, param_shardings(ref, self.mesh))
        opt_abstract = jax.eval_shape(self._optimizer.init, self._params)
        self._opt_shardings = param_shardings(opt_abstract, self.mesh)
        with jax.set_mesh(self.mesh):
            self._opt_state = jax.jit(self._optimizer.init, out_shardings=self._opt_shardings)(
                self._params
            )

        obj_config = getattr(objective, "config", None)
        # Dr. GRPO without a fixed max_length divides by the array width: padding would change it
        self._width_free = not (
            getattr(obj_config, "agg", None) == "max_length" and obj_config.max_length is None
        )
        if config.length_bucket and not self._width_free:
            log.warning(
                "agg='max_length' without max_length normalises by each batch's width: batches "
                "are not padded to buckets, so every new width compiles the step again (set the "
                "objective's max_length, e.g. to the generation budget)"
            )
        platform = self.mesh.devices.flat[0].platform
        logprobs = LogProbOptions(
            chunk_size=config.logprob_chunk_size,
            remat=config.remat,
            keep_logits_bytes=keep_logits_mb(config.keep_logits_mb, platform) << 20,
            temperature=sampling_temperature,
            replay_routes=config.routing_replay == "replay",
        )
        settings = StepSettings(
            micro_batch_size=config.micro_batch_size,
            logprobs=logprobs,
            value_loss_coef=config.value_loss_coef,
            router_aux_loss_coef=config.router_aux_loss_coef,
            # XLA:CPU's concurrency-optimised scheduler deadlocks the collectives of the
            # one-pass step over several host devices (a rendezvous timeout; passes with that
            # scheduler off): simulated meshes keep the prefill
            one_forward_pass=not (self.mesh.devices.size > 1 and platform == "cpu"),
        )
        self._train_step = jax.jit(
            make_train_step(self._graphdef, objective, self._optimizer, settings),
            donate_argnums=(0, 1),
            # metrics replicated: every host of a multi-host mesh reads them
            out_shardings=(self._param_shardings, self._opt_shardings, self._replicated),
        )
        self._ref_logprobs = jax.jit(make_logprobs_fn(self._graphdef, settings))

        ckpt_dir = config.checkpoint_dir or run_paths(run_dir).checkpoints
        self.checkpointer = Checkpointer(
            ckpt_dir, max_to_keep=config.max_to_keep, async_save=config.async_checkpointing
        )
        if metrics_writer is None and jax.process_index() == 0:
            # a local file, or a gs:// object rewritten every few seconds (by host 0 only)
            metrics_writer = MetricsWriter(run_paths(run_dir).metrics)
        self.metrics_writer = metrics_writer
        self._closed = False
        self._packing_logged = False
        self._failures_posted = 0  # checkpoint failures in a row already posted
        log.info(
            "trainer ready: %s, mesh %s, %.2fM trainable parameters, micro-batch %s",
            getattr(objective, "name", type(objective).__name__),
            dict(self.mesh.shape),
            sum(x.size for x in jax.tree.leaves(self._params)) / 1e6,
            config.micro_batch_size or "whole batch",
        )

    # ------------------------------------------------------------------ state
    @property
    def params(self) -> nnx.State:
        """The current model parameters (sharded over the mesh; replaced at every step)."""
        return self._params[MODEL]

    @property
    def value_head(self) -> dict[str, jax.Array] | None:
        """The PPO value head's parameters, or None when the objective needs no values."""
        return self._params.get(VALUE_HEAD)

    @property
    def opt_state(self) -> Any:
        """The optax optimizer state."""
        return self._opt_state

    @property
    def rng(self) -> jax.Array:
        """The trainer's RNG key (checkpointed with the parameters)."""
        return self._rng

    def policy(self) -> Policy:
        """A Policy with the current weights on the trainer's mesh.

        Its arrays are the trainer's own: the next ``step`` donates them, so push / evaluate it
        before stepping again (or copy it). Refused (``TrainingStoppedError``) once training
        stopped: the weights may be non-finite and are never handed out."""
        if self.stopped is not None:
            raise self.stopped
        return dataclasses.replace(self._template, params=self._params[MODEL])

    # ------------------------------------------------------------------ training
    def step(
        self,
        batch: dict[str, Any],
        data_cursor: dict[str, Any] | None = None,
        extra_metrics: dict[str, float] | None = None,
    ) -> dict:
        """One optimizer update on ``batch`` (numpy arrays, BATCH_KEYS); returns its metrics.

        ``data_cursor`` is stored with the automatic checkpoint when ``checkpoint_every`` hits;
        ``extra_metrics`` (e.g. the controller's counts for the step) join the metrics row.
        """
        if self.stopped is not None:
            raise self.stopped
        arrays = self._place_batch(batch)
        # the rows the model runs on, packed or not (the train_rows and train_fill metrics)
        rows, width = arrays.get(PACKED_KEYS[0], arrays["input_ids"]).shape
        t0 = time.perf_counter()
        with jax.set_mesh(self.mesh):
            if self._ref_params is not None:
                arrays["ref_logprobs"] = self._ref_logprobs(
                    self._ref_params,
                    arrays["input_ids"],
                    arrays["attention_mask"],
                    arrays.get(SUPPORT_KEY),
                )
            self._params, self._opt_state, metrics = self._train_step(
                self._params, self._opt_state, arrays
            )
        metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
        nonfinite = int(metrics.pop(NONFINITE))
        if nonfinite:  # before anything records, checkpoints or hands out this update
            self._stop(NonFiniteError(self._nonfinite_message(nonfinite, metrics)))
        elapsed = time.perf_counter() - t0
        metrics["lr"] = float(self._schedule(self.step_count))
        self.step_count += 1
        metrics["step_time_s"] = elapsed
        metrics["tokens_per_s"] = metrics["tokens"] / elapsed
        # the rows the model ran on, and the share of their slots holding tokens (padding: 1 -)
        metrics["train_rows"] = float(rows)
        metrics["train_fill"] = metrics["tokens"] / max(1, rows * width)
        metrics["completion_tokens_per_s"] = metrics["completion_tokens"] / elapsed
        metrics["time"] = time.time()  # wall clock when the step was applied (for plots)
        metrics.update(extra_metrics or {})
        if self.metrics_writer is not None:
            self.metrics_writer.write(self.step_count, metrics)
        every = self.config.checkpoint_every
        if every and self.step_count % every == 0:
            self.save(data_cursor)
        return metrics

    def _nonfinite_message(self, code: int, metrics: dict[str, float]) -> str:
        what = [f"the {name}" for name, bit in NONFINITE_BITS.items() if code & bit]
        what_text = " and ".join(what) if len(what) < 3 else f"{what[0]}, {what[1]} and {what[2]}"
        values = ", ".join(f"{k}={metrics[k]}" for k in ("loss", "grad_norm") if k in metrics)
        lr = float(self._schedule(self.step_count))
        return (
            f"training step {self.step_count + 1} made {what_text} non-finite ({values}): "
            f"training stopped before that update was checkpointed or pushed. "
            f"{self._resume_hint()} Lower trainer.learning_rate (now {lr:g}) and run the same "
            "command again to resume"
        )

    def _resume_hint(self) -> str:
        directory = self.checkpointer.directory
        if self.saved_step:
            return f"The last good checkpoint, step {self.saved_step} under {directory}, is intact."
        return f"There is no checkpoint under {directory} yet: a resume starts from the base model."

    def _stop(self, error: TrainingStoppedError) -> None:
        """Stops training for good: a "fatal" notice, then the error raised (or, outside the
        main thread, the process ended with ``EXIT_DO_NOT_RESTART``)."""
        self.stopped = error
        if jax.process_index() == 0:
            notices.post(self.run_dir, "fatal", str(error), source="trainer")  # (also logged)
        else:
            log.error("%s", error)
        exit_now = self.exit_on_stop
        if exit_now is None:
            exit_now = threading.current_thread() is not threading.main_thread()
        if exit_now:
            self._exit()
        raise error

    def _exit(self) -> None:
        """Ends the process with ``EXIT_DO_NOT_RESTART`` once the checkpoint under way (a good
        one) is written and the logs are flushed."""
        try:
            if jax.process_count() == 1:  # (other hosts would wait for this one in Orbax)
                self.close()
            elif self.metrics_writer is not None:
                self.metrics_writer.close()
        except Exception as e:  # noqa: BLE001 - exiting anyway: the reason is already posted
            log.warning("closing the trainer before exiting: %s", e)
        for handler in logging.getLogger().handlers:
            handler.flush()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_DO_NOT_RESTART)

    def _place_batch(self, batch: dict[str, Any]) -> dict[str, jax.Array]:
        """Validates the numpy batch and places it on the mesh, batch axis over (data, fsdp)."""
        vocab = self._template.config.vocab_size
        ids = checked_ids(batch, vocab)
        c = self._template.config
        experts = (c.num_hidden_layers, c.num_experts, c.num_experts_per_tok) if c.is_moe else None
        host = host_batch(batch, ids, vocab, self._padded_width(ids.shape[1]), experts)
        b = ids.shape[0]
        mb = self.config.micro_batch_size
        if mb is not None and b % mb:
            raise BatchFormatError(
                f"batch size {b} is not a multiple of micro_batch_size={mb}: change the batch "
                "size or micro_batch_size"
            )
        if self.config.pack_sequences:
            host.update(self._packed_rows(host["input_ids"], host["attention_mask"]))
        mesh_shape = dict(self.mesh.shape)
        out = {}
        for key, x in host.items():
            spec = fit_spec(x.shape, (BATCH,) + (None,) * (x.ndim - 1), mesh_shape)
            out[key] = place_global(x, NamedSharding(self.mesh, spec))
        return out

    def _packed_rows(self, ids: np.ndarray, attn: np.ndarray) -> dict[str, np.ndarray]:
        """The padded batch's sequences packed into fewer rows (``PACKED_KEYS``); {} when
        packing saves nothing."""
        b, width = ids.shape
        n_micro = b // (self.config.micro_batch_size or b)
        dp = math.prod(dict(self.mesh.shape).get(axis, 1) for axis in BATCH)
        packed_width = row_width(width)
        multiple = row_multiple(b, width, packed_width, n_micro * dp)
        packed = pack_batch(ids, attn, packed_width, multiple)
        if packed is None:
            return {}
        if not self._packing_logged:
            self._packing_logged = True
            log.info(
                "packing sequences (trainer.pack_sequences): %d rows of %d -> %d rows of %d, "
                "%.0f%% of the slots hold tokens",
                b,
                width,
                *packed.input_ids.shape,
                100 * attn.sum() / packed.input_ids.size,
            )
        values = (packed.input_ids, packed.segment_ids, packed.token_index)
        return dict(zip(PACKED_KEYS, values, strict=True))

    def _padded_width(self, width: int) -> int:
        """The bucketed width [B, T] token arrays are padded to (``config.length_bucket``)."""
        bucket = self.config.length_bucket
        if not bucket or not self._width_free:
            return width
        return bucketed_width(width, bucket)

    # ------------------------------------------------------------------ checkpoints
    def _state(self) -> dict[str, Any]:
        return {
            "params": self._params,
            "opt_state": self._opt_state,
            "rng": place_global(jax.random.key_data(self._rng), self._replicated),
        }

    def _state_shardings(self) -> dict[str, Any]:
        return {
            "params": self._param_shardings,
            "opt_state": self._opt_shardings,
            "rng": NamedSharding(self.mesh, jax.sharding.PartitionSpec()),
        }

    def save(self, data_cursor: dict[str, Any] | None = None) -> None:
        """Starts an async checkpoint of the current step (params, optimizer, RNG, data cursor).

        A checkpoint the storage refuses is tried again at the next interval; after
        ``MAX_FAILED_CHECKPOINTS`` in a row training stops (``CheckpointWriteError``). Once
        training stopped nothing is checkpointed."""
        if self.stopped is not None:
            log.warning("step %d is not checkpointed: training stopped", self.step_count)
            return
        meta = {
            "format": CHECKPOINT_FORMAT,
            "step": self.step_count,
            "data_cursor": data_cursor,
            "objective": getattr(self.objective, "name", None),
            "trainer_config": self.config.to_dict(),
        }
        state = self._state()
        if any(d.platform == "cpu" for d in self.mesh.devices.flat):
            # CPU device buffers are host memory that Orbax's background write may read in place
            # while the next step donates (frees) them: the save gets a private copy
            state = fresh_copy(state, self._state_shardings())
        self.checkpointer.save(self.step_count, state, meta)
        self.saved_step = self.step_count
        self._check_checkpoints()

    def _check_checkpoints(self) -> None:
        """After a save or a wait: a failed checkpoint is posted (a "warning" at first, "fatal"
        with ``CheckpointWriteError`` at the ``MAX_FAILED_CHECKPOINTS``-th in a row)."""
        ckpt = self.checkpointer
        failure = ckpt.last_failure
        if failure is None or ckpt.failures == 0:
            self._failures_posted = 0
            return
        self.saved_step = ckpt.last_good_step or 0  # what a resume would restore
        if ckpt.failures <= self._failures_posted:
            return
        self._failures_posted = ckpt.failures
        what = f"the checkpoint of step {failure.step} could not be written to {failure.path}"
        if ckpt.failures < MAX_FAILED_CHECKPOINTS:
            if jax.process_index() == 0:
                notices.post(
                    self.run_dir,
                    "warning",
                    f"{what}: {failure.error} ({ckpt.failures} in a row; training goes on and "
                    f"tries again at the next checkpoint, it stops after "
                    f"{MAX_FAILED_CHECKPOINTS})",
                    source="trainer",
                )
            return
        self._stop(
            CheckpointWriteError(
                f"{what}: {failure.error} ({ckpt.failures} checkpoints in a row failed): "
                f"training stopped. {self._resume_hint()} Free space on (or fix the "
                f"permissions of) {ckpt.directory} and run the same command again to resume"
            )
        )

    def restore_latest(self) -> RestoredCheckpoint | None:
        """Loads the newest COMPLETE, intact checkpoint into the trainer; None when there is
        none. Damaged newer ones are set aside (renamed) with a "fallback" notice."""
        state = self._state()
        shardings = self._state_shardings()
        abstract = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings
        )
        found = self.checkpointer.restore_latest(abstract)
        self._post_set_aside(None if found is None else found[0])
        if found is None:
            log.info("no complete checkpoint under %s: starting fresh", self.checkpointer.directory)
            return None
        step, restored, meta = found
        if meta.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(
                f"checkpoint {step} has format {meta.get('format')!r}, expected {CHECKPOINT_FORMAT}"
            )
        self._params = restored["params"]
        self._opt_state = restored["opt_state"]
        self._rng = jax.random.wrap_key_data(jnp.asarray(restored["rng"]))
        self.step_count = self.saved_step = int(meta["step"])
        log.info("restored step %d from %s", step, self.checkpointer.directory)
        return RestoredCheckpoint(step=self.step_count, data_cursor=meta.get("data_cursor"))

    def _post_set_aside(self, restored: int | None) -> None:
        """One "fallback" notice for the damaged checkpoints set aside so far (if any)."""
        damaged, self.checkpointer.set_aside = self.checkpointer.set_aside, []
        if not damaged or jax.process_index() != 0:
            return
        what = "; ".join(f"checkpoint {d.step} {d.reason}: set aside as {d.path}" for d in damaged)
        then = (
            f"restored the newest intact one, step {restored} (the steps after it are given "
            "to the trainer again)"
            if restored is not None
            else "no intact checkpoint is left: the trainer starts from the base model and is "
            "given every step again"
        )
        notices.post(self.run_dir, "fallback", f"{what}; {then}", source="trainer")

    def wait_for_checkpoint(self) -> None:
        """Blocks until the last async save is committed (or failed: see ``save``)."""
        self.checkpointer.wait()
        self._check_checkpoints()

    def close(self) -> None:
        """Finishes pending checkpoint writes and the metrics file (on gs://: its last rows).
        A last checkpoint that could not be written is posted as a warning, not raised: the
        process is ending and a resume restores the one before."""
        if self._closed:
            return
        self._closed = True
        self.checkpointer.close()
        failure = self.checkpointer.last_failure
        new_failure = failure is not None and self.checkpointer.failures > self._failures_posted
        if new_failure and self.stopped is None and jax.process_index() == 0:
            notices.post(
                self.run_dir,
                "warning",
                f"the checkpoint of step {failure.step} could not be written to {failure.path}: "
                f"{failure.error}; a resume restores step {self.checkpointer.last_good_step or 0} "
                "and replays the steps after it",
                source="trainer",
            )
        if self.metrics_writer is not None:
            self.metrics_writer.close()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def bucketed_width(width: int, bucket: int) -> int:
    """``width`` rounded up to a power of two up to ``bucket``; above it, to a multiple of an
    eighth of the power of two below it (129..144 -> 144, 300 -> 320, 1100 -> 1152): about
    log2(bucket) + 8 shapes (compilations) per doubling, wasting at most half of a small batch
    and an eighth of a long one (multiples of ``bucket`` could double a step's work)."""
    if width <= bucket:
        return max(1, 1 << (width - 1).bit_length())
    step = max(1, (1 << ((width - 1).bit_length() - 1)) // 8)
    return -(-width // step) * step
