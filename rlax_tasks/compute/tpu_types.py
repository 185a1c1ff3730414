"""Cloud TPU accelerator types: chips, hosts and the default runtime of each (no JAX, no client).

``tpu_type("v5litepod-16")`` → ``TpuType(family="v5e", chips=16, hosts=4, ...)``. Names follow
the Cloud TPU API: v4 and v5p count TensorCores (2 per chip), v5e and v6e count chips. The one
place for these numbers: the DAGs' checks, the fake Cloud TPU API and the topology planner."""

from __future__ import annotations

import dataclasses
import re


@dataclasses.dataclass(frozen=True)
class TpuType:
    """One accelerator type: its family, chips, hosts and the runtime it boots by default."""

    name: str
    family: str
    chips: int
    hosts: int
    chips_per_host: int
    runtime_version: str


@dataclasses.dataclass(frozen=True)
class _Family:
    prefix: str  # the accelerator type is f"{prefix}-{n}"
    family: str
    cores_per_chip: int  # 2: n counts TensorCores (v4, v5p); 1: n counts chips
    single_host_chips: tuple[int, ...]  # chip counts that fit one host
    multi_host_chips_per_host: int  # chips of each host of a multi-host slice
    runtime_version: str  # the TPU VM image Google documents for JAX on this family


FAMILIES = (
    _Family("v4", "v4", 2, (4,), 4, "tpu-ubuntu2204-base"),
    _Family("v5p", "v5p", 2, (4,), 4, "v2-alpha-tpuv5"),
    _Family("v5litepod", "v5e", 1, (1, 4, 8), 4, "v2-alpha-tpuv5-lite"),
    _Family("v6e", "v6e", 1, (1, 4, 8), 4, "v2-alpha-tpuv6e"),
)
_TYPE_RE = re.compile(r"^(?P<prefix>[a-z0-9]+)-(?P<n>\d+)$")


class UnknownAcceleratorError(ValueError):
    """An accelerator type this table does not know (the message lists the families)."""


def tpu_type(accelerator_type: str) -> TpuType:
    """The chips, hosts and default runtime of ``accelerator_type`` (e.g. "v4-16")."""
    m = _TYPE_RE.match(accelerator_type or "")
    family = next((f for f in FAMILIES if m and f.prefix == m.group("prefix")), None)
    if m is None or family is None:
        known = ", ".join(f"{f.prefix}-N" for f in FAMILIES)
        raise UnknownAcceleratorError(
            f"accelerator type {accelerator_type!r} is not a Cloud TPU type RLAX knows ({known})"
        )
    n = int(m.group("n"))
    if n % family.cores_per_chip or n == 0:
        raise UnknownAcceleratorError(
            f"accelerator type {accelerator_type!r}: {family.prefix} sizes count TensorCores "
            f"({family.cores_per_chip} per chip), e.g. {family.prefix}-8, {family.prefix}-16"
        )
    chips = n // family.cores_per_chip
    if chips in family.single_host_chips:
        hosts, per_host = 1, chips
    elif chips % family.multi_host_chips_per_host == 0 and chips > max(family.single_host_chips):
        per_host = family.multi_host_chips_per_host
        hosts = chips // per_host
    else:
        raise UnknownAcceleratorError(
            f"accelerator type {accelerator_type!r} is not a valid {family.family} slice size"
        )
    return TpuType(accelerator_type, family.family, chips, hosts, per_host, family.runtime_version)


def default_runtime_version(accelerator_type: str) -> str:
    """The runtime version a slice of ``accelerator_type`` boots when none is given."""
    return tpu_type(accelerator_type).runtime_version


def slice_hosts(accelerator_type: str) -> int:
    """Hosts of a slice: 1 for "cpu" (a local slice), else from the Cloud TPU type."""
    if accelerator_type == "cpu":
        return 1
    return tpu_type(accelerator_type).hosts
