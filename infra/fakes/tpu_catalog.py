"""The fake Cloud TPU API's own catalogue: which accelerator types exist, in which zones, booting
which runtime versions, as Google's documentation lists them ("TPU regions and zones", "TPU
software versions"), kept apart from the product's table (``rlax_tasks/compute/tpu_types.py``)
so that the fake refuses what the real API would even where the product is wrong."""

from __future__ import annotations

import dataclasses
import re


@dataclasses.dataclass(frozen=True)
class Generation:
    """One TPU generation as the API offers it."""

    prefix: str  # accelerator types are f"{prefix}-{size}"
    sizes: tuple[int, ...]  # the sizes the API accepts (TensorCores on v4/v5p, chips on v5e/v6e)
    cores_per_chip: int
    single_host_chips: tuple[int, ...]  # slices of these many chips are one VM
    zones: tuple[str, ...]
    runtime_versions: tuple[str, ...]

    def hosts(self, size: int) -> int:
        """The VMs of a slice of ``size``: one up to a host's chips, else 4 chips a VM."""
        chips = size // self.cores_per_chip
        return 1 if chips in self.single_host_chips else chips // 4

    def chips_per_host(self, size: int) -> int:
        """The chips each VM of a slice of ``size`` has."""
        return size // self.cores_per_chip // self.hosts(size)


def _powers(first: int, last: int) -> tuple[int, ...]:
    out, n = [], first
    while n <= last:
        out.append(n)
        n *= 2
    return tuple(out)


GENERATIONS = (
    Generation(
        "v4", _powers(8, 4096), 2, (4,), ("us-central2-b",),
        ("tpu-ubuntu2204-base", "tpu-vm-v4-base", "tpu-vm-v4-pt-2.0"),
    ),
    Generation(
        "v5p", _powers(8, 8192), 2, (4,), ("us-central1-a", "us-east5-a", "europe-west4-b"),
        ("v2-alpha-tpuv5",),
    ),
    Generation(
        "v5litepod", (1, 4, 8, 16, 32, 64, 128, 256), 1, (1, 4, 8),
        ("us-central1-a", "us-east1-c", "us-east5-b", "us-south1-a", "us-west1-c", "us-west4-a",
         "europe-west4-b", "asia-southeast1-b"),
        ("v2-alpha-tpuv5-lite",),
    ),
    Generation(
        "v6e", (1, 4, 8, 16, 32, 64, 128, 256), 1, (1, 4, 8),
        ("us-central1-b", "us-east1-d", "us-east5-a", "us-east5-b", "us-south1-a",
         "europe-west4-a", "asia-northeast1-b", "southamerica-east1-c"),
        ("v2-alpha-tpuv6e",),
    ),
)  # fmt: skip


# a host's chip grid (libtpu's CHIPS_PER_HOST_BOUNDS) by its number of chips
CHIP_BOUNDS = {1: (1, 1, 1), 4: (2, 2, 1), 8: (2, 4, 1)}


def tpu_env(accelerator_type: str, worker: int) -> str:
    """The ``tpu-env`` metadata attribute of host ``worker`` of a node (as TPU VMs serve it:
    ``KEY: 'value'`` lines): its type, its host's chip grid, the slice's grid of hosts (stacked
    along z in the fake), its worker id."""
    gen, size = _generation(accelerator_type)
    hosts, chips = gen.hosts(size), gen.chips_per_host(size)
    values = {
        "ACCELERATOR_TYPE": accelerator_type,
        "CHIPS_PER_HOST_BOUNDS": ",".join(map(str, CHIP_BOUNDS[chips])),
        "HOST_BOUNDS": f"1,1,{hosts}",
        "WORKER_ID": str(worker),
    }
    return "".join(f"{k}: '{v}'\n" for k, v in values.items())


def _generation(accelerator_type: str) -> tuple[Generation, int]:
    m = re.fullmatch(r"([a-z0-9]+)-(\d+)", accelerator_type or "")
    gen = next((g for g in GENERATIONS if m and g.prefix == m[1]), None)
    if gen is None or int(m[2]) not in gen.sizes:
        raise Refused(f"Invalid accelerator type: {accelerator_type!r}")
    return gen, int(m[2])


class Refused(ValueError):
    """A node the real API would refuse (INVALID_ARGUMENT); the message as it says it."""


def check_node(accelerator_type: str, zone: str, runtime_version: str) -> int:
    """The hosts (VMs) of a node of ``accelerator_type`` in ``zone`` booting
    ``runtime_version``; Refused when the API has no such type, not in that zone, or the runtime
    does not boot on it."""
    gen, size = _generation(accelerator_type)
    if zone not in gen.zones:
        raise Refused(
            f"Accelerator type {accelerator_type} is not available in zone {zone} (offered in "
            f"{', '.join(gen.zones)})"
        )
    if runtime_version not in gen.runtime_versions:
        raise Refused(
            f"Runtime version {runtime_version!r} is not supported for accelerator type "
            f"{accelerator_type} (supported: {', '.join(gen.runtime_versions)})"
        )
    return gen.hosts(size)
