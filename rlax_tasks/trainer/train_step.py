"""The pure, jittable train step: a no-gradient prefill gives the old-policy log-probs
(docs/design.md §5); the objective on the whole batch gives their cotangent ``g``; the backward of
``sum(g * logp(params))`` per micro-batch (``lax.scan``) accumulates the exact full-batch
gradient; then clip + AdamW on donated buffers, and one ``NONFINITE`` flag so that the trainer
never keeps a NaN or infinite update. Packed rows (``PACKED_KEYS``) are gathered back to [B, T]."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from rlax_tasks.algorithms.masked import masked_mean, masked_quantile
from rlax_tasks.models import forward
from rlax_tasks.models.logprob_options import DEFAULT_LOGPROBS, LogProbOptions
from rlax_tasks.models.moe import RouteStats, load_balancing_loss
from rlax_tasks.models.sharding import BATCH, constrain

# keys of the batch the train step reads ([B, T] unless noted)
BATCH_KEYS = (
    "input_ids",
    "attention_mask",
    "completion_mask",
    "behavior_logprobs",
    "rewards",  # [B]
    "group_ids",  # [B]
)
# optional: the batch's sequences packed into fewer rows (``packing.PackedBatch``): ids and
# segment ids [R, L] (L >= T), token_index [B, T] into the flattened [R * L] outputs (R * L: 0)
PACKED_KEYS = ("packed_input_ids", "packed_segment_ids", "packed_token_index")
# optional [B, T, R] int: the ids the sampler's top-k/top-p kept for token t (-1 padded; a token
# without any keeps the whole vocabulary): old and current log-probs are renormalised over them
SUPPORT_KEY = "support_ids"
# optional [B, T, L, k] int: a mixture-of-experts model's experts the sampler routed each
# generated token to, per layer (-1 elsewhere: the trainer routes those tokens); replayed by the
# trainer's log-probs and loss when StepSettings.routing_replay (docs/design.md §14)
ROUTES_KEY = "routed_experts"
VALUE_HEAD = "value_head"
MODEL = "model"
# the step's non-finite check, a bit per quantity (0: all finite); the trainer pops it from the
# metrics and stops before the update is checkpointed or pushed when it is not 0
NONFINITE = "nonfinite"
NONFINITE_BITS = {"loss": 1, "gradient norm": 2, "updated weights": 4}

Params = dict[str, Any]  # {"model": nnx.State, optionally "value_head": {"kernel", "bias"}}


@dataclasses.dataclass(frozen=True)
class StepSettings:
    """The static (compile-time) settings of the train step."""

    micro_batch_size: int | None
    # how log-probs (old, current, reference) and entropy are computed: chunk size, remat,
    # logits kept for the backward, the rollouts' sampling temperature (those of the
    # distribution the sampler drew from) and, for a mixture-of-experts model, whether tokens
    # with recorded experts (ROUTES_KEY) go through them (else the trainer's own routes,
    # compared with the record for the metrics)
    logprobs: LogProbOptions = DEFAULT_LOGPROBS
    value_loss_coef: float = 0.5
    # a batch of one micro-batch runs forward once (the old log-probs and the backward share
    # it); False: a separate prefill first, as with micro-batches (see Trainer for when)
    one_forward_pass: bool = True
    # weight of the load-balancing loss (moe.load_balancing_loss) added to the loss; 0: none
    router_aux_loss_coef: float = 0.0


def init_value_head(hidden_size: int, dtype: Any = jnp.float32) -> dict[str, jax.Array]:
    """A zero-initialised linear value head on the final hidden state (V = h·kernel + bias)."""
    return {"kernel": jnp.zeros((hidden_size,), dtype), "bias": jnp.zeros((), dtype)}


def policy_outputs(
    graphdef: nnx.GraphDef,
    params: Params,
    input_ids: jax.Array,
    attention_mask: jax.Array | None,
    options: LogProbOptions = DEFAULT_LOGPROBS,
    *,
    with_entropy: bool = False,
    segment_ids: jax.Array | None = None,
    support: jax.Array | None = None,
    routes: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None, jax.Array | None, RouteStats | None]:
    """(log-probs, entropy or None, values or None), each [B, T] aligned like token_logprobs,
    and a mixture-of-experts model's ``moe.RouteStats`` (None for a dense one); ``options``,
    ``segment_ids``, ``support`` and ``routes`` as ``forward.token_logprobs`` takes them.

    ``values[b, t]`` is the value head on the hidden state at t-1 (the state before token t).
    """
    lp, ent, hidden, stats = forward.logprobs_and_hidden(
        graphdef, params[MODEL], input_ids, attention_mask, options,
        segment_ids=segment_ids, support=support, routes=routes,
    )  # fmt: skip
    values = None
    if VALUE_HEAD in params:
        head = params[VALUE_HEAD]
        values = hidden[:, :-1].astype(jnp.float32) @ head["kernel"].astype(jnp.float32)
        values = values + head["bias"].astype(jnp.float32)
        values = jnp.concatenate([jnp.zeros_like(values[:, :1]), values], 1)
    return lp, (ent if with_entropy else None), values, stats


def _split_micro(x: jax.Array, n_micro: int) -> jax.Array:
    """[B, ...] -> [n_micro, B / n_micro, ...], micro-batch i = rows i, i + n, i + 2n, ...

    Strided (not contiguous) so each device's block of the sharded batch holds rows of every
    micro-batch: every micro-batch stays spread over all data-parallel devices.
    """
    b = x.shape[0]
    x = x.reshape(b // n_micro, n_micro, *x.shape[1:]).swapaxes(0, 1)
    return constrain(x, None, BATCH, *([None] * (x.ndim - 2)))


def _join_micro(x: jax.Array) -> jax.Array:
    """Inverse of ``_split_micro``."""
    n, m = x.shape[:2]
    return constrain(x.swapaxes(0, 1).reshape(n * m, *x.shape[2:]), BATCH, None)


def unpack_tokens(packed: jax.Array, token_index: jax.Array) -> jax.Array:
    """Per-token outputs of packed rows [R, L] gathered into the batch layout [B, T]
    (``token_index``; its out-of-range entries, R * L, read 0)."""
    flat = jnp.concatenate([packed.reshape(-1), jnp.zeros((1,), packed.dtype)])
    return constrain(flat[token_index], BATCH, None)


def pack_tokens(x: jax.Array, token_index: jax.Array, rows: int, width: int) -> jax.Array:
    """``unpack_tokens``'s transpose: [B, T, ...] values placed at their packed positions
    [R, L, ...] (``rows``, ``width``; 0 where no token of the batch lands)."""
    trailing = x.shape[2:]
    flat = jnp.zeros((rows * width + 1, *trailing), x.dtype).at[token_index].add(x)
    packed = flat[:-1].reshape(rows, width, *trailing)
    return constrain(packed, BATCH, *([None] * (1 + len(trailing))))


def nonfinite_code(loss: jax.Array, grad_norm: jax.Array, params: Params) -> jax.Array:
    """``NONFINITE``'s bits: which of the loss, the gradient norm and the updated weights hold
    a NaN or an infinity. One fused reduction over the weights, read back as one int32."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(params)]
    weights_ok = jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)
    bits = NONFINITE_BITS
    return (
        jnp.where(jnp.isfinite(loss), 0, bits["loss"])
        + jnp.where(jnp.isfinite(grad_norm), 0, bits["gradient norm"])
        + jnp.where(weights_ok, 0, bits["updated weights"])
    ).astype(jnp.int32)


def sum_micro_stats(stats: RouteStats) -> RouteStats:
    """The micro-batches' route statistics ([n_micro, L, ...]) summed into the batch's."""
    return stats._replace(**{k: getattr(stats, k).sum(axis=0) for k in RouteStats._fields
                             if k != "experts"})  # fmt: skip


def route_metrics(stats: RouteStats) -> dict[str, jax.Array]:
    """docs/design.md §14's metrics, overall and per layer (``/layer_i``): of the tokens with a
    recorded route, the fraction computed through other experts (0 under replay) and the
    fraction whose own top-k differs from it (the sampler/trainer numerics' gap); the expert
    load's max over its mean; the router's mean entropy."""
    recorded = jnp.maximum(stats.replayed.sum(), 1.0)
    mismatch = stats.mismatch / jnp.maximum(stats.replayed, 1.0)
    load = stats.load / jnp.maximum(stats.load.mean(axis=-1, keepdims=True), 1e-9)
    imbalance = load.max(axis=-1)
    entropy = stats.entropy_sum / jnp.maximum(stats.tokens, 1.0)
    out = {
        "moe/route_mismatch_frac": stats.mismatch.sum() / recorded,
        "moe/own_route_mismatch_frac": stats.own_mismatch.sum() / recorded,
        "moe/expert_load_max_over_mean": imbalance.mean(),
        "moe/router_entropy": stats.entropy_sum.sum() / jnp.maximum(stats.tokens.sum(), 1.0),
        "moe/recorded_routes_frac": stats.replayed.sum() / jnp.maximum(stats.tokens.sum(), 1.0),
    }
    for i in range(stats.load.shape[0]):
        out[f"moe/route_mismatch_frac/layer_{i}"] = mismatch[i]
        out[f"moe/expert_load_max_over_mean/layer_{i}"] = imbalance[i]
        out[f"moe/router_entropy/layer_{i}"] = entropy[i]
    return out


def objective_batch(
    batch: dict[str, jax.Array], old_logprobs: jax.Array, old_values: jax.Array | None
) -> dict[str, jax.Array]:
    """The objective's batch (docs/design.md §4 names) from the trainer batch and the prefill
    outputs."""
    mask = batch["completion_mask"].astype(jnp.float32) * batch["attention_mask"].astype(
        jnp.float32
    )
    out = {
        "old_logprobs": old_logprobs,
        "mask": mask,
        "rewards": batch["rewards"].astype(jnp.float32),
        "group_ids": batch["group_ids"],
        "behavior_logprobs": batch["behavior_logprobs"].astype(jnp.float32),
    }
    if "ref_logprobs" in batch:
        out["ref_logprobs"] = batch["ref_logprobs"].astype(jnp.float32)
    if old_values is not None:
        out["values"] = old_values
    return out


def make_train_step(
    graphdef: nnx.GraphDef,
    objective: Any,
    optimizer: optax.GradientTransformation,
    settings: StepSettings,
) -> Callable[[Params, optax.OptState, dict[str, jax.Array]], tuple[Params, Any, dict]]:
    """The pure, unjitted train step: old log-probs, objective, gradient, update (module doc).

    Args:
        graphdef: the policy's model graph (``Policy.graphdef``).
        objective: an ``algorithms.Objective`` (``loss(logp, batch)``; ``value_loss`` when the
            params hold a value head).
        optimizer: the Optax transformation applied to the summed gradient.
        settings: the static settings (micro-batches, log-prob options, loss weights).

    Returns:
        ``train_step(params, opt_state, batch) -> (params, opt_state, metrics)``: ``params`` is
        ``{"model": ..., "value_head": ...?}``; ``batch`` holds BATCH_KEYS (+ "ref_logprobs"
        [B, T] when the objective needs a reference; optionally PACKED_KEYS, SUPPORT_KEY,
        ROUTES_KEY); ``metrics`` are scalars, with the ``NONFINITE`` flag. Jit it with
        ``donate_argnums=(0, 1)``.
    """

    def train_step(
        params: Params, opt_state: optax.OptState, batch: dict[str, jax.Array]
    ) -> tuple[Params, optax.OptState, dict[str, jax.Array]]:
        ids = batch["input_ids"].astype(jnp.int32)
        attn = batch["attention_mask"].astype(jnp.int32)
        b = ids.shape[0]
        mb = settings.micro_batch_size or b
        if b % mb:
            raise ValueError(f"batch size {b} is not a multiple of micro_batch_size={mb}")
        n_micro = b // mb
        has_values = VALUE_HEAD in params

        # the rows the model runs on: the batch's, or its sequences packed into fewer rows,
        # whose per-token outputs are gathered back to [B, T] (to_batch) for the objective
        packed = PACKED_KEYS[0] in batch
        if packed:
            rows_ids = batch["packed_input_ids"].astype(jnp.int32)
            rows_mask = batch["packed_segment_ids"].astype(jnp.int32)
            index = batch["packed_token_index"]
            n_rows, row_width = rows_ids.shape
            if n_rows % n_micro:
                raise ValueError(f"{n_rows} packed rows do not split into {n_micro} micro-batches")

            def to_batch(x: jax.Array | None) -> jax.Array | None:
                return None if x is None else unpack_tokens(x, index)

            def to_rows(x: jax.Array | None) -> jax.Array | None:
                return None if x is None else pack_tokens(x, index, n_rows, row_width)

        else:
            rows_ids, rows_mask = ids, attn

            def to_batch(x: jax.Array | None) -> jax.Array | None:
                return x

            to_rows = to_batch
        # sampling-mask replay: the ids the sampler kept per token (-1: none) and routing
        # replay: the experts it routed each token to (-1: none), laid out like the rows; the
        # micro-batches carry them beside ids and mask (None where the batch has none)
        support = routes = None
        if SUPPORT_KEY in batch:
            support = batch[SUPPORT_KEY].astype(jnp.int32)
            if packed:  # shifted by one: where no token lands reads 0, -1 after the shift back
                support = to_rows(support + 1) - 1
        if ROUTES_KEY in batch:
            routes = batch[ROUTES_KEY].astype(jnp.int32)
            if packed:
                routes = to_rows(routes + 1) - 1
        rows_xs = (rows_ids, rows_mask, support, routes)
        micro_xs = tuple(None if x is None else _split_micro(x, n_micro) for x in rows_xs)
        aux_coef = settings.router_aux_loss_coef

        def outputs(
            p: Params,
            ids: jax.Array,
            mask: jax.Array,
            kept: jax.Array | None,
            routed: jax.Array | None,
            *,
            with_entropy: bool,
        ) -> tuple:
            return policy_outputs(
                graphdef,
                p,
                ids,
                None if packed else mask,
                settings.logprobs,
                with_entropy=with_entropy,
                segment_ids=mask if packed else None,
                support=kept,
                routes=routed,
            )

        def aux_loss(stats: RouteStats | None) -> jax.Array | None:
            return None if stats is None or not aux_coef else load_balancing_loss(stats)

        # 1. the current parameters' (old policy's) log-probs, values and entropy. One
        # micro-batch: the forward pass is linearised once and serves both the old log-probs
        # and the backward (step 3), so the batch is not run forward twice.
        fused = n_micro == 1 and settings.one_forward_pass
        if fused:

            def primal(p: Params) -> tuple[tuple, tuple]:
                lp, ent, values, stats = outputs(p, *rows_xs, with_entropy=True)
                # the entropy and the routes' stats: statistics, not differentiated
                return (to_batch(lp), to_batch(values), aux_loss(stats)), (to_batch(ent), stats)

            (old, old_values, aux), backward, (entropy, route_stats) = jax.vjp(
                primal, params, has_aux=True
            )
        else:  # a prefill without gradients, micro-batch by micro-batch
            frozen = jax.lax.stop_gradient(params)
            old, entropy, old_values, route_stats = jax.lax.map(
                lambda xs: outputs(frozen, *xs, with_entropy=True),
                micro_xs,
            )
            old, entropy = to_batch(_join_micro(old)), to_batch(_join_micro(entropy))
            old_values = to_batch(_join_micro(old_values)) if has_values else None
            route_stats = None if route_stats is None else sum_micro_stats(route_stats)
            aux = aux_loss(route_stats)
        obj_batch = objective_batch(batch, old, old_values)

        # 2. the objective on the full batch and its cotangent w.r.t. log-probs / values
        def total_loss(logp: jax.Array, values: jax.Array | None) -> tuple[jax.Array, dict]:
            loss, metrics = objective.loss(logp, obj_batch)
            metrics = dict(metrics)
            if values is not None:
                value_loss = objective.value_loss(values, obj_batch)
                if isinstance(value_loss, tuple):
                    value_loss, value_metrics = value_loss
                    metrics.update({f"value/{k}": v for k, v in value_metrics.items()})
                metrics["value_loss"] = value_loss
                loss = loss + settings.value_loss_coef * value_loss
            return loss, metrics

        (loss, obj_metrics), (g_logp, g_values) = jax.value_and_grad(
            total_loss, argnums=(0, 1), has_aux=True
        )(old, old_values)

        # 3. the gradient: of sum(g * logp(params)) (+ values), through the linearised forward
        # pass, or micro-batch by micro-batch (forward again and backward), accumulated
        if fused:
            g_aux = None if aux is None else jnp.asarray(aux_coef, aux.dtype)
            (grads,) = backward((g_logp, g_values, g_aux))
        else:
            micro_g = _split_micro(to_rows(g_logp), n_micro)
            micro_gv = _split_micro(to_rows(g_values), n_micro) if has_values else micro_g

            def surrogate(p: Params, g: jax.Array, gv: jax.Array, *rows: jax.Array) -> jax.Array:
                lp, _, values, stats = outputs(p, *rows, with_entropy=False)
                s = jnp.sum(lp * g)
                if values is not None:
                    s = s + jnp.sum(values * gv)
                if aux is not None:  # each micro-batch's balance, their mean
                    s = s + aux_coef * aux_loss(stats) / n_micro
                return s

            def accumulate(acc: Params, xs: tuple) -> tuple[Params, None]:
                grads = jax.grad(surrogate)(params, *xs)
                return jax.tree.map(jnp.add, acc, grads), None

            zeros = jax.tree.map(jnp.zeros_like, params)
            grads, _ = jax.lax.scan(accumulate, zeros, (micro_g, micro_gv, *micro_xs))

        # 4. optimizer
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)

        mask = obj_batch["mask"]
        sampler_vs_trainer = jnp.where(mask > 0, old - obj_batch["behavior_logprobs"], 0.0)
        mismatch = jnp.abs(sampler_vs_trainer)
        grad_norm = optax.tree.norm(grads)
        metrics = {f"objective/{k}": v for k, v in obj_metrics.items()}
        metrics[NONFINITE] = nonfinite_code(loss, grad_norm, params)
        metrics.update(
            loss=loss,
            grad_norm=grad_norm,
            update_norm=optax.tree.norm(updates),
            param_norm=optax.tree.norm(params),
            entropy=masked_mean(entropy, mask),
            reward_mean=jnp.mean(obj_batch["rewards"]),
            reward_std=jnp.std(obj_batch["rewards"]),
            old_logprob_mean=masked_mean(old, mask),
            logprob_mismatch_p95=masked_quantile(mismatch, mask, 0.95),
            logprob_mismatch_mean=masked_mean(mismatch, mask),
            # KL(sampler ‖ trainer) over the sampled tokens, k3 estimator (never negative)
            logprob_mismatch_kl=masked_mean(
                jnp.exp(sampler_vs_trainer) - sampler_vs_trainer - 1.0, mask
            ),
            completion_tokens=jnp.sum(mask),
            tokens=jnp.sum(attn.astype(jnp.float32)),
            sequences=jnp.asarray(b, jnp.float32),
        )
        if SUPPORT_KEY in batch:  # completion tokens whose sampling support was replayed
            replayed = jnp.any(batch[SUPPORT_KEY] >= 0, axis=-1).astype(jnp.float32)
            metrics["support_replayed_frac"] = masked_mean(replayed, mask)
        if "ref_logprobs" in obj_batch:
            diff = obj_batch["ref_logprobs"] - old
            metrics["kl"] = masked_mean(jnp.exp(diff) - diff - 1.0, mask)
        if route_stats is not None:
            metrics.update(route_metrics(route_stats))
        if aux is not None:
            metrics["moe/aux_loss"] = aux
            metrics["loss"] = loss + aux_coef * aux
        return params, opt_state, metrics

    return train_step


def make_logprobs_fn(graphdef: nnx.GraphDef, settings: StepSettings) -> Callable[..., jax.Array]:
    """A pure prefill (model params, ids, mask[, support]) -> log-probs [B, T], micro-batch by
    micro-batch.

    Used for the frozen reference policy's log-probs when the objective has a KL term (at the
    sampling temperature and over the replayed support, like the policy's).
    """

    def logprobs(
        model_params: nnx.State, ids: jax.Array, attn: jax.Array, support: jax.Array | None = None
    ) -> jax.Array:
        b = ids.shape[0]
        n_micro = b // (settings.micro_batch_size or b)

        def one(xs: tuple[jax.Array, ...]) -> jax.Array:
            return forward.token_logprobs(
                graphdef, model_params, xs[0], xs[1], settings.logprobs,
                support=xs[2] if len(xs) > 2 else None,
            )  # fmt: skip

        rows = (ids, attn) if support is None else (ids, attn, support.astype(jnp.int32))
        out = jax.lax.map(one, tuple(_split_micro(x, n_micro) for x in rows))
        return _join_micro(out)

    return logprobs
