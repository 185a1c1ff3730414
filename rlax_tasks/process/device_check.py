"""A JAX job checks the devices it got against its placement (docs/design.md §12), so a GPU or TPU
run that found only the CPU stops at start with one line instead of training on the CPU silently.

The launchers put what the placement names in the job's environment (``expectation_env``); the
job compares it with what JAX found (``check_job_devices``). Importable without JAX."""

from __future__ import annotations

import os
from collections.abc import Mapping

# "<platform> <device count>" (count "any": the platform's default devices), set by job_env
EXPECTED_ENV = "RLAX_EXPECTED_DEVICES"

# what to do when JAX did not find a platform the placement names
REMEDY = {
    "gpu": "install the CUDA plugin (bash scripts/setup.sh --gpu) on a host with NVIDIA GPUs, "
    "or set placement.platform: cpu",
    "tpu": "install libtpu (bash scripts/setup.sh --tpu) and run on a TPU VM, "
    "or set placement.platform: cpu",
    "cpu": "set placement.platform to the accelerator's platform (gpu or tpu), or auto",
}


class DeviceMismatch(ValueError):
    """JAX's platform or local device count is not what the job's placement names."""


def expectation_env(platform: str, count: int | None) -> dict[str, str]:
    """The variable that tells a job what its placement names (``platform`` auto: nothing)."""
    if platform == "auto":
        return {}
    return {EXPECTED_ENV: f"{platform} {'any' if count is None else count}"}


def check_devices(job: str, expected: str, platform: str, count: int) -> None:
    """Raises DeviceMismatch when ``platform`` / ``count`` (what JAX found) differ from
    ``expected`` ("<platform> <count|any>"); the message says what was found, what the
    placement says, and what to install or change."""
    want_platform, _, want_count = expected.partition(" ")
    found = f"JAX found {platform} with {count} device{'s' if count != 1 else ''}"
    if platform != want_platform:
        raise DeviceMismatch(
            f"{job}: placement.platform is {want_platform} but {found}: "
            f"{REMEDY.get(want_platform, 'check placement.platform')}"
        )
    if want_count not in ("", "any") and int(want_count) != count:
        raise DeviceMismatch(
            f"{job}: its placement gives it {want_count} {platform} device(s) on this host but "
            f"{found}: make the job's device list in placement match the host's devices, or "
            "check CUDA_VISIBLE_DEVICES / TPU_VISIBLE_CHIPS / XLA_FLAGS set outside RLAX"
        )


# the names JAX's GPU plugins register under (the platform its clients report is "gpu")
_PLUGIN_PLATFORMS = {"cuda": "gpu", "rocm": "gpu"}


def found_platform() -> str:
    """The platform JAX chose for this process: the name its default backend was loaded under
    (what JAX_PLATFORMS names: "cpu", "tpu", "cuda"/"rocm" as "gpu"), so a runtime that stands
    in for one (the fake Cloud TPU's libtpu) counts as it."""
    import jax
    from jax.extend import backend

    default = backend.get_backend()
    for name, client in backend.backends().items():
        if client is default:
            return _PLUGIN_PLATFORMS.get(name, name)
    return jax.default_backend()


def check_job_devices(job: str, environ: Mapping[str, str] | None = None) -> None:
    """Checks this process's JAX devices against its placement (nothing to check when the
    launcher set no expectation). Call it after jax.distributed.initialize, if any."""
    expected = (os.environ if environ is None else environ).get(EXPECTED_ENV)
    if not expected:
        return
    import jax  # only in the JAX jobs that call this

    check_devices(job, expected, found_platform(), jax.local_device_count())
