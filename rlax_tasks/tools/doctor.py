"""`rlax doctor [--preset NAME | --config FILE]`: what this host gives a run, and whether it works.

It prints the platform JAX found with each device and its memory, then each job of the config
with its devices, mesh and attention kernel, then a self-check on this host's default devices: a
small model's logits against a NumPy float64 forward of its weights (tools/reference_forward),
one train step, one decode step, and the host<->device copy rate. Exit 2 names the checks that
failed."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from rlax_tasks.models import ModelConfig, Policy
from rlax_tasks.models.attention import default_implementation
from rlax_tasks.plan.placement import describe_devices, is_cpu_job, job_mesh, job_names
from rlax_tasks.rollout.sampler import Sampler
from rlax_tasks.tools.reference_forward import qwen2_logits
from rlax_tasks.utils.byte_sizes import format_bytes

# the self-check's model: a small Qwen2 (2 layers, 4 heads of 16, vocab 256)
CHECK_MODEL = ModelConfig(
    model_type="qwen2", vocab_size=256, hidden_size=64, intermediate_size=128,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    qkv_bias=True,
)  # fmt: skip
LOGITS_ATOL = 1e-3  # the devices' float32 (or TPU matmul passes) against float64
COPY_BYTES = 64 * 2**20


@dataclasses.dataclass
class Check:
    """One self-check's outcome: its name, whether it passed, and what it measured."""

    name: str
    ok: bool
    detail: str


def device_lines() -> list[str]:
    """The platform and each local device with its memory (the host's RAM for CPU devices)."""
    devices = jax.local_devices()
    lines = [f"platform {jax.default_backend()}: {len(devices)} local device(s), "
             f"{jax.device_count()} in all, process {jax.process_index()}"]  # fmt: skip
    for d in devices:
        stats = d.memory_stats() or {}
        memory = stats.get("bytes_limit")
        where = format_bytes(memory) if memory else "host memory"
        lines.append(f"  {d.id}: {d.device_kind} ({where})")
    return lines


def job_lines(cfg: Any) -> list[str]:
    """Each job of ``cfg``: its devices, (data, fsdp, tensor) mesh and attention kernel."""
    found = jax.default_backend()
    platform = found if cfg.placement.platform == "auto" else cfg.placement.platform
    lines = [f"jobs of {cfg.run_id} (placement {cfg.placement.mode}, platform "
             f"{cfg.placement.platform}, compute {cfg.model.dtype}):"]  # fmt: skip
    for job in job_names(cfg):
        if is_cpu_job(job):
            lines.append(f"  {job:<12} cpu (no accelerator)")
            continue
        mesh = job_mesh(cfg, job)
        kernel = default_implementation(platform, jnp.dtype(cfg.model.dtype))
        lines.append(
            f"  {job:<12} {describe_devices(cfg, job):<28} mesh "
            f"{'-' if mesh is None else ','.join(map(str, mesh)):<8} attention {kernel}"
        )
    if platform != found:
        lines.append(f"  (the placement's platform {platform} is not the {found} found here)")
    return lines


def _guarded(name: str, check: Callable[[], Check]) -> Check:
    """Runs ``check``; an exception is that check's failure, its first line the detail."""
    try:
        return check()
    except Exception as e:  # noqa: BLE001 - a failed check is reported, not raised
        return Check(name, False, f"{type(e).__name__}: {e}".splitlines()[0][:300])


def _logits_check(policy: Policy, ids: np.ndarray) -> Check:
    """The devices' logits against an independent NumPy float64 forward of the same weights
    (on a CPU host too, where JAX's CPU against itself would prove nothing)."""
    here = np.asarray(policy.logits(ids))
    ref = qwen2_logits(CHECK_MODEL, jax.device_get(policy.params), ids)
    diff = float(np.abs(here - ref).max())
    ok = bool(np.isfinite(here).all()) and diff <= LOGITS_ATOL
    return Check("logits", ok, f"max |{jax.default_backend()} - numpy float64| = {diff:.2e}")


def _train_check(policy: Policy, ids: np.ndarray) -> Check:
    optimizer = optax.adamw(1e-2)

    def loss(params: Any) -> jax.Array:
        return -policy.with_params(params).token_logprobs(ids).mean()

    params = policy.params
    state = optimizer.init(params)
    start = time.perf_counter()
    value, grads = jax.value_and_grad(loss)(params)
    updates, state = optimizer.update(grads, state, params)
    after = loss(optax.apply_updates(params, updates))
    seconds = time.perf_counter() - start
    ok = bool(jnp.isfinite(value)) and bool(after < value)
    return Check(
        "train step", ok, f"loss {float(value):.4f} -> {float(after):.4f} ({seconds:.1f}s)"
    )


def _decode_check(policy: Policy, ids: np.ndarray) -> Check:
    sampler = Sampler(policy, max_slots=2, max_len=32, precompile=False)
    start = time.perf_counter()
    (out,) = sampler.generate([ids[0].tolist()], max_new_tokens=4, temperature=0.0)
    seconds = time.perf_counter() - start
    greedy = int(np.asarray(policy.logits(ids[:1]))[0, -1].argmax())
    ok = len(out.tokens) == 4 and out.tokens[0] == greedy
    return Check(
        "decode step", ok, f"4 tokens {out.tokens}, first = greedy {greedy} ({seconds:.1f}s)"
    )


def _copy_check() -> Check:
    host = np.ones(COPY_BYTES, np.uint8)
    device = jax.local_devices()[0]
    jax.device_put(host[:1024], device).block_until_ready()  # the transfer path, warmed
    start = time.perf_counter()
    on_device = jax.device_put(host, device).block_until_ready()
    up = time.perf_counter() - start
    start = time.perf_counter()
    back = np.asarray(on_device)
    down = time.perf_counter() - start
    ok = bool(back[-1] == 1)
    gbs = lambda s: COPY_BYTES / max(s, 1e-9) / 1e9  # noqa: E731
    return Check("copy", ok, f"host->device {gbs(up):.1f} GB/s, device->host {gbs(down):.1f} GB/s")


def self_check(seed: int = 0) -> list[Check]:
    """The checks on this host's default devices, in order; each reports, none raises."""
    policy = Policy.init(CHECK_MODEL, seed=seed)
    ids = np.random.default_rng(seed).integers(3, CHECK_MODEL.vocab_size, size=(2, 12))
    return [
        _guarded("logits", lambda: _logits_check(policy, ids)),
        _guarded("train step", lambda: _train_check(policy, ids)),
        _guarded("decode step", lambda: _decode_check(policy, ids)),
        _guarded("copy", _copy_check),
    ]
