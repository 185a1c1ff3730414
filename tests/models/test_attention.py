"""Attention kernels by platform agree: blocked (CPU), jax.nn.dot_product_attention (the API the
GPU's cuDNN kernel runs behind; its XLA implementation here) and Pallas splash (TPU; in the Pallas
interpreter here) all equal the reference ``attend`` on every valid query."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_tasks.models import attention, forward
from rlax_tasks.models.forward import positions_from_mask


def _inputs(t: int, dtype, seed: int = 0):  # noqa: ANN001, ANN202
    b, h, kv, hd = 3, 4, 2, 16
    keys = jax.random.split(jax.random.key(seed), 3)
    shapes = zip(keys, (h, kv, kv), strict=True)
    q, k, v = (jax.random.normal(key, (b, t, n, hd), dtype) for key, n in shapes)
    valid = np.ones((b, t), bool)
    valid[0, : t // 3] = False  # left padding (a prompt)
    valid[1, t - t // 4 :] = False  # right padding (a completion)
    valid[2, : t // 5] = False  # both
    valid[2, t - 3 :] = False
    valid = jnp.asarray(valid)
    return q, k, v, positions_from_mask(valid), valid


def _kernels(q, k, v, positions, valid):  # noqa: ANN001, ANN202
    return {  # cudnn_causal_attend (the GPU's): test_cudnn_packed_layout_equals_the_reference
        "blocked": attention.blocked_causal_attend(q, k, v, positions, valid, block=64),
        "xla": attention.dot_product_causal_attend(q, k, v, positions, valid, "xla"),
        "splash": attention.splash_causal_attend(q, k, v, positions, valid, interpret=True),
    }


@pytest.mark.parametrize(
    ("t", "dtype", "tol"),
    [(40, jnp.float32, 1e-5), (200, jnp.float32, 1e-5), (200, jnp.bfloat16, 2e-2)],
    ids=["short-f32", "blocks-f32", "blocks-bf16"],
)
def test_kernels_equal_the_reference(t, dtype, tol) -> None:  # noqa: ANN001
    q, k, v, positions, valid = _inputs(t, dtype)
    reference = attention.attend(q, k, v, positions, positions, valid).astype(jnp.float32)
    rows = np.asarray(valid)  # padding queries' outputs are never used
    for name, out in _kernels(q, k, v, positions, valid).items():
        assert out.shape == q.shape and out.dtype == q.dtype, name
        err = np.abs(np.asarray(out.astype(jnp.float32)) - np.asarray(reference))[rows].max()
        assert err <= tol, (name, err)


def _cudnn_packed(q, k, v, lengths, offsets) -> np.ndarray:  # noqa: ANN001
    """What cuDNN's packed layout computes (PADDING_CAUSAL): each (start, length) of a row an
    independent sequence, causal by index from its start; a token in none gets zeros."""
    out = np.zeros(q.shape, np.float32)
    for b in range(q.shape[0]):
        for start, n in zip(np.asarray(offsets[b]), np.asarray(lengths[b]), strict=False):
            if n < 0:
                continue
            span, index = slice(start, start + n), jnp.arange(n)[None]
            one = attention.attend(
                q[b : b + 1, span], k[b : b + 1, span], v[b : b + 1, span],
                index, index, jnp.ones((1, n), bool),
            )  # fmt: skip
            out[b, span] = np.asarray(one[0], np.float32)
    return out


def _packed_inputs(t: int = 40):  # noqa: ANN202
    q, k, v, _, _ = _inputs(t, jnp.float32)
    segments = np.zeros((3, t), np.int32)
    segments[0, :17] = [1] * 5 + [2] * 9 + [3] * 3  # three sequences, then padding
    segments[2, :32] = np.arange(1, 33)  # the packer's most: 32 one-token sequences
    # row 1: all padding (a row the packer adds to round the row count)
    segments = jnp.asarray(segments)
    return q, k, v, forward.positions_from_segments(segments), segments


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_cudnn_packed_layout_equals_the_reference(layout) -> None:  # noqa: ANN001
    """The sequences cudnn_causal_attend hands cuDNN's packed layout (``valid_runs``): with the
    kernel's semantics they give every valid query ``attend``'s output, and cover every token."""
    q, k, v, positions, valid = _inputs(40, jnp.float32) if layout == "padded" else _packed_inputs()
    lengths, offsets = attention.valid_runs(valid, attention.max_runs(valid))
    assert lengths.shape[1] + 1 == offsets.shape[1] == attention.max_runs(valid) + 1
    assert (np.where(lengths > 0, lengths, 0).sum(axis=1) == 40).all()  # every token in a run
    out = _cudnn_packed(q, k, v, lengths, offsets)
    reference = attention.attend(q, k, v, positions, positions, valid, valid)
    rows = np.asarray(valid) > 0
    assert np.abs(out - np.asarray(reference))[rows].max() <= 1e-5
    if layout == "packed":  # one run more than the bound: the row's last run is dropped
        lengths, _ = attention.valid_runs(valid, attention.max_runs(valid) - 1)
        assert int(np.where(lengths[2] > 0, lengths[2], 0).sum()) == 32


def test_splash_runs_per_shard_on_a_mesh() -> None:
    from rlax_tasks.models import make_mesh

    q, k, v, positions, valid = _inputs(40, jnp.float32)
    q, k, v = (jnp.concatenate([x, x[:1]], 0) for x in (q, k, v))  # batch 4: splits over fsdp
    positions, valid = (jnp.concatenate([x, x[:1]], 0) for x in (positions, valid))
    reference = attention.attend(q, k, v, positions, positions, valid)
    mesh = make_mesh(1, 2, 2, devices=jax.devices()[:4])
    kernel = lambda *a: attention.splash_causal_attend(*a, interpret=True)  # noqa: E731
    with jax.set_mesh(mesh):
        out = jax.jit(lambda *a: attention._per_shard(kernel, *a))(q, k, v, positions, valid)
    rows = np.asarray(valid)
    assert np.abs(np.asarray(out) - np.asarray(reference))[rows].max() <= 1e-5


def test_the_platform_picks_the_kernel(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.delenv(attention.ATTENTION_ENV, raising=False)
    pick = attention.default_implementation
    assert pick("gpu", jnp.bfloat16) == "cudnn"
    assert pick("gpu", jnp.float32) == "blocked"  # cuDNN's fused attention takes 16-bit inputs
    assert pick("tpu", jnp.bfloat16) == "splash"
    assert pick("cpu", jnp.bfloat16) == "blocked"
    monkeypatch.setenv(attention.ATTENTION_ENV, "xla")
    assert pick("gpu", jnp.bfloat16) == "xla"
    monkeypatch.setenv(attention.ATTENTION_ENV, "flash")
    with pytest.raises(ValueError, match="RLAX_ATTENTION"):
        pick("cpu", jnp.float32)


# the runs cuDNN must be handed for _inputs(40) and _packed_inputs(), written out by hand from
# how those rows are built (not computed by the product's valid_runs): (lengths, offsets) per row
_NONE = [-1]
EXPECTED_RUNS = {
    "padded": [  # 3 runs at most for a bool mask
        ([13, 27, -1], [0, 13, -1, -1]),  # 13 left-padding tokens, then 27
        ([30, 10, -1], [0, 30, -1, -1]),  # 30 tokens, then 10 right padding
        ([8, 29, 3], [0, 8, 37, -1]),  # both
    ],
    "packed": [  # MAX_PACKED_SEGMENTS + 1 = 33 runs at most
        ([5, 9, 3, 23] + _NONE * 29, [0, 5, 14, 17] + _NONE * 30),
        ([40] + _NONE * 32, [0] + _NONE * 33),  # one run of padding
        ([1] * 32 + [8], list(range(33)) + _NONE),
    ],
}


def _record_cudnn(monkeypatch, calls: list, runs: list) -> None:  # noqa: ANN001
    """Replaces JAX's cuDNN attention (the function cudnn_causal_attend calls) by a recorder:
    ``calls`` its static arguments once per trace, ``runs`` its array arguments each time the
    program runs it (jax.debug.callback: concrete under a trace or a layer scan). Returns 0s."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    def recorded(q, k, v, **kwargs):  # noqa: ANN001, ANN003, ANN202
        arrays = {n: kwargs.pop(n) for n in ("q_seqlen", "kv_seqlen", "q_offsets", "kv_offsets")}
        calls.append({"shape": q.shape, "dtype": q.dtype, **kwargs})
        jax.debug.callback(lambda **a: runs.append(jax.tree.map(np.asarray, a)), **arrays)
        return jnp.zeros_like(q)

    monkeypatch.setattr(cudnn, "dot_product_attention", recorded)
    monkeypatch.setattr(attention, "_packed_layout_supported", lambda: True)


def _assert_runs(call: dict, layout: str) -> None:
    lengths, offsets = (np.asarray(x) for x in zip(*EXPECTED_RUNS[layout], strict=True))
    for name, want in (("q_seqlen", lengths), ("kv_seqlen", lengths), ("q_offsets", offsets),
                       ("kv_offsets", offsets)):  # fmt: skip
        np.testing.assert_array_equal(call[name], want, err_msg=name)


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_the_cudnn_path_passes_cudnn_its_packed_layout(layout, monkeypatch) -> None:  # noqa: ANN001
    """What cudnn_causal_attend hands JAX's cuDNN attention on a Hopper GPU, checked on this CPU
    against the runs written out by hand: the causal mask over each row's runs (PADDING_CAUSAL),
    1/sqrt(head_dim), the same runs for queries and keys; and computed with cuDNN's semantics
    over those arguments, every valid query gets ``attend``'s output."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    calls, runs = [], []
    _record_cudnn(monkeypatch, calls, runs)
    q, k, v, positions, valid = _inputs(40, jnp.float32) if layout == "padded" else _packed_inputs()
    attention.cudnn_causal_attend(q, k, v, positions, valid)
    jax.effects_barrier()
    (call,), (run,) = calls, runs
    assert call["mask_type"] == cudnn.MaskType.PADDING_CAUSAL
    assert call["scale"] == pytest.approx(q.shape[-1] ** -0.5)
    assert not {"bias", "mask"} & set(call)  # no dense [B, T, T] operand
    _assert_runs(run, layout)
    out = _cudnn_packed(q, k, v, run["q_seqlen"], run["q_offsets"])
    reference = attention.attend(q, k, v, positions, positions, valid, valid)
    rows = np.asarray(valid) > 0
    assert np.abs(out - np.asarray(reference))[rows].max() <= 1e-5


def test_a_bfloat16_model_on_a_gpu_runs_every_layer_through_cudnns_packed_layout(
    monkeypatch,
) -> None:  # noqa: ANN001
    """Through the product's own path (token_logprobs -> Transformer -> causal_self_attend, the
    kernel picked for the platform, RLAX_ATTENTION unset): on a Hopper GPU a bfloat16 model's
    packed rows reach cuDNN in every layer, with the rows' runs and bfloat16 operands."""
    from rlax_tasks.models import Policy
    from tests.tiny_model import tiny_model_config

    monkeypatch.delenv(attention.ATTENTION_ENV, raising=False)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    calls, runs = [], []
    _record_cudnn(monkeypatch, calls, runs)
    config = tiny_model_config(vocab_size=64)
    policy = Policy.init(config, dtype="bfloat16")
    *_, segments = _packed_inputs()
    ids = (np.arange(segments.size).reshape(segments.shape) % config.vocab_size).astype(np.int32)
    forward.token_logprobs(policy.graphdef, policy.params, ids, segment_ids=segments)
    jax.effects_barrier()
    (call,) = calls  # the layers are scanned: traced once, run once per layer
    assert call["dtype"] == jnp.bfloat16 and call["shape"][:2] == segments.shape
    assert len(runs) == config.num_hidden_layers
    for run in runs:
        _assert_runs(run, "packed")


def test_before_hopper_the_cudnn_path_gives_jax_its_mask_as_a_dense_operand(monkeypatch) -> None:
    """No packed layout before Hopper: jax.nn.dot_product_attention with implementation="cudnn"
    and the mask of each query's own segment, causal by position (written out here)."""
    calls = []

    def recorded(q, k, v, **kwargs):  # noqa: ANN001, ANN003, ANN202
        calls.append(kwargs)
        return jnp.zeros_like(q)

    monkeypatch.setattr(jax.nn, "dot_product_attention", recorded)
    monkeypatch.setattr(attention, "_packed_layout_supported", lambda: False)
    q, k, v, positions, segments = _packed_inputs()
    attention.cudnn_causal_attend(q, k, v, positions, segments)
    (call,) = calls
    assert call["implementation"] == "cudnn"
    assert call.get("bias") is None and not call.get("is_causal")
    seg, pos = np.asarray(segments), np.asarray(positions)
    want = (seg[:, None, :] == seg[:, :, None]) & (pos[:, None, :] <= pos[:, :, None])
    np.testing.assert_array_equal(np.asarray(call["mask"]), want[:, None])
    assert int(np.asarray(call["mask"])[0, 0, 6].sum()) == 2  # row 0, token 6: 2nd of segment 2
