"""The Optax optimizer of the trainer: AdamW with global-norm clipping and warm-up + cosine."""

from __future__ import annotations

from typing import Any

import jax
import optax

from rlax_tasks.trainer.config import TrainerConfig


def learning_rate_schedule(config: TrainerConfig) -> optax.Schedule:
    """Linear warm-up from 0 to ``learning_rate``, then cosine decay to the final ratio."""
    peak = config.learning_rate
    if config.total_steps is None:
        if config.warmup_steps == 0:
            return optax.constant_schedule(peak)
        return optax.join_schedules(
            [optax.linear_schedule(0.0, peak, config.warmup_steps), optax.constant_schedule(peak)],
            [config.warmup_steps],
        )
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=peak,
        warmup_steps=config.warmup_steps,
        decay_steps=config.total_steps,
        end_value=peak * config.final_lr_ratio,
    )


# parameter leaves that get weight decay: matrices and embeddings (not norms, biases, scalars)
DECAYED_LEAVES = ("kernel", "embedding")


def weight_decay_mask(params: Any) -> Any:
    """True for weight matrices / embeddings, False for norm scales and biases."""

    def decayed(path: tuple[Any, ...], _: Any) -> bool:
        names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
        names = [n for n in names if n not in (None, "value")]
        return bool(names) and names[-1] in DECAYED_LEAVES

    return jax.tree_util.tree_map_with_path(decayed, params)


def make_optimizer(config: TrainerConfig) -> optax.GradientTransformation:
    """clip_by_global_norm (when set), then AdamW (decay on matrices only) on the schedule."""
    adamw = optax.adamw(
        learning_rate=learning_rate_schedule(config),
        b1=config.adam_b1,
        b2=config.adam_b2,
        eps=config.adam_eps,
        weight_decay=config.weight_decay,
        mask=weight_decay_mask,
    )
    if config.max_grad_norm is None:
        return adamw
    return optax.chain(optax.clip_by_global_norm(config.max_grad_norm), adamw)
