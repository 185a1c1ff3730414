"""A sampler's device state: the KV cache over its slots and their decode state (kernels'
``SlotState``), placed once as every later prefill and decode output is placed."""

from __future__ import annotations

from typing import Any

import jax

from rlax_tasks.models.kv_cache import cache_shardings, init_cache
from rlax_tasks.models.policy import Policy
from rlax_tasks.models.transformer import resolve_dtype
from rlax_tasks.rollout.held_weights import weights_device
from rlax_tasks.rollout.kernels import empty_state


def init_slot_cache(
    policy: Policy, max_slots: int, max_len: int, max_stop_ids: int
) -> tuple[Any, Any]:
    """An empty cache of ``max_slots`` slots of ``max_len`` entries and their slot state.

    Args:
      policy: the sampler's policy, its weights already placed (a mesh, or one device).
      max_slots: slots of the cache.
      max_len: cache entries per slot.
      max_stop_ids: stop ids a slot's state holds.

    Returns:
      (cache, state): committed buffers, so that the first call compiles the same program as
      all the others. On a mesh the cache is sharded (slots over data/fsdp, kv heads over
      tensor) and the small slot state replicated; without one, both live on the weights'
      device.
    """
    dtype = resolve_dtype(policy.dtype)  # the compute dtype: what attention reads
    build = lambda: init_cache(policy.config, max_slots, max_len, dtype)  # noqa: E731
    cache = jax.eval_shape(build)
    if policy.mesh is not None:
        place = jax.sharding.NamedSharding(policy.mesh, jax.sharding.PartitionSpec())
        cache_place = cache_shardings(cache, policy.mesh)
    else:
        place = jax.sharding.SingleDeviceSharding(weights_device(policy))
        cache_place = jax.tree.map(lambda _: place, cache)
    state = jax.device_put(empty_state(max_slots, max_stop_ids), place)
    return jax.jit(build, out_shardings=cache_place)(), state
