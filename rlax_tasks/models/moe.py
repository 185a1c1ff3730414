"""The mixture-of-experts MLP (qwen3_moe): a top-k softmax router and SwiGLU experts computed
dropless as grouped products over the tokens sorted by expert, never as a dense product over
every expert. ``routes`` replays recorded experts (routing replay, docs/design.md §14): those
experts' router probabilities still weight their outputs, so the router learns through them.

Under a mesh the experts run in ``shard_map``: with an ``expert`` axis each device holds
``E / expert`` experts, gathers its expert group's tokens, computes its own experts' share and
reduce-scatters the outputs back (dropless; the ``tensor`` axis splits each expert's width)."""

from __future__ import annotations

import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from rlax_tasks.models.config import ModelConfig
from rlax_tasks.models.sharding import BATCH, constrain, fit_spec

# how the grouped products are computed: "ragged" (jax.lax.ragged_dot: TPU and GPU kernels),
# "tiled" (rows in blocks of one expert each, one batched product: XLA:CPU lowers ragged_dot to
# a dense product over every group), "dense" (every expert over every token: the reference the
# benchmark compares with); RLAX_GROUPED_MATMUL forces one
GROUPED_MATMULS = ("ragged", "tiled", "dense")
GROUPED_MATMUL_ENV = "RLAX_GROUPED_MATMUL"
# the smallest row block of the tiled product (blocks grow to the mean rows per expert)
MIN_TILE_ROWS = 8


class RouteStats(NamedTuple):
    """What one MoE layer's router did over the valid tokens: ``experts`` [B, T, k] the experts
    used (int32), ``load`` [E] assignments per expert, ``prob_sum`` [E] router probability mass
    per expert, ``entropy_sum`` the router entropies' sum, ``tokens`` the valid tokens,
    ``mismatch``: tokens with a recorded route that were computed with other experts (0 under
    replay), ``own_mismatch``: those whose own top-k differs from the record (the numerics'
    gap, whether replayed or not), ``replayed``: tokens with a recorded route (float32)."""

    experts: jax.Array
    load: jax.Array
    prob_sum: jax.Array
    entropy_sum: jax.Array
    tokens: jax.Array
    mismatch: jax.Array
    own_mismatch: jax.Array
    replayed: jax.Array


def grouped_matmul_implementation() -> str:
    """The grouped product for this platform: ragged_dot on TPU and GPU, tiled on CPU."""
    forced = os.environ.get(GROUPED_MATMUL_ENV)
    if forced:
        if forced not in GROUPED_MATMULS:
            raise ValueError(f"{GROUPED_MATMUL_ENV}={forced!r} is not one of {GROUPED_MATMULS}")
        return forced
    return "tiled" if jax.default_backend() == "cpu" else "ragged"


@jax.custom_vjp
def moved_rows(
    x: jax.Array, index: jax.Array, mask: jax.Array, back: jax.Array, back_mask: jax.Array
) -> jax.Array:
    """Rows ``x[index]`` where ``mask`` (0 elsewhere), for a one-to-one map: ``back`` sends each
    row of ``x`` (where ``back_mask``) to the one output row that reads it, so the transpose is
    the gather ``g[back]``, not the scatter-add XLA:CPU runs slowly."""
    return jnp.where(mask[:, None], x[index], 0)


def _moved_rows_fwd(x, index, mask, back, back_mask):  # noqa: ANN001, ANN202
    return moved_rows(x, index, mask, back, back_mask), (back, back_mask)


def _moved_rows_bwd(res, g):  # noqa: ANN001, ANN202
    back, back_mask = res
    return jnp.where(back_mask[:, None], g[back], 0), None, None, None, None


moved_rows.defvjp(_moved_rows_fwd, _moved_rows_bwd)


@jax.custom_vjp
def repeated_rows(x: jax.Array, order: jax.Array, inverse: jax.Array, k: int) -> jax.Array:
    """``x[order // k]``: each of x's N rows k times, in the permutation ``order`` of the N·k
    (token, slot) pairs; the transpose sums each token's k rows (gathered by ``inverse``)."""
    return x[order // k]


def _repeated_rows_fwd(x, order, inverse, k):  # noqa: ANN001, ANN202
    return repeated_rows(x, order, inverse, k), (inverse, k)


def _repeated_rows_bwd(res, g):  # noqa: ANN001, ANN202
    inverse, k = res
    return g[inverse].reshape(-1, k, g.shape[-1]).sum(axis=1), None, None, None


repeated_rows.defvjp(_repeated_rows_fwd, _repeated_rows_bwd)


def _tiled_grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """rows [M, K] sorted by group, w [G, K, N] -> [M, N]: each group's rows padded to whole
    blocks of one group, the blocks multiplied by their group's weights in one batched product
    (at most M / block + G blocks). Rows past the groups' total are zero."""
    m, k = x.shape
    g, _, n = w.shape
    block = max(MIN_TILE_ROWS, 1 << max(0, -(-m // g) - 1).bit_length())
    tiles = -(-m // block) + g
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    padded = (group_sizes + block - 1) // block * block
    pad_ends = jnp.cumsum(padded)
    pad_starts = pad_ends - padded
    tile_group = jnp.clip(jnp.searchsorted(pad_ends, jnp.arange(tiles) * block, side="right"),
                          0, g - 1)  # fmt: skip
    slot = jnp.arange(tiles * block)
    group = tile_group[slot // block]
    within = slot - pad_starts[group]
    filled = (within < group_sizes[group]) & (slot < pad_ends[-1])
    source = jnp.where(filled, starts[group] + within, 0)
    row = jnp.arange(m)
    row_group = jnp.clip(jnp.searchsorted(ends, row, side="right"), 0, g - 1)
    in_group = row < ends[-1]
    position = jnp.where(in_group, pad_starts[row_group] + row - starts[row_group], 0)
    # rows into their blocks and back: one-to-one on the filled slots and the grouped rows
    xs = moved_rows(x, source, filled, position, in_group).reshape(tiles, block, k)
    ys = jnp.einsum("tbk,tkn->tbn", xs, w[tile_group], preferred_element_type=jnp.float32)
    ys = ys.astype(x.dtype).reshape(tiles * block, n)
    return moved_rows(ys, position, in_group, source, filled)


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """Rows [M, K] sorted by group times their group's w [G, K, N]: [M, N] (rows past the
    groups' total are zero), with the platform's kernel."""
    impl = grouped_matmul_implementation()
    if impl == "ragged":
        out = jax.lax.ragged_dot(x, w, group_sizes, preferred_element_type=jnp.float32)
        return jnp.where((jnp.arange(x.shape[0]) < group_sizes.sum())[:, None], out, 0).astype(
            x.dtype
        )
    if impl == "tiled":
        return _tiled_grouped_matmul(x, w, group_sizes)
    # dense: every row through every group's weights, the row's own group kept
    group = jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(x.shape[0]), side="right")
    every = jnp.einsum("mk,gkn->gmn", x, w, preferred_element_type=jnp.float32)
    picked = jnp.take_along_axis(every, jnp.clip(group, 0, w.shape[0] - 1)[None, :, None], 0)[0]
    return jnp.where((group < w.shape[0])[:, None], picked, 0).astype(x.dtype)


def expert_outputs(
    x: jax.Array,
    experts: jax.Array,
    weights: jax.Array,
    gate: jax.Array,
    up: jax.Array,
    down: jax.Array,
    first_expert: jax.Array | int = 0,
) -> jax.Array:
    """sum_j weights[n, j] * expert_{experts[n, j]}(x[n]) over the experts held here
    (``first_expert`` .. + ``gate.shape[0]``; the others contribute 0): x [N, D], experts and
    weights [N, k], gate/up [E_here, D, F], down [E_here, F, D]."""
    n, k = experts.shape
    held = gate.shape[0]
    local = experts.reshape(-1) - first_expert
    here = (local >= 0) & (local < held)
    key = jnp.where(here, local, held)  # the experts held elsewhere sort last
    order = jnp.argsort(key, stable=True)
    group_sizes = jnp.bincount(key, length=held + 1)[:held].astype(jnp.int32)
    inverse = jnp.argsort(order)
    rows = repeated_rows(x, order, inverse, k)
    h = jax.nn.silu(grouped_matmul(rows, gate, group_sizes)) * grouped_matmul(rows, up, group_sizes)
    y = grouped_matmul(h, down, group_sizes)
    y = y * jnp.where(here, weights.reshape(-1), 0).astype(y.dtype)[order][:, None]
    every = jnp.ones(order.shape, bool)
    unsorted = moved_rows(y, inverse, every, order, every)  # back to (token, slot) order
    return unsorted.reshape(n, k, -1).sum(axis=1)


def _sharded_expert_outputs(
    x: jax.Array,
    experts: jax.Array,
    weights: jax.Array,
    gate: jax.Array,
    up: jax.Array,
    down: jax.Array,
) -> jax.Array:
    """``expert_outputs`` over the active mesh: tokens stay where the batch is sharded, each
    device computes the experts it holds (``expert`` axis) over its expert group's tokens and
    its slice of their width (``tensor`` axis)."""
    mesh = jax.sharding.get_abstract_mesh()
    sizes = dict(mesh.shape)
    x_spec = fit_spec(x.shape, (BATCH, None), sizes)
    route_spec = P(x_spec[0], None)
    w_in = fit_spec(gate.shape, ("expert", None, "tensor"), sizes)
    w_out = fit_spec(down.shape, ("expert", "tensor", None), sizes)
    batch_axes = () if x_spec[0] is None else (
        (x_spec[0],) if isinstance(x_spec[0], str) else tuple(x_spec[0])
    )  # fmt: skip
    experts_split = w_in[0] is not None
    gather = experts_split and "expert" in batch_axes
    width_split = w_in[2] is not None

    def local(x, experts, weights, gate, up, down):  # noqa: ANN001, ANN202
        first = jax.lax.axis_index("expert") * gate.shape[0] if experts_split else 0
        if gather:  # the expert group's tokens, every device of it the same rows
            x, experts, weights = (
                jax.lax.all_gather(a, "expert", axis=0, tiled=True) for a in (x, experts, weights)
            )
        out = expert_outputs(x, experts, weights, gate, up, down, first)
        if width_split:
            out = jax.lax.psum(out, "tensor")
        if gather:
            return jax.lax.psum_scatter(out, "expert", scatter_dimension=0, tiled=True)
        return jax.lax.psum(out, "expert") if experts_split else out

    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(x_spec, route_spec, route_spec, w_in, w_in, w_out),
        out_specs=x_spec,
        check_vma=False,
    )(x, experts, weights, gate, up, down)


class Experts(nnx.Module):
    """The experts' SwiGLU weights, stacked: gate/up [E, D, F], down [E, F, D]."""

    def __init__(
        self, config: ModelConfig, dtype: jnp.dtype, param_dtype: jnp.dtype, rngs: nnx.Rngs
    ) -> None:
        e, d, f = config.num_experts, config.hidden_size, config.moe_intermediate_size
        init = nnx.initializers.normal(stddev=0.02)
        self.gate_proj = nnx.Param(init(rngs.params(), (e, d, f), param_dtype))
        self.up_proj = nnx.Param(init(rngs.params(), (e, d, f), param_dtype))
        self.down_proj = nnx.Param(init(rngs.params(), (e, f, d), param_dtype))


class SparseMoE(nnx.Module):
    """Router (``gate``: [D, E]) and experts of one layer, as transformers' Qwen3MoeSparseMoeBlock
    computes them: float32 softmax over the router logits, top-k, optionally renormalised, the
    weights cast to the compute dtype."""

    def __init__(
        self, config: ModelConfig, dtype: jnp.dtype, param_dtype: jnp.dtype, rngs: nnx.Rngs
    ) -> None:
        from rlax_tasks.models.transformer import Projection  # the one linear map

        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.dtype = dtype
        self.gate = Projection((config.hidden_size,), (config.num_experts,), use_bias=False,
                               dtype=dtype, param_dtype=param_dtype, rngs=rngs)  # fmt: skip
        self.experts = Experts(config, dtype, param_dtype, rngs)

    def __call__(
        self,
        x: jax.Array,
        valid: jax.Array,
        routes: jax.Array | None = None,
        replay: bool = True,
    ) -> tuple[jax.Array, RouteStats]:
        """(outputs [B, T, D], the router's stats) of hidden states [B, T, D]; ``valid`` [B, T]
        (bool, or segment ids with 0 on padding); ``routes`` [B, T, k] int: the experts recorded
        per token (-1: none), used when ``replay`` (static), else only compared with."""
        b, t, d = x.shape
        logits = self.gate(x)  # in the compute dtype, as transformers' F.linear
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        _, own = jax.lax.top_k(probs, self.top_k)
        recorded = None if routes is None else routes[..., 0] >= 0
        experts = own if routes is None or not replay else jnp.where(
            recorded[..., None], routes, own
        )  # fmt: skip
        experts = experts.astype(jnp.int32)
        weights = jnp.take_along_axis(probs, experts, axis=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(axis=-1, keepdims=True)
        weights = weights.astype(self.dtype)
        ex = self.experts
        gate, up, down = (p[...].astype(self.dtype) for p in (ex.gate_proj, ex.up_proj,
                                                              ex.down_proj))  # fmt: skip
        flat = (x.reshape(b * t, d), experts.reshape(b * t, -1), weights.reshape(b * t, -1))
        if jax.sharding.get_abstract_mesh().empty:
            out = expert_outputs(*flat, gate, up, down)
        else:
            out = _sharded_expert_outputs(*flat, gate, up, down)
        out = constrain(out.reshape(b, t, d), BATCH, None, None)
        return out, _route_stats(probs, own, experts, valid != 0, routes, recorded)


def _route_stats(
    probs: jax.Array,
    own: jax.Array,
    experts: jax.Array,
    valid: jax.Array,
    routes: jax.Array | None,
    recorded: jax.Array | None,
) -> RouteStats:
    """The layer's ``RouteStats`` over the valid tokens (mismatch: own top-k vs the record)."""
    mask = valid.astype(jnp.float32)
    num_experts = probs.shape[-1]
    onehot = jax.nn.one_hot(experts, num_experts, dtype=jnp.float32).sum(axis=-2)
    load = jnp.einsum("bte,bt->e", onehot, mask)
    prob_sum = jnp.einsum("bte,bt->e", probs, mask)
    entropy = -jnp.sum(probs * jnp.log(jnp.maximum(probs, 1e-30)), axis=-1)
    if routes is None:
        mismatch = own_mismatch = replayed = jnp.zeros((), jnp.float32)
    else:
        record = jnp.sort(routes, axis=-1)
        counted = recorded & valid

        def differing(chosen: jax.Array) -> jax.Array:
            differs = jnp.any(jnp.sort(chosen, axis=-1) != record, axis=-1)
            return jnp.sum(differs & counted).astype(jnp.float32)

        mismatch, own_mismatch = differing(experts), differing(own)
        replayed = jnp.sum(counted).astype(jnp.float32)
    return RouteStats(
        experts=jax.lax.stop_gradient(experts),
        load=jax.lax.stop_gradient(load),
        prob_sum=prob_sum,
        entropy_sum=jax.lax.stop_gradient(jnp.sum(entropy * mask)),
        tokens=jnp.sum(mask),
        mismatch=mismatch,
        own_mismatch=own_mismatch,
        replayed=replayed,
    )


def load_balancing_loss(stats: RouteStats) -> jax.Array:
    """transformers' auxiliary loss over the layers' stats (each [L, ...]): E * sum_e f_e P_e,
    f_e the assignments to expert e per token, P_e its mean router probability (k when the
    load and the probabilities are even)."""
    tokens = jnp.maximum(stats.tokens.sum(), 1.0)
    fraction = stats.load.sum(axis=0) / tokens
    mean_prob = stats.prob_sum.sum(axis=0) / tokens
    return stats.load.shape[-1] * jnp.sum(fraction * mean_prob)
