"""Trainer configuration: one validated, frozen dataclass; every error names the bad field."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

REMAT_CHOICES = ("none", "full", "dots")


class TrainerConfigError(ValueError):
    """A trainer setting is invalid; the message names the field and what to do."""


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    """Optimizer, batching, sharding and checkpointing settings of the trainer.

    The learning rate warms up linearly from 0 over ``warmup_steps`` and then follows a cosine
    from ``learning_rate`` down to ``learning_rate * final_lr_ratio`` at ``total_steps``
    (``total_steps=None``: constant after warm-up).
    """

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
    # multiple of it; 0 = no padding (every new width compiles again)
    length_bucket: int = 128
    logprob_chunk_size: int = 128
    # (data, fsdp, tensor); one entry may be -1 for "the remaining devices"
    mesh_shape: tuple[int, int, int] = (1, -1, 1)
    # processes (hosts) of the trainer: > 1 is one jax.distributed group over every host's
    # devices (DESIGN §10); the mesh spans all of them
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

    def __post_init__(self) -> None:
        _positive_float(self, "learning_rate", allow_zero=True)
        for name in ("adam_b1", "adam_b2"):
            v = getattr(self, name)
            if not _is_number(v) or not 0.0 <= v < 1.0:
                raise TrainerConfigError(f"{name} must be in [0, 1), got {v!r}")
        _positive_float(self, "adam_eps")
        _positive_float(self, "weight_decay", allow_zero=True)
        if self.max_grad_norm is not None:
            _positive_float(self, "max_grad_norm")
        _non_negative_int(self, "warmup_steps")
        if self.total_steps is not None:
            _non_negative_int(self, "total_steps")
            if self.total_steps <= self.warmup_steps:
                raise TrainerConfigError(
                    f"total_steps={self.total_steps} must exceed warmup_steps="
                    f"{self.warmup_steps} (or be null for a constant rate after warm-up)"
                )
        if not _is_number(self.final_lr_ratio) or not 0.0 <= self.final_lr_ratio <= 1.0:
            raise TrainerConfigError(
                f"final_lr_ratio must be in [0, 1], got {self.final_lr_ratio!r}"
            )
        if self.micro_batch_size is not None:
            _non_negative_int(self, "micro_batch_size", positive=True)
        if self.remat not in REMAT_CHOICES:
            raise TrainerConfigError(f"remat={self.remat!r} is not one of {list(REMAT_CHOICES)}")
        _non_negative_int(self, "logprob_chunk_size", positive=True)
        _non_negative_int(self, "length_bucket")
        shape = tuple(self.mesh_shape) if isinstance(self.mesh_shape, list | tuple) else None
        if (
            shape is None
            or len(shape) != 3
            or not all(isinstance(s, int) and not isinstance(s, bool) for s in shape)
            or any(s == 0 or s < -1 for s in shape)
            or shape.count(-1) > 1
        ):
            raise TrainerConfigError(
                f"mesh_shape must be three positive integers (data, fsdp, tensor), at most one "
                f"of them -1 for 'the remaining devices'; got {self.mesh_shape!r}"
            )
        object.__setattr__(self, "mesh_shape", shape)
        _non_negative_int(self, "hosts", positive=True)
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise TrainerConfigError(f"seed must be an integer, got {self.seed!r}")
        if self.checkpoint_dir is not None and (
            not isinstance(self.checkpoint_dir, str) or not self.checkpoint_dir
        ):
            raise TrainerConfigError(
                f"checkpoint_dir must be a non-empty path or gs:// URI, got {self.checkpoint_dir!r}"
            )
        _non_negative_int(self, "checkpoint_every")
        if self.max_to_keep is not None:
            _non_negative_int(self, "max_to_keep", positive=True)
        if not isinstance(self.async_checkpointing, bool):
            raise TrainerConfigError(
                f"async_checkpointing must be true or false, got {self.async_checkpointing!r}"
            )
        _positive_float(self, "value_loss_coef", allow_zero=True)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainerConfig:
        """Builds the config from a plain dict (YAML/JSON); an unknown key is an error."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise TrainerConfigError(
                f"unknown trainer setting(s) {unknown}; known settings: {sorted(known)}"
            )
        values = dict(values)
        if isinstance(values.get("mesh_shape"), list):
            values["mesh_shape"] = tuple(values["mesh_shape"])
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """The settings as a JSON-friendly dict (inverse of ``from_dict``)."""
        d = dataclasses.asdict(self)
        d["mesh_shape"] = list(self.mesh_shape)
        return d


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _positive_float(cfg: TrainerConfig, name: str, allow_zero: bool = False) -> None:
    v = getattr(cfg, name)
    if not _is_number(v) or v < 0 or (v == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise TrainerConfigError(f"{name} must be a finite number {bound}, got {v!r}")


def _non_negative_int(cfg: TrainerConfig, name: str, positive: bool = False) -> None:
    v = getattr(cfg, name)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0 or (positive and v == 0):
        bound = "positive" if positive else "non-negative"
        raise TrainerConfigError(f"{name} must be a {bound} integer, got {v!r}")
