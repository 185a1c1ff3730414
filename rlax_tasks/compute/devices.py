"""Devices and the run's layout on them: platforms, placement modes, accelerator models and
mesh shapes (docs/design.md §12).

The run configuration validates its ``placement`` against these names and the launchers turn it
into each job's environment (rlax_tasks/plan/placement.py, which re-exports them). No JAX."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from rlax_tasks.utils.byte_sizes import GiB, MiB

PLATFORMS = ("auto", "cpu", "gpu", "tpu")
MODES = ("disaggregated", "colocated")


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """One accelerator model: its platform and the memory of one device (bytes)."""

    name: str
    platform: str
    memory: int


# Device memory as the runtime reports it (nvidia-smi's MiB for GPUs, HBM per chip for TPUs).
ACCELERATORS: dict[str, Accelerator] = {
    a.name: a
    for a in (
        Accelerator("a100-40gb", "gpu", 40_960 * MiB),
        Accelerator("a100-80gb", "gpu", 81_920 * MiB),
        Accelerator("h100-80gb", "gpu", 81_559 * MiB),
        Accelerator("h200", "gpu", 143_771 * MiB),
        Accelerator("v4", "tpu", 32 * GiB),
        Accelerator("v5e", "tpu", 16 * GiB),
        Accelerator("v5p", "tpu", 95 * GiB),
        Accelerator("v6e", "tpu", 32 * GiB),
    )
}

# chips of one process on a TPU host → TPU_CHIPS_PER_PROCESS_BOUNDS (x,y,z): a box of the host's
# chip grid (2x2 on v4/v5p hosts, 2x4 on v5e/v6e hosts)
TPU_CHIP_BOUNDS = {1: "1,1,1", 2: "1,2,1", 4: "2,2,1", 8: "2,4,1"}


def host_memory() -> int:
    """RAM of this machine (bytes)."""
    import psutil

    return int(psutil.virtual_memory().total)


def resolve_mesh(shape: Sequence[int], devices: int) -> tuple[int, ...]:
    """(data, fsdp[, expert], tensor) over ``devices`` devices, the one -1 entry filled in; a
    mesh that does not use exactly those devices is a ValueError saying why."""
    sizes = list(shape)
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if devices % known:
            raise ValueError(f"{devices} device(s) do not split into mesh {list(shape)}")
        sizes[sizes.index(-1)] = devices // known
    if math.prod(sizes) != devices:
        raise ValueError(
            f"mesh {list(shape)} uses {math.prod(sizes)} device(s), the job has {devices}"
        )
    return tuple(sizes)
