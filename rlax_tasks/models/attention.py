"""Causal grouped-query attention, one contract and a kernel per platform: cuDNN on GPU (its
packed layout, no dense mask), Pallas splash on TPU, blocked XLA on CPU. Causality is by position
(left padding works); ``valid`` may hold segment ids of packed sequences. ``attend`` is the
reference, ``attend_cache`` the same over the KV cache's layout (decode). ``RLAX_ATTENTION``
(blocked, xla, cudnn, splash) forces a kernel.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from rlax_tasks.models.sharding import BATCH, fit_spec

IMPLEMENTATIONS = ("blocked", "xla", "cudnn", "splash")
ATTENTION_ENV = "RLAX_ATTENTION"
# query block of the blocked attention (see blocked_causal_attend)
ATTENTION_BLOCK = 128
# sequence block of the splash kernel (its q and kv blocks; sequences are padded to a multiple)
SPLASH_BLOCK = 128
# the most sequences a packed row holds (trainer/packing.py keeps to it): cuDNN's packed layout
# has a static number of sequences per row
MAX_PACKED_SEGMENTS = 32
# additive mask value: finite so that fully-masked (padding) query rows stay NaN-free
MASK_VALUE = -1e30


def key_mask(
    q_positions: jax.Array,
    k_positions: jax.Array,
    k_valid: jax.Array,
    q_valid: jax.Array | None = None,
) -> jax.Array:
    """[B, T, S] bool: the keys each query sees, valid and not after it by position (the one
    causality rule of every kernel). Packed sequences: ``k_valid``/``q_valid`` are segment ids (0
    on padding) and a query sees only its own segment; padding sees padding, so no row is empty.
    """
    causal = k_positions[:, None, :] <= q_positions[:, :, None]
    if is_packed(k_valid):
        if q_valid is None:
            raise ValueError("segment ids of the keys need the queries' segment ids (q_valid)")
        return causal & (k_valid[:, None, :] == q_valid[:, :, None])
    return causal & k_valid.astype(bool)[:, None, :]


def is_packed(valid: jax.Array) -> bool:
    """Whether ``valid`` holds segment ids of packed sequences (ints), not a bool mask."""
    return jnp.issubdtype(valid.dtype, jnp.integer)


def attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_positions: jax.Array,
    k_positions: jax.Array,
    k_valid: jax.Array,
    q_valid: jax.Array | None = None,
) -> jax.Array:
    """Grouped-query attention with a position-based causal mask (the reference): q [B,T,H,hd];
    k, v [B,S,KV,hd]. Positions, not indices, define causality, so left padding and a KV cache
    share one path; segment ids in ``k_valid``/``q_valid`` mean packed sequences (``key_mask``).
    """
    b, t, h, hd = q.shape
    kv = k.shape[2]
    q = q.reshape(b, t, kv, h // kv, hd)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32)
    scores = scores * (hd**-0.5)
    mask = key_mask(q_positions, k_positions, k_valid, q_valid)
    scores = jnp.where(mask[:, None, None, :, :], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32)
    return out.astype(v.dtype).reshape(b, t, h, hd)


def attend_cache(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_positions: jax.Array,
    k_positions: jax.Array,
    k_valid: jax.Array,
) -> jax.Array:
    """``attend`` over keys and values in the KV cache's layout (``kv_cache``): k [B,KV,hd,S]
    (transposed), v [B,KV,S,hd]; both products are plain batched matmuls, no copy of the cache.
    Decode is memory-bound, so the [.., S] scores are passed over as few times as they can be:
    the scale is folded into the queries and the softmax's division applied to the output."""
    b, t, h, hd = q.shape
    kv, dtype = k.shape[1], v.dtype
    g = h // kv
    operand = _dot_operand_dtype(dtype)
    # a kv head's t tokens x g query heads as the rows of one matmul ([B, KV, t*g, hd]): with t
    # a dimension of its own, XLA:CPU chose transposed-operand dots
    rows = q.reshape(b, t, kv, g, hd).transpose(0, 2, 1, 3, 4).reshape(b, kv, t * g, hd)
    rows = rows.astype(jnp.float32) * (hd**-0.5)
    scores = jnp.einsum(
        "bkmd,bkds->bkms",
        rows.astype(dtype).astype(operand),
        k.astype(operand),
        preferred_element_type=jnp.float32,
    ).reshape(b, kv, t, g, -1)
    mask = key_mask(q_positions, k_positions, k_valid)[:, None, :, None, :]
    scores = jnp.where(mask, scores, MASK_VALUE)
    top = jnp.max(scores, axis=-1, keepdims=True)
    weights = jnp.exp(scores - top)  # unnormalised: the division comes after the product
    total = jnp.sum(weights, axis=-1)
    out = jnp.einsum(
        "bkms,bksd->bkmd",
        weights.astype(dtype).astype(operand).reshape(b, kv, t * g, -1),
        v.astype(operand),
        preferred_element_type=jnp.float32,
    )
    out = out.reshape(b, kv, t, g, hd) / total[..., None]
    return out.transpose(0, 2, 1, 3, 4).astype(dtype).reshape(b, t, h, hd)


def _dot_operand_dtype(dtype: jnp.dtype) -> jnp.dtype:
    """The dtype ``attend_cache`` multiplies in: float32 on CPU, whose batched-matmul kernel has
    no bfloat16 x bfloat16 -> float32 form (products of bfloat16 values are exact in float32, so
    the scores are the same); the cache's own dtype elsewhere."""
    return jnp.float32 if jax.default_backend() == "cpu" else dtype


def blocked_causal_attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    positions: jax.Array,
    valid: jax.Array,
    block: int = ATTENTION_BLOCK,
) -> jax.Array:
    """``attend`` over a sequence's own keys, by query blocks that skip the keys after the block:
    half the score work, and each block's float32 scores stay small. Exact when positions do not
    decrease along the sequence (any padding from ``positions_from_mask``) or each packed segment.
    """
    t = q.shape[1]
    if t <= block:
        return attend(q, k, v, positions, positions, valid, valid)
    outs = []
    for start in range(0, t, block):
        end = min(start + block, t)
        outs.append(
            attend(
                q[:, start:end],
                k[:, :end],
                v[:, :end],
                positions[:, start:end],
                positions[:, :end],
                valid[:, :end],
                valid[:, start:end],
            )
        )
    return jnp.concatenate(outs, axis=1)


def _mask(positions: jax.Array, valid: jax.Array) -> jax.Array:
    """[B, 1, T, T] bool: key valid (of the query's segment) and not after it (by position)."""
    return key_mask(positions, positions, valid, valid)[:, None]


def dot_product_causal_attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    positions: jax.Array,
    valid: jax.Array,
    implementation: str = "cudnn",
) -> jax.Array:
    """``jax.nn.dot_product_attention`` with our mask as a dense [B, 1, T, T] array: its XLA
    implementation anywhere, or cuDNN's fused attention (bfloat16/float16) taking it as a bias
    (GPUs before Hopper; ``cudnn_causal_attend``)."""
    return jax.nn.dot_product_attention(
        q, k, v, mask=_mask(positions, valid), implementation=implementation
    )


def valid_runs(valid: jax.Array, max_runs: int) -> tuple[jax.Array, jax.Array]:
    """cuDNN's packed layout of rows [B, T]: the length and the start of each run of equal
    ``valid`` values along a row (a packed sequence, a stretch of padding), [B, max_runs] and
    [B, max_runs + 1], -1 after a row's last run. Every token is in a run, so the kernel leaves
    no output undefined; a row of more than ``max_runs`` runs loses its last ones."""
    b, t = valid.shape
    m = min(max_runs, t)
    ids = valid.astype(jnp.int32)
    index = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    starts = jnp.concatenate([jnp.ones((b, 1), bool), ids[:, 1:] != ids[:, :-1]], axis=1)
    ordered = jnp.sort(jnp.where(starts, index, t), axis=1)  # run starts first, then t
    ordered = jnp.concatenate([ordered, jnp.full((b, 1), t, jnp.int32)], axis=1)
    first, following = ordered[:, :m], ordered[:, 1 : m + 1]
    lengths = jnp.where(first < t, following - first, -1)
    offsets = jnp.where(first < t, first, -1)
    return lengths, jnp.concatenate([offsets, jnp.full((b, 1), -1, jnp.int32)], axis=1)


def max_runs(valid: jax.Array) -> int:
    """How many runs ``valid_runs`` gives a row: a bool row is one stretch of tokens between
    padding (left-padded prompts, right-padded completions: 3); a packed row at most
    MAX_PACKED_SEGMENTS sequences and its padding (the packer's bound)."""
    return MAX_PACKED_SEGMENTS + 1 if is_packed(valid) else 3


def _packed_layout_supported() -> bool:
    """Whether cuDNN takes the packed layout here: a Hopper or later GPU (compute 9.0)."""
    device = jax.local_devices()[0]
    capability = getattr(device, "compute_capability", None)
    return capability is not None and tuple(map(int, capability.split("."))) >= (9, 0)


def cudnn_causal_attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    positions: jax.Array,
    valid: jax.Array,
) -> jax.Array:
    """cuDNN's fused flash attention without a dense mask: each run of ``valid`` (``valid_runs``)
    one sequence of its packed layout, causal within it, so the kernel reads no [B, T, T] bias
    and computes no gradient for one. Equals ``attend`` for valid queries when each row's tokens
    are one stretch (bool ``valid``) or packed segments whose positions count from 0. Before
    Hopper cuDNN has no packed layout: the mask goes in as a bias (``dot_product_causal_attend``).
    """
    if not _packed_layout_supported():
        return dot_product_causal_attend(q, k, v, positions, valid, "cudnn")
    # the packed layout is only in JAX's cuDNN module (jax.nn.dot_product_attention takes
    # sequence lengths of one sequence per row)
    from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention

    lengths, offsets = valid_runs(valid, max_runs(valid))
    return dot_product_attention(
        q,
        k,
        v,
        q_seqlen=lengths,
        kv_seqlen=lengths,
        q_offsets=offsets,
        kv_offsets=offsets,
        scale=q.shape[-1] ** -0.5,
        mask_type=MaskType.PADDING_CAUSAL,
    )


@functools.cache
def _splash_kernel(group: int, length: int, interpret: bool):  # noqa: ANN202
    # lazy: the Pallas TPU kernels load only where splash attention runs
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    mask = sm.MultiHeadMask([sm.CausalMask((length, length)) for _ in range(group)])
    block = SPLASH_BLOCK
    sizes = sk.BlockSizes(
        block_q=block,
        block_kv=block,
        block_kv_compute=block,
        block_q_dkv=block,
        block_kv_dkv=block,
        block_kv_dkv_compute=block,
        block_q_dq=block,
        block_kv_dq=block,
    )
    # built eagerly even when first asked for inside a trace: the kernel holds its mask tables
    # as arrays, and a cached kernel holding one trace's tracers fails every later trace
    with jax.ensure_compile_time_eval():
        return sk.make_splash_mqa_single_device(mask, block_sizes=sizes, interpret=interpret)


def splash_causal_attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    positions: jax.Array,
    valid: jax.Array,
    interpret: bool = False,
) -> jax.Array:
    """Pallas splash attention (TPU): causal by index, padding as its own segment. Equals
    ``attend`` for valid queries under ``blocked_causal_attend``'s assumption; each kv head's
    query group runs as one multi-query kernel. ``interpret``: the Pallas interpreter (tests).
    """
    # lazy: the Pallas TPU kernels load only where splash attention runs
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    b, t, h, hd = q.shape
    kv = k.shape[2]
    length = -(-t // SPLASH_BLOCK) * SPLASH_BLOCK  # the kernel's blocks are lane-aligned
    pad = length - t

    def padded(x: jax.Array) -> jax.Array:
        return jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))

    qg = padded(q * jnp.asarray(hd**-0.5, q.dtype)).reshape(b, length, kv, h // kv, hd)
    qg = qg.transpose(0, 2, 3, 1, 4)  # [B, KV, G, T, hd]
    kk, vv = padded(k).transpose(0, 2, 1, 3), padded(v).transpose(0, 2, 1, 3)  # [B, KV, T, hd]
    segments = padded(valid.astype(jnp.int32))  # padding (and the tail) is segment 0
    kernel = _splash_kernel(h // kv, length, interpret)

    def one(qh: jax.Array, kh: jax.Array, vh: jax.Array, seg: jax.Array) -> jax.Array:
        return kernel(qh, kh, vh, segment_ids=sk.SegmentIds(q=seg, kv=seg))

    per_head = jax.vmap(one, in_axes=(0, 0, 0, None))  # over kv heads
    out = jax.vmap(per_head)(qg, kk, vv, segments)  # over the batch: [B, KV, G, T, hd]
    out = out.transpose(0, 3, 1, 2, 4).reshape(b, length, h, hd)
    return out[:, :t].astype(v.dtype)


def default_implementation(platform: str, dtype: jnp.dtype) -> str:
    """The kernel for a platform: cudnn on GPU (bfloat16/float16), splash on TPU, else blocked."""
    forced = os.environ.get(ATTENTION_ENV)
    if forced:
        if forced not in IMPLEMENTATIONS:
            raise ValueError(f"{ATTENTION_ENV}={forced!r} is not one of {list(IMPLEMENTATIONS)}")
        return forced
    if platform == "gpu" and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(np.float16)):
        return "cudnn"
    if platform == "tpu":
        return "splash"
    return "blocked"


def causal_self_attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    positions: jax.Array,
    valid: jax.Array,
    implementation: str | None = None,
) -> jax.Array:
    """Causal self-attention of a sequence over its own keys, with the platform's kernel.

    ``valid`` [B, T]: bool (True on tokens), or int segment ids of sequences packed into each
    row (0 on padding; positions restart at 0 in each segment).
    """
    impl = implementation or default_implementation(jax.default_backend(), q.dtype)
    if impl == "blocked":
        return blocked_causal_attend(q, k, v, positions, valid)
    if impl == "cudnn":
        return cudnn_causal_attend(q, k, v, positions, valid)
    if impl == "xla":
        return dot_product_causal_attend(q, k, v, positions, valid, impl)
    if impl == "splash":
        return _per_shard(splash_causal_attend, q, k, v, positions, valid)
    raise ValueError(f"attention implementation {impl!r} is not one of {list(IMPLEMENTATIONS)}")


def _per_shard(kernel, q, k, v, positions, valid):  # noqa: ANN001, ANN202
    """A Pallas kernel under the active mesh, run per shard with shard_map (XLA cannot partition
    a custom kernel): batch over data/fsdp, heads over tensor where they divide."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return kernel(q, k, v, positions, valid)
    shape = dict(mesh.shape)
    batch = fit_spec(q.shape[:1], (BATCH,), shape)[0]
    heads = fit_spec((k.shape[2],), ("tensor",), shape)[0]  # kv heads; q groups follow them
    P = jax.sharding.PartitionSpec
    spec, rows = P(batch, None, heads, None), P(batch, None)
    return jax.shard_map(
        kernel, in_specs=(spec, spec, spec, rows, rows), out_specs=spec, check_vma=False
    )(q, k, v, positions, valid)
