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


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_the_cudnn_path_passes_cudnn_its_packed_layout(layout, monkeypatch) -> None:  # noqa: ANN001
    """What cudnn_causal_attend hands JAX's cuDNN attention on a Hopper GPU, checked on this CPU:
    the causal mask over each row's runs (PADDING_CAUSAL), 1/sqrt(head_dim), the same runs for
    queries and keys; computed with cuDNN's semantics over those arguments, every valid query
    gets ``attend``'s output."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    calls = []

    def recorded(q, k, v, **kwargs):  # noqa: ANN001, ANN003, ANN202
        calls.append(kwargs)
        scale = kwargs["scale"] * q.shape[-1] ** 0.5  # the oracle scales by 1/sqrt(hd) itself
        return jnp.asarray(_cudnn_packed(q * scale, k, v, kwargs["q_seqlen"], kwargs["q_offsets"]))

    monkeypatch.setattr(cudnn, "dot_product_attention", recorded)
    monkeypatch.setattr(attention, "_packed_layout_supported", lambda: True)
    q, k, v, positions, valid = _inputs(40, jnp.float32) if layout == "padded" else _packed_inputs()
    out = attention.cudnn_causal_attend(q, k, v, positions, valid)
    (call,) = calls
    assert call["mask_type"] == cudnn.MaskType.PADDING_CAUSAL
    assert call["scale"] == pytest.approx(q.shape[-1] ** -0.5)
    lengths, offsets = attention.valid_runs(valid, attention.max_runs(valid))
    for name, want in (("q_seqlen", lengths), ("kv_seqlen", lengths), ("q_offsets", offsets),
                       ("kv_offsets", offsets)):  # fmt: skip
        np.testing.assert_array_equal(np.asarray(call[name]), np.asarray(want), err_msg=name)
    reference = attention.attend(q, k, v, positions, positions, valid, valid)
    rows = np.asarray(valid) > 0
    assert np.abs(np.asarray(out) - np.asarray(reference))[rows].max() <= 1e-5
