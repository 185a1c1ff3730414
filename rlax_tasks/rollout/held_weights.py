"""Copies of a policy's weights that a sampler keeps in the layouts its decode reads fastest.

Each decoder layer's weights as arrays of their own (unless workers.decode_layer_copies is false,
on an accelerator): a decode step reads a layer's slice of the stacked weights through a copy
first (XLA reads no slice in place), which triples the weights' traffic of a memory-bound step
(benchmarks/traffic.py). A tied embedding's transpose only on a CPU without a mesh, whose dot
reads it transposed through a copy."""

from __future__ import annotations

from typing import NamedTuple

import jax
from flax import nnx

from rlax_tasks.models.policy import Policy

_UNEMBEDDING = jax.jit(
    lambda graphdef, params: nnx.merge(graphdef, params).unembedding(), static_argnums=0
)
_UNSTACK_LAYERS = jax.jit(
    lambda graphdef, params: nnx.merge(graphdef, params).unstack_layers(), static_argnums=0
)


class HeldWeights(NamedTuple):
    """A sampler's copies of weights (``held_weights``); None where it uses the policy's own."""

    unembedding: jax.Array | None  # [D, V] (``held_unembedding``)
    layers: tuple[nnx.State, ...] | None  # each decoder layer's own arrays (``held_layers``)

    def delete(self) -> None:
        """Frees the copies' device buffers (before new weights are placed)."""
        for a in jax.tree.leaves(tuple(self)):
            a.delete()


def weights_device(policy: Policy) -> jax.Device:
    """The device a policy's weights are on (one of them when sharded)."""
    return next(iter(jax.tree.leaves(policy.params)[0].devices()))


def _holds_copies(policy: Policy) -> bool:
    """Whether a sampler keeps decode-layout copies of ``policy``'s weights: on a CPU without a
    mesh (where they were measured to pay); accelerators keep the one copy."""
    return policy.mesh is None and weights_device(policy).platform == "cpu"


def held_weights(policy: Policy, layers: bool = True) -> HeldWeights:
    """The copies a sampler of ``policy`` holds (``HeldWeights``); ``layers``: the layers' too
    (``held_layers``; on a CPU without a mesh always, where they cost little and pay most)."""
    keep_layers = layers or _holds_copies(policy)
    return HeldWeights(held_unembedding(policy), held_layers(policy) if keep_layers else None)


def held_layers(policy: Policy) -> tuple[nnx.State, ...]:
    """Each decoder layer's weights as arrays of their own, run one after the other by decode
    (sharded as the stacked ones are). A slice of the stacked weights is copied before a product
    reads it, at every token; this costs one more copy of the layer weights in memory (the
    memory plan's ``decode_layers``) and a decode program unrolled over the layers."""
    with policy._scope():
        return _UNSTACK_LAYERS(policy.graphdef, policy.params)


def held_unembedding(policy: Policy) -> jax.Array | None:
    """The [D, V] output projection a sampler keeps, or None (the model's): a transposed copy of
    a tied [V, D] embedding, which XLA:CPU's dot otherwise reads transposed at every token, for
    V x D more memory. Untied models hold their lm head as [D, V] already."""
    if not policy.config.tie_word_embeddings or not _holds_copies(policy):
        return None
    with policy._scope():
        return _UNEMBEDDING(policy.graphdef, policy.params)
