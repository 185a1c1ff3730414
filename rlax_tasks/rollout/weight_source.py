"""Where an inference worker's weights come from (docs/design.md §6): the parameter server's
client, or fixed weights (an evaluation, a test)."""

from __future__ import annotations

from typing import Any, Protocol

from flax import nnx


class WeightSource(Protocol):
    """Where weights come from: ``ParameterServerClient`` satisfies it (docs/design.md §6). A source
    with ``fresh_arrays = True`` pulls new device arrays already in the sampler's dtype and
    placement, which the sampler takes over without a copy (a colocated run's
    ``TrainerWeights``)."""

    def latest_version(self) -> int | None: ...

    def pull(self, min_version: int | None = None, *, like: Any = None) -> tuple[int, Any]: ...

    def ack(self, version: int) -> None: ...


class FixedWeights:
    """A weight source that never changes: the policy's own weights as version ``version``."""

    def __init__(self, params: nnx.State, version: int = 0) -> None:
        self.params, self.version = params, version

    def latest_version(self) -> int:
        return self.version

    def pull(self, min_version: int | None = None, *, like: Any = None) -> tuple[int, Any]:
        if min_version is not None and min_version > self.version:
            raise ValueError(f"fixed weights are version {self.version}, not >= {min_version}")
        return self.version, self.params

    def ack(self, version: int) -> None:
        pass
