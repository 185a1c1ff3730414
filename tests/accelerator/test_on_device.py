"""Checks that only mean something on a GPU or a TPU (marked `accelerator`; skipped on a CPU-only
host, where CI runs): the platform's attention kernel against the XLA reference, and a small
model's bfloat16 logits and greedy tokens against float32 on the CPU.
`scripts/device_check.sh` runs them on an accelerator host (JAX_PLATFORMS unset)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_tasks.models import Policy
from rlax_tasks.models.attention import causal_self_attend, default_implementation
from rlax_tasks.models.forward import positions_from_mask, positions_from_segments
from rlax_tasks.rollout import Sampler
from tests.tiny_model import tiny_model_config

ON_ACCELERATOR = jax.default_backend() in ("gpu", "tpu")
pytestmark = [
    pytest.mark.accelerator,
    pytest.mark.skipif(not ON_ACCELERATOR, reason="needs a GPU or a TPU (JAX found the CPU)"),
]


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("length", [128, 1000])
def test_the_platforms_attention_kernel_matches_the_xla_reference(length, layout):
    """cuDNN's packed layout (Hopper) or the mask as a bias, splash on TPU: padded rows and
    packed training rows."""
    kernel = default_implementation(jax.default_backend(), jnp.bfloat16)
    assert kernel in ("cudnn", "splash")
    rng = np.random.default_rng(0)
    b, h, kv, d = 2, 8, 2, 128
    q = jnp.asarray(rng.standard_normal((b, length, h, d)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((b, length, kv, d)), jnp.bfloat16) for _ in "kv")
    if layout == "padded":
        valid = np.ones((b, length), bool)
        valid[0, : length // 4] = False  # a left-padded prompt
        valid[1, length - 7 :] = False  # a right-padded completion
        positions = positions_from_mask(jnp.asarray(valid))
    else:  # sequences of the packer's rows: segments 1, 2, ..., then padding
        cuts = np.sort(rng.choice(np.arange(1, length - 5), size=6, replace=False))
        valid = np.zeros((b, length), np.int32)
        for i, (start, end) in enumerate(zip([0, *cuts[:-1]], cuts, strict=True)):
            valid[0, start:end] = i + 1
        valid[1, : length // 2] = 1
        positions = positions_from_segments(jnp.asarray(valid))
    valid = jnp.asarray(valid)
    out = causal_self_attend(q, k, v, positions, valid, implementation=kernel)
    ref = causal_self_attend(q, k, v, positions, valid, implementation="xla")
    keep = (np.asarray(valid) > 0)[..., None, None]
    diff = np.abs(np.asarray(out, np.float32) - np.asarray(ref, np.float32)) * keep
    assert diff.max() < 2e-2, (kernel, diff.max())

    # and the gradients training takes through it
    def loss(impl, q, k, v):  # noqa: ANN001, ANN202
        out = causal_self_attend(q, k, v, positions, valid, implementation=impl)
        return (out.astype(jnp.float32) * jnp.asarray(keep)).sum()

    grads = jax.grad(lambda *a: loss(kernel, *a), argnums=(0, 1, 2))(q, k, v)
    ref_grads = jax.grad(lambda *a: loss("xla", *a), argnums=(0, 1, 2))(q, k, v)
    for name, g, r in zip("qkv", grads, ref_grads, strict=True):
        g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
        assert np.abs(g - r).max() < 5e-2 * np.abs(r).max(), (kernel, name)


def _top2_margin(logits: np.ndarray) -> np.ndarray:
    top2 = np.sort(logits, axis=-1)[..., -2:]
    return top2[..., 1] - top2[..., 0]


def test_bfloat16_logits_match_float32_on_the_cpu_and_decoding_matches_the_forward():
    config = tiny_model_config("wide", vocab_size=256)
    policy = Policy.init(config, seed=0)
    policy = policy.with_params(jax.tree.map(lambda a: a * 4.0, policy.params))  # peaked
    ids = np.random.default_rng(1).integers(3, 256, size=(2, 24))
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        ref = np.asarray(policy.with_params(jax.device_put(policy.params, cpu)).logits(ids))
    bf16 = Policy.init(config, dtype="bfloat16", seed=0).with_params(policy.params)
    logits = np.asarray(bf16.logits(ids))
    # bfloat16 keeps 8 bits of mantissa: a few percent of the largest logit (CPU: 0.49 of 10.2)
    diff = np.abs(logits - ref).max()
    assert diff < 0.06 * np.abs(ref).max(), diff
    clear = _top2_margin(ref) > 2 * diff  # choices bfloat16 rounding cannot flip
    assert clear.sum() >= 4 and (logits.argmax(-1) == ref.argmax(-1))[clear].all(), clear.sum()

    # the sampler's decode kernel on the device agrees with the device's own forward pass
    (out,) = Sampler(bf16, max_slots=2, max_len=64).generate(
        [list(ids[0])], max_new_tokens=8, temperature=0.0, ignore_eos=True
    )
    full = np.asarray([list(ids[0]) + out.tokens])
    forward = np.asarray(bf16.logits(full))[0, len(ids[0]) - 1 : -1]
    sure = _top2_margin(forward) > 0.25
    assert (forward.argmax(-1) == np.asarray(out.tokens))[sure].all(), (forward.argmax(-1), out)
