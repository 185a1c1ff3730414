"""Trainer configuration: one validated, frozen dataclass; every error names the bad field."""

from __future__ import annotations

import dataclasses
from typing import Any

from rlax_tasks.utils.validation import (
    check_bool,
    check_choice,
    check_int,
    check_known,
    check_mesh_shape,
    check_number,
    check_text,
    field_error,
)

REMAT_CHOICES = ("none", "full", "dots")
ROUTING_REPLAY_CHOICES = ("off", "replay")


class TrainerConfigError(ValueError):
    """A trainer setting is invalid; the message names the field and what to do."""


# trainer.keep_logits_mb when unset, on a CPU
KEEP_LOGITS_MB_ON_CPU = 1024


def keep_logits_mb(setting: int | None, platform: str) -> int:
    """The MiB of logits a trainer on ``platform`` keeps for its backward (TrainerConfig)."""
    if setting is not None:
        return setting
    return KEEP_LOGITS_MB_ON_CPU if platform == "cpu" else 0


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    """Optimizer, batching, sharding and checkpointing settings of the trainer.

    The learning rate warms up linearly from 0 over ``warmup_steps`` and then follows a cosine
    from ``learning_rate`` down to ``learning_rate * final_lr_ratio`` at ``total_steps``
    (``total_steps=None``: constant after warm-up)."""

    # AdamW
    learning_rate: float = 1e-6
    adam_b1: float = 0.9
    adam_b2: float = 0.999
    adam_eps: float = 1e-8
    weight_decay: float = 0.0
    # global-norm gradient clipping; None disables it
    max_grad_norm: float | None = 1.0
    warmup_steps: int = 0
    total_steps: int | None = None
    final_lr_ratio: float = 0.0
    # sequences per micro-batch (gradient accumulation); None = the whole batch at once
    micro_batch_size: int | None = None
    remat: str = "none"
    # token arrays are right-padded to a bucketed width so the jitted step compiles once per
    # bucket, not once per batch width: the next power of two up to length_bucket, then the next
    # multiple of an eighth of the power of two below the width (at most 12.5% padding; see
    # trainer.bucketed_width); 0 = no padding (every new width compiles again)
    length_bucket: int = 128
    logprob_chunk_size: int = 128
    # a micro-batch's float32 logits (rows x tokens x vocabulary x 4 bytes) up to this many MiB
    # are kept from the forward pass for the backward instead of recomputed there: one
    # vocabulary projection less per step (18% of the 30M benchmark model's step on CPU) for
    # that much memory; larger batches recompute them chunk by chunk (0: always recompute).
    # None: KEEP_LOGITS_MB_ON_CPU on a CPU, 0 on accelerators (their memory is the scarcer;
    # unmeasured there)
    keep_logits_mb: int | None = None
    # lay the batch's sequences end to end in fewer, fuller rows (each its own attention
    # segment; trainer.packing) when that saves work: the step's follows the tokens, not B x T
    pack_sequences: bool = True
    # (data, fsdp, tensor); one entry may be -1 for "the remaining devices"
    mesh_shape: tuple[int, int, int] = (1, -1, 1)
    # processes (hosts) of the trainer: > 1 is one jax.distributed group over every host's
    # devices (docs/design.md §10); the mesh spans all of them
    hosts: int = 1
    seed: int = 0
    # where checkpoints go; None = <run_dir>/checkpoints (a local path or gs://bucket/prefix)
    checkpoint_dir: str | None = None
    # save automatically every N steps inside Trainer.step (0 = only on explicit save()); the
    # trainer service (rlax run, the DAG) checkpoints every max(1, N) steps, and a restarted
    # trainer gets the steps since its checkpoint again from the controller (rollouts/)
    checkpoint_every: int = 0
    max_to_keep: int | None = 3
    async_checkpointing: bool = True
    # PPO: weight of the value-head loss added to the policy loss
    value_loss_coef: float = 0.5
    # a mixture-of-experts model (docs/design.md §14): "replay" routes each generated token
    # through the experts the sampler chose (recorded with the rollout); "off": the trainer
    # routes every token itself (the route mismatch is still measured)
    routing_replay: str = "replay"
    # weight of the load-balancing auxiliary loss (off by default, as in peers' RL recipes)
    router_aux_loss_coef: float = 0.0

    def __post_init__(self) -> None:
        e = _error
        check_number("learning_rate", self.learning_rate, e, low=0.0)
        check_number("adam_eps", self.adam_eps, e, low=0.0, open_low=True)
        for name in ("adam_b1", "adam_b2"):
            check_number(name, getattr(self, name), e, low=0.0, high=1.0, open_high=True)
        check_number("weight_decay", self.weight_decay, e, low=0.0)
        if self.max_grad_norm is not None:
            check_number("max_grad_norm", self.max_grad_norm, e, low=0.0, open_low=True)
        check_int("warmup_steps", self.warmup_steps, e, minimum=0)
        check_int("total_steps", self.total_steps, e, minimum=0, optional=True)
        if self.total_steps is not None and self.total_steps <= self.warmup_steps:
            raise TrainerConfigError(
                f"total_steps={self.total_steps} must exceed warmup_steps="
                f"{self.warmup_steps} (or be null for a constant rate after warm-up)"
            )
        check_number("final_lr_ratio", self.final_lr_ratio, e, low=0.0, high=1.0)
        check_int("micro_batch_size", self.micro_batch_size, e, minimum=1, optional=True)
        check_choice("remat", self.remat, REMAT_CHOICES, e)
        check_choice("routing_replay", self.routing_replay, ROUTING_REPLAY_CHOICES, e)
        check_number("router_aux_loss_coef", self.router_aux_loss_coef, e, low=0.0)
        check_int("logprob_chunk_size", self.logprob_chunk_size, e, minimum=1)
        check_int("keep_logits_mb", self.keep_logits_mb, e, minimum=0, optional=True)
        check_int("length_bucket", self.length_bucket, e, minimum=0)
        check_bool("pack_sequences", self.pack_sequences, e)
        object.__setattr__(self, "mesh_shape", check_mesh_shape("mesh_shape", self.mesh_shape, e))
        check_int("hosts", self.hosts, e, minimum=1)
        check_int("seed", self.seed, e)
        if self.checkpoint_dir is not None:
            check_text("checkpoint_dir", self.checkpoint_dir, e)
        check_int("checkpoint_every", self.checkpoint_every, e, minimum=0)
        check_int("max_to_keep", self.max_to_keep, e, minimum=1, optional=True)
        check_bool("async_checkpointing", self.async_checkpointing, e)
        check_number("value_loss_coef", self.value_loss_coef, e, low=0.0)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainerConfig:
        """Builds the config from a plain dict (YAML/JSON); an unknown key is an error."""
        known = [f.name for f in dataclasses.fields(cls)]
        check_known(values, known, field_error(TrainerConfigError, ": "), "trainer setting")
        values = dict(values)
        if isinstance(values.get("mesh_shape"), list):
            values["mesh_shape"] = tuple(values["mesh_shape"])
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """The settings as a JSON-friendly dict (inverse of ``from_dict``)."""
        d = dataclasses.asdict(self)
        d["mesh_shape"] = list(self.mesh_shape)
        return d


_error = field_error(TrainerConfigError)
