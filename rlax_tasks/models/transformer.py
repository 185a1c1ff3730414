"""Flax NNX decoder-only transformer for the Llama / Qwen2 / Qwen3 families and Qwen3-MoE.

Names follow Hugging Face (``layers.self_attn.q_proj.kernel``) so the checkpoint mapping stays
obvious. Layers are stacked and scanned: compile time does not grow with depth and one remat
policy covers them all (stacks up to ``UNROLL_LAYERS_UP_TO`` unroll in the full-sequence pass)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from rlax_tasks.models.attention import attend_cache, causal_self_attend
from rlax_tasks.models.config import ModelConfig
from rlax_tasks.models.kv_cache import KVCache, keys_to_cache, values_to_cache, write_rows
from rlax_tasks.models.moe import RouteStats, SparseMoE
from rlax_tasks.models.rope import apply_rope, inverse_frequencies, rope_tables
from rlax_tasks.models.sharding import BATCH, constrain

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# layer stacks this shallow run unrolled in the full-sequence pass: there the scan's slicing of
# the stacked weights and its zero-filled stack of residuals cost more than the compile time it
# saves
UNROLL_LAYERS_UP_TO = 8
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def resolve_dtype(dtype: str | jnp.dtype) -> jnp.dtype:
    """Maps "float32"/"bfloat16" (or a jnp dtype) to a jnp dtype; anything else is a ValueError."""
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r} is not supported; use one of {sorted(DTYPES)}")
        return DTYPES[dtype]
    dt = jnp.dtype(dtype)
    if dt not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"dtype={dt} is not supported; use float32 or bfloat16")
    return dt


class Projection(nnx.Module):
    """A linear map contracting the last ``len(in_shape)`` dims: kernel [*in, *out] (+ bias)."""

    def __init__(
        self,
        in_shape: Sequence[int],
        out_shape: Sequence[int],
        *,
        use_bias: bool,
        dtype: jnp.dtype,
        param_dtype: jnp.dtype,
        rngs: nnx.Rngs,
    ) -> None:
        self.n_in = len(in_shape)
        self.dtype = dtype
        init = nnx.initializers.normal(stddev=0.02)
        self.kernel = nnx.Param(init(rngs.params(), (*in_shape, *out_shape), param_dtype))
        self.bias = nnx.Param(jnp.zeros(tuple(out_shape), param_dtype)) if use_bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        # as one [tokens, in] x [in, out] matmul: the same product, but XLA:CPU lays out the
        # backward of a many-dimensional tensordot through transposing copies
        kernel = self.kernel[...].astype(self.dtype)
        n_in = self.n_in
        in_size = math.prod(kernel.shape[:n_in])
        y = x.reshape(-1, in_size) @ kernel.reshape(in_size, -1)
        y = y.reshape(*x.shape[: x.ndim - n_in], *kernel.shape[n_in:])
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y


class RMSNorm(nnx.Module):
    """RMSNorm computed in float32, scaled in the compute dtype (as transformers does)."""

    def __init__(self, dim: int, eps: float, dtype: jnp.dtype, param_dtype: jnp.dtype) -> None:
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        h = x.astype(jnp.float32)
        h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + self.eps)
        return self.weight[...].astype(self.dtype) * h.astype(x.dtype)


class Attention(nnx.Module):
    """Self-attention with GQA, RoPE, optional qkv/o bias (Qwen2, Llama) and q/k norm (Qwen3)."""

    def __init__(
        self, config: ModelConfig, dtype: jnp.dtype, param_dtype: jnp.dtype, rngs: nnx.Rngs
    ) -> None:
        d, h, kv, hd = (
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        qkv_bias = config.qkv_bias
        dt = {"dtype": dtype, "param_dtype": param_dtype, "rngs": rngs}
        self.q_proj = Projection((d,), (h, hd), use_bias=qkv_bias, **dt)
        self.k_proj = Projection((d,), (kv, hd), use_bias=qkv_bias, **dt)
        self.v_proj = Projection((d,), (kv, hd), use_bias=qkv_bias, **dt)
        self.o_proj = Projection((h, hd), (d,), use_bias=config.o_bias, **dt)
        if config.qk_norm:
            self.q_norm = RMSNorm(hd, config.rms_norm_eps, dtype, param_dtype)
            self.k_norm = RMSNorm(hd, config.rms_norm_eps, dtype, param_dtype)
        else:
            self.q_norm = self.k_norm = None

    def __call__(
        self,
        x: jax.Array,
        cos: jax.Array,
        sin: jax.Array,
        positions: jax.Array,
        valid: jax.Array,
        kv: LayerKV | None = None,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
        """Attention output, and with ``kv`` every layer's cache with this step's keys written."""
        q = constrain(self.q_proj(x), BATCH, None, "tensor", None)
        k = constrain(self.k_proj(x), BATCH, None, "tensor", None)
        v = constrain(self.v_proj(x), BATCH, None, "tensor", None)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv is None:
            return self.o_proj(causal_self_attend(q, k, v, positions, valid)), None
        if kv.fresh:  # a prefill into an empty cache of exactly these tokens: self-attention
            out = causal_self_attend(q, k, v, positions, valid)
            k_new = keys_to_cache(k.astype(kv.k.dtype))
            v_new = values_to_cache(v.astype(kv.v.dtype))
            return self.o_proj(out), (k_new, v_new)
        # scatter only the new tokens into this layer's cache (in place; entries past the end are
        # dropped), then attend over its first ``window`` entries; the cache's layout is
        # kv_cache's (keys transposed)
        b, t = k.shape[:2]
        rows = jnp.arange(b)[:, None]
        cols = kv.start[:, None] + jnp.arange(t)[None, :]
        # advanced indices [B, T] first, then the sliced (kv_heads, head_dim): k's own layout
        k_layer = kv.k.at[rows, :, :, cols].set(k.astype(kv.k.dtype), mode="drop")
        v_layer = kv.v.at[rows, :, cols].set(v.astype(kv.v.dtype), mode="drop")
        w = kv.window or kv.positions.shape[1]  # entries past the window are invalid: not read
        k_cache, v_cache = k_layer[..., :w], v_layer[:, :, :w]
        out = attend_cache(q, k_cache, v_cache, positions, kv.positions[:, :w], kv.valid[:, :w])
        return self.o_proj(out), (k_layer, v_layer)


class LayerKV(NamedTuple):
    """The cache seen by one layer: its k and v in kv_cache's layout (updated in place), write
    offsets [B], entry positions/validity [B, S]."""

    k: jax.Array
    v: jax.Array
    start: jax.Array
    positions: jax.Array
    valid: jax.Array
    # the cache holds nothing but this call's tokens (a prefill at offset 0 into a cache of their
    # length): attention is then plain causal self-attention, with the platform's fused kernel
    fresh: bool = False
    # static: attention reads only the first ``window`` entries (None: all); the caller promises
    # that every valid entry, including this call's, lies below it
    window: int | None = None


class MLP(nnx.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(
        self, config: ModelConfig, dtype: jnp.dtype, param_dtype: jnp.dtype, rngs: nnx.Rngs
    ) -> None:
        d, f, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        dt = {"dtype": dtype, "param_dtype": param_dtype, "rngs": rngs}
        self.gate_proj = Projection((d,), (f,), use_bias=bias, **dt)
        self.up_proj = Projection((d,), (f,), use_bias=bias, **dt)
        self.down_proj = Projection((f,), (d,), use_bias=bias, **dt)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = jax.nn.silu(self.gate_proj(x)) * self.up_proj(x)
        return self.down_proj(constrain(h, BATCH, None, "tensor"))


class DecoderLayer(nnx.Module):
    """Pre-norm residual block: x + attn(norm(x)), then + mlp(norm(.)); the MLP is routed
    experts in a mixture-of-experts model (``moe.SparseMoE``)."""

    def __init__(
        self, config: ModelConfig, dtype: jnp.dtype, param_dtype: jnp.dtype, rngs: nnx.Rngs
    ) -> None:
        d, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(d, eps, dtype, param_dtype)
        self.self_attn = Attention(config, dtype, param_dtype, rngs)
        self.post_attention_layernorm = RMSNorm(d, eps, dtype, param_dtype)
        self.mlp = (SparseMoE if config.is_moe else MLP)(config, dtype, param_dtype, rngs)

    def __call__(self, x, cos, sin, positions, valid, kv=None, routes=None, replay=True):  # noqa: ANN001, ANN204, E501
        """(x, the layer's cache or None, its ``RouteStats`` or None for a dense MLP);
        ``routes`` [B, T, k]: the experts recorded (-1: none), replayed when ``replay``."""
        attn, new_kv = self.self_attn(self.input_layernorm(x), cos, sin, positions, valid, kv)
        x = x + attn
        stats = None
        if isinstance(self.mlp, SparseMoE):
            mlp, stats = self.mlp(self.post_attention_layernorm(x), valid, routes, replay)
        else:
            mlp = self.mlp(self.post_attention_layernorm(x))
        return constrain(x + mlp, BATCH, None, None), new_kv, stats


class Embedding(nnx.Module):
    """Token embedding table [vocab, hidden]."""

    def __init__(
        self, vocab: int, dim: int, dtype: jnp.dtype, param_dtype: jnp.dtype, rngs: nnx.Rngs
    ) -> None:
        init = nnx.initializers.normal(stddev=0.02)
        self.embedding = nnx.Param(init(rngs.params(), (vocab, dim), param_dtype))
        self.dtype = dtype

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.embedding[...], ids, axis=0).astype(self.dtype)


def _layer_slice(layer_state: nnx.State, i: int) -> nnx.State:
    """Layer ``i``'s weights out of the stacked ones (a copy, where XLA cannot read in place)."""
    return jax.tree.map(lambda a: a[i], layer_state)


class Transformer(nnx.Module):
    """The whole decoder: embeddings, stacked layers, final norm and (untied) LM head.

    Parameters are stored in ``param_dtype`` (default: ``dtype``) and cast to the compute
    ``dtype`` where they are used, so a trainer keeps float32 master weights (and float32 Adam
    moments) while computing in bfloat16 (docs/design.md §12)."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: str | jnp.dtype,
        rngs: nnx.Rngs,
        param_dtype: str | jnp.dtype | None = None,
    ) -> None:
        dt = resolve_dtype(dtype)
        pdt = dt if param_dtype is None else resolve_dtype(param_dtype)
        self.config = config
        self.dtype = dt
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dt, pdt, rngs)

        @nnx.split_rngs(splits=config.num_hidden_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_layers(layer_rngs: nnx.Rngs) -> DecoderLayer:
            return DecoderLayer(config, dt, pdt, layer_rngs)

        self.layers = make_layers(rngs)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dt, pdt)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Projection(
                (config.hidden_size,),
                (config.vocab_size,),
                use_bias=False,
                dtype=dt,
                param_dtype=pdt,
                rngs=rngs,
            )

    def hidden_states_and_routes(
        self,
        input_ids: jax.Array,
        positions: jax.Array,
        valid: jax.Array,
        remat: str = "none",
        routes: jax.Array | None = None,
        replay: bool = True,
    ) -> tuple[jax.Array, RouteStats | None]:
        """(hidden states [B, T, D], every layer's ``RouteStats`` stacked [L, ...], None for a
        dense model). ``routes`` [B, T, L, k] int: the experts recorded per token and layer (-1
        on a token: none), replayed when ``replay`` (static), else only compared with."""
        if remat not in REMAT_POLICIES:
            raise ValueError(f"remat={remat!r} is not one of {sorted(REMAT_POLICIES)}")
        x = constrain(self.embed_tokens(input_ids), BATCH, None, None)
        cos, sin = rope_tables(positions, inverse_frequencies(self.config))
        layer_def, layer_state = nnx.split(self.layers)
        layer_routes = None if routes is None else jnp.moveaxis(routes, 2, 0)

        def body(h: jax.Array, xs: tuple) -> tuple[jax.Array, RouteStats | None]:
            state, r = xs
            layer = nnx.merge(layer_def, state)
            h, _, stats = layer(h, cos, sin, positions, valid, None, r, replay)
            return h, stats

        if remat != "none":
            body = jax.checkpoint(body, policy=REMAT_POLICIES[remat])
        unroll = self.config.num_hidden_layers <= UNROLL_LAYERS_UP_TO
        x, stats = jax.lax.scan(body, x, (layer_state, layer_routes), unroll=unroll)
        return self.norm(x), stats

    def hidden_states_cached(
        self,
        input_ids: jax.Array,
        positions: jax.Array,
        valid: jax.Array,
        cache: KVCache,
        start: jax.Array,
        fresh: bool = False,
        window: int | None = None,
        layers: Sequence[nnx.State] | None = None,
    ) -> tuple[jax.Array, KVCache, jax.Array | None]:
        """Hidden states [B, T, D] of new tokens attending to the cache, the updated cache, and
        the experts each new token was routed to, [B, T, L, k] int32 (None: a dense model).

        Row b's tokens go to entries start[b] .. start[b] + T - 1; invalid ones stay invisible.
        ``fresh``: an empty cache of exactly T entries (prefill); ``window`` (static): read only
        the first entries, which hold every valid one; ``layers``: unstacked weights, in turn."""
        if fresh and cache.max_len != input_ids.shape[1]:
            raise ValueError(
                f"fresh=True needs a cache of the tokens' length {input_ids.shape[1]}, "
                f"got {cache.max_len}"
            )
        x = constrain(self.embed_tokens(input_ids), BATCH, None, None)
        cos, sin = rope_tables(positions, inverse_frequencies(self.config))
        kv_positions = write_rows(cache.positions, positions, start)
        kv_valid = write_rows(cache.valid, valid, start)
        layer_def, layer_state = nnx.split(self.layers)

        def layer(h: jax.Array, state: nnx.State, k: jax.Array, v: jax.Array) -> tuple:
            kv = LayerKV(k, v, start, kv_positions, kv_valid, fresh, window)
            return nnx.merge(layer_def, state)(h, cos, sin, positions, valid, kv)

        n = self.config.num_hidden_layers
        if fresh and layers is None:  # a prefill: the stacked layers scanned, each one's new
            # entries stacked as the scan's output, then split per layer (prefill is compute-bound)
            def body(h: jax.Array, state: nnx.State) -> tuple[jax.Array, tuple]:
                h, kv, stats = layer(h, state, cache.k[0], cache.v[0])  # (dtypes only: unread)
                return h, (kv, None if stats is None else stats.experts)

            x, ((ks, vs), experts) = jax.lax.scan(body, x, layer_state)
            k_layers, v_layers = tuple(ks[i] for i in range(n)), tuple(vs[i] for i in range(n))
            routes = None if experts is None else jnp.moveaxis(experts, 0, 2)
            return self.norm(x), KVCache(k_layers, v_layers, kv_positions, kv_valid), routes
        # one layer after the other, each reading and updating its own cache arrays in place
        # (``layers``: its weights as arrays of their own; else slices of the stacked ones)
        ks, vs = list(cache.k), list(cache.v)
        experts = []
        for i in range(n):
            state = layers[i] if layers is not None else _layer_slice(layer_state, i)
            x, (ks[i], vs[i]), stats = layer(x, state, ks[i], vs[i])
            if stats is not None:
                experts.append(stats.experts)
        routes = jnp.stack(experts, axis=2) if experts else None
        return self.norm(x), KVCache(tuple(ks), tuple(vs), kv_positions, kv_valid), routes

    def unstack_layers(self) -> tuple[nnx.State, ...]:
        """Each decoder layer's weights as arrays of their own (copies of the stacked ones), for
        ``hidden_states_cached(layers=...)``; why a sampler holds them: ``held_layers``."""
        _, layer_state = nnx.split(self.layers)
        return tuple(_layer_slice(layer_state, i) for i in range(self.config.num_hidden_layers))

    def unembedding(self) -> jax.Array:
        """The [D, V] output projection (the transposed embedding table when tied)."""
        if self.lm_head is None:
            return self.embed_tokens.embedding[...].T.astype(self.dtype)
        return self.lm_head.kernel[...].astype(self.dtype)

    def unembed(self, hidden: jax.Array, unembedding: jax.Array | None = None) -> jax.Array:
        """Float32 logits [B, T, V] of hidden states [B, T, D]; ``unembedding``: the [D, V]
        projection when the caller holds its own copy (see ``Sampler``), else the model's."""
        if unembedding is None:
            unembedding = self.unembedding()
        logits = jnp.einsum(
            "btd,dv->btv",
            hidden,
            unembedding.astype(self.dtype),
            preferred_element_type=jnp.float32,
        )
        return constrain(logits, BATCH, None, "tensor")

    def __call__(self, input_ids: jax.Array, positions: jax.Array, valid: jax.Array) -> jax.Array:
        return self.unembed(self.hidden_states_and_routes(input_ids, positions, valid)[0])
