"""The supervised warm-up: next-token cross-entropy on the answers of generated problems.

Deterministic by the recipe's seeds: the problem pool, the batch order and the initial weights
all derive from them. One jitted AdamW step over fixed-shape batches (one compilation).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from rlax_tasks.models import ModelConfig, Policy, forward
from rlax_tasks.models.policy import abstract_model
from rlax_tasks.models.transformer import Transformer
from rlax_tasks.rewards.tasks import Problem
from rlax_tasks.utils.progress_meter import ProgressMeter
from rlax_tasks.warmup.recipe import WarmupRecipe
from rlax_tasks.warmup.tool_transcripts import encode_transcripts

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class WarmupStats:
    """What a warm-up run did: steps, final loss, seconds, problems in its pool."""

    steps: int
    final_loss: float
    seconds: float
    num_train_problems: int


def training_problems(recipe: WarmupRecipe) -> list[Problem]:
    """The warm-up pool: the data_seed stream minus every expression of the held-out stream."""
    fmt = recipe.task_format()
    pool = fmt.problems(recipe.num_train_problems, seed=recipe.data_seed)
    if recipe.heldout_seed is None or recipe.heldout_size == 0:
        return pool
    held = {p.prompt for p in fmt.problems(recipe.heldout_size, seed=recipe.heldout_seed)}
    kept = [p for p in pool if p.prompt not in held]
    if not kept:
        raise ValueError(
            "every warm-up problem is in the held-out set: raise num_train_problems or the "
            "task's difficulty"
        )
    return kept


def encode_pool(
    recipe: WarmupRecipe, problems: list[Problem], tokenizer: Any
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids, attention_mask, target_mask) [N, T] int32, right-padded to the recipe's max length;
    the target mask is 1 on the tokens the model writes."""
    width = recipe.max_tokens()
    if recipe.format == "tool-chat":
        return encode_transcripts(problems, tokenizer, recipe.tool_fraction, recipe.seed, width)
    fmt = recipe.task_format()
    n = len(problems)
    ids = np.full((n, width), tokenizer.pad_token_id, np.int32)
    attn = np.zeros((n, width), np.int32)
    target = np.zeros((n, width), np.int32)
    # one batched tokenizer call per side (per-problem calls dominate the warm-up's set-up)
    prompts = tokenizer([fmt.prompt_text(p) for p in problems], add_special_tokens=False)
    answers = tokenizer([fmt.answer_text(p) for p in problems], add_special_tokens=False)
    for i, (prompt, answer) in enumerate(
        zip(prompts["input_ids"], answers["input_ids"], strict=True)
    ):
        seq = [*prompt, *answer, tokenizer.eos_token_id]
        if len(seq) > width:
            raise AssertionError(f"{problems[i].prompt}{problems[i].reference} exceeds {width}")
        ids[i, : len(seq)] = seq
        attn[i, : len(seq)] = 1
        target[i, len(prompt) : len(seq)] = 1
    return ids, attn, target


def answer_distribution(tokenizer: Any, vocab_size: int) -> np.ndarray:
    """Uniform distribution [V] over the tokens an answer is made of: digits, '-' and <eos>."""
    dist = np.zeros(vocab_size, np.float32)
    ids = tokenizer("0123456789-", add_special_tokens=False)["input_ids"]
    dist[[*ids, tokenizer.eos_token_id]] = 1.0
    return dist / dist.sum()


def _make_step(
    graphdef: nnx.GraphDef,
    optimizer: optax.GradientTransformation,
    label_smoothing: float,
    smoothing_dist: np.ndarray,
) -> Callable[..., tuple[nnx.State, Any, jax.Array]]:
    """The jitted AdamW step on the answer tokens' cross-entropy against the smoothed target
    (1 - eps) * onehot + eps * uniform(answer tokens)."""
    eps = float(label_smoothing)
    smooth = jnp.asarray(smoothing_dist)

    def loss_fn(params: nnx.State, ids: jax.Array, attn: jax.Array, target: jax.Array):
        logits = forward.logits(graphdef, params, ids, attn)[:, :-1]  # predicts ids[:, 1:]
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        token = jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]
        per_position = (1.0 - eps) * token + eps * jnp.einsum("btv,v->bt", logp, smooth)
        weights = target[:, 1:].astype(jnp.float32)
        return -jnp.sum(per_position * weights) / jnp.maximum(jnp.sum(weights), 1.0)

    def step(params: nnx.State, opt_state: Any, ids: jax.Array, attn: jax.Array, target):
        loss, grads = jax.value_and_grad(loss_fn)(params, ids, attn, target)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))


def make_warmup_optimizer(recipe: WarmupRecipe) -> optax.GradientTransformation:
    """AdamW with global-norm clipping, linear warm-up then cosine decay."""
    warm = min(recipe.lr_warmup_steps, recipe.steps - 1)
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=recipe.learning_rate,
        warmup_steps=warm,
        decay_steps=max(recipe.steps, warm + 1),
        end_value=recipe.learning_rate * recipe.final_lr_ratio,
    )
    return optax.chain(
        optax.clip_by_global_norm(recipe.max_grad_norm),
        optax.adamw(schedule, b1=0.9, b2=0.98, weight_decay=recipe.weight_decay),
    )


@functools.lru_cache(maxsize=4)
def _compiled_init(config: ModelConfig, seed: int) -> Callable[[], nnx.State]:
    """The jitted initializers, kept: building the same model again does not compile again."""
    return jax.jit(lambda: nnx.split(Transformer(config, "float32", nnx.Rngs(seed)), nnx.Param)[1])


@functools.lru_cache(maxsize=4)
def _compiled_step(recipe: WarmupRecipe, graphdef: nnx.GraphDef) -> Callable[..., Any]:
    """The recipe's jitted step, kept: a rebuild of the same recipe (after a crash, in tests)
    does not compile it again."""
    return _make_step(
        graphdef,
        make_warmup_optimizer(recipe),
        recipe.label_smoothing,
        answer_distribution(recipe.tokenizer(), recipe.model_config().vocab_size),
    )


def init_policy(recipe: WarmupRecipe, tokenizer: Any) -> Policy:
    """The untrained model: ``Policy.init``'s initializers, run as one jitted program (faster
    than eager init on CPU, where each of the many small init ops would dispatch on its own)."""
    config = recipe.model_config()
    graphdef, _ = abstract_model(config, "float32")
    params = _compiled_init(config, recipe.seed)()
    return Policy(config, graphdef, params, dtype="float32", tokenizer=tokenizer)


def train_base_policy(
    recipe: WarmupRecipe,
    *,
    log_every_s: float | None = None,
    on_step: Callable[[int, float], None] | None = None,
) -> tuple[Policy, WarmupStats]:
    """Initializes the tiny model and trains it supervised; returns the policy and what it did.

    ``on_step(step, loss)`` is called after every step (progress hooks, tests). A status line
    (steps, rate, ETA, mean loss since the previous line) is logged every ``log_every_s``
    seconds (None: ``rlax_tasks.utils.progress_meter``'s default)."""
    t0 = time.perf_counter()
    tokenizer = recipe.tokenizer()
    policy = init_policy(recipe, tokenizer)
    problems = training_problems(recipe)
    ids, attn, target = encode_pool(recipe, problems, tokenizer)
    optimizer = make_warmup_optimizer(recipe)
    params = policy.params  # our own buffers: the step may donate them
    opt_state = optimizer.init(params)
    step_fn = _compiled_step(recipe, policy.graphdef)
    rng = np.random.default_rng(recipe.seed)
    log.info(
        "warm-up: %.2fM-parameter qwen2, %d steps x %d problems (pool %d), lr %g",
        policy.config.num_parameters() / 1e6,
        recipe.steps,
        recipe.batch_size,
        len(problems),
        recipe.learning_rate,
    )
    order = rng.permutation(len(problems))
    cursor = 0
    meter = ProgressMeter("warm-up", recipe.steps, logger=log, unit="steps", every_s=log_every_s)
    recent_sum, recent_n = 0.0, 0  # the loss line shows the mean since the previous line
    loss_value = float("nan")
    for step in range(1, recipe.steps + 1):
        if cursor + recipe.batch_size > len(order):
            order, cursor = rng.permutation(len(problems)), 0
        rows = order[cursor : cursor + recipe.batch_size]
        cursor += recipe.batch_size
        params, opt_state, loss = step_fn(params, opt_state, ids[rows], attn[rows], target[rows])
        loss_value = float(loss)
        recent_sum, recent_n = recent_sum + loss_value, recent_n + 1
        if on_step is not None:
            on_step(step, loss_value)
        if meter.update(loss=recent_sum / recent_n):
            recent_sum, recent_n = 0.0, 0
    meter.finish(loss=recent_sum / recent_n if recent_n else loss_value)
    stats = WarmupStats(
        steps=recipe.steps,
        final_loss=loss_value,
        seconds=time.perf_counter() - t0,
        num_train_problems=len(problems),
    )
    return policy.with_params(params), stats
