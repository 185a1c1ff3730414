"""The traffic model of a compiled program (benchmarks/_hlo_traffic.py) on programs whose bytes
and FLOPs are known by hand, and the traffic benchmark's decode against its ideal."""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import pytest

from tests.conftest import REPO

sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import _hlo_traffic  # noqa: E402
import traffic  # noqa: E402


def _ops(fn, *args, donate=()):
    return _hlo_traffic.operations(
        jax.jit(fn, donate_argnums=donate).lower(*args).compile().as_text()
    )


def test_a_product_reads_its_operands_and_writes_its_result_once():
    x, w = jnp.ones((64, 512)), jnp.ones((512, 1024))
    ops = _ops(lambda x, w: x @ w, x, w)
    assert sum(o.bytes for o in ops) == 4 * (64 * 512 + 512 * 1024 + 64 * 1024)
    assert sum(o.flops for o in ops) == 2 * 64 * 512 * 1024


def test_a_loops_operations_count_once_per_trip():
    def layers(x, ws):
        return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0]

    x, ws = jnp.ones((16, 256)), jnp.ones((6, 256, 256))
    ops = _ops(layers, x, ws)
    assert sum(o.flops for o in ops) == 6 * 2 * 16 * 256 * 256
    assert max(o.count for o in ops) == 6
    # every layer's weights are read at least once
    assert sum(o.bytes for o in ops) >= ws.size * 4


def test_an_update_in_place_moves_the_update_not_the_buffer():
    buf, row = jnp.zeros((1024, 1024)), jnp.ones((1, 1024))
    ops = _ops(lambda b, r, i: jax.lax.dynamic_update_slice(b, r, (i, 0)), buf, row,
               jnp.int32(3), donate=(0,))  # fmt: skip
    assert sum(o.bytes for o in ops) <= 4 * 4 * 1024  # the row read and written, not 4 MiB


@pytest.mark.parametrize("filled", [2048, 1100])
def test_decode_moves_at_most_1_3x_the_bytes_of_the_entries_it_reads(filled):
    """One decode step of Qwen2.5-1.5B shapes at 64 slots and a 2k cache: every weight once, the
    KV cache once, the logits; the rest is the program's waste. Full, it reads what it must;
    1100 entries filled, its window (1536) would be read through a copy: it reads every entry
    in place instead (``decode_window``), at most 1.3x the bytes of a full cache."""
    config = traffic.model_config("qwen2.5-1.5b")
    compiled, ideal = traffic.decode_program(config, 64, 2048, filled)
    c = config
    kv_entry = 64 * 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4
    fixed = c.num_parameters() * 4 + 64 * c.vocab_size * 4  # the weights and the logits
    assert ideal == fixed + filled * kv_entry
    row = traffic.measure("decode", compiled, ideal, 8, compute_bound=False)
    reads = fixed + 2048 * kv_entry  # every entry, once
    assert row["bytes"] <= 1.3 * reads, [
        (o["kind"], o["op_name"][-60:], o["share"]) for o in row["top"]
    ]
