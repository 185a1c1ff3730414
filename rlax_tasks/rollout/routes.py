"""A completion's recorded expert routes (docs/design.md §14), compact on every hand-off: per
generated token, per MoE layer, the top-k expert ids the sampler used, as int16 (-1: the token
was never fed back, e.g. the last one). JSON carries them as base64 of the little-endian bytes,
Parquet as the bytes with their [layers, k] shape."""

from __future__ import annotations

import base64
import binascii
import dataclasses
from typing import Any

import numpy as np

DTYPE = np.dtype("<i2")


@dataclasses.dataclass(frozen=True)
class RoutedExperts:
    """[tokens, layers, k] int16 expert ids, held as bytes (hashable, compared by value)."""

    shape: tuple[int, int, int]
    data: bytes

    @classmethod
    def of(cls, routes: np.ndarray) -> RoutedExperts:
        """The record of a [tokens, layers, k] array of expert ids (-1: none)."""
        routes = np.asarray(routes)
        if routes.ndim != 3:
            raise ValueError(f"routed experts must be [tokens, layers, k], got {routes.shape}")
        return cls(tuple(int(n) for n in routes.shape), routes.astype(DTYPE).tobytes())

    @property
    def tokens(self) -> int:
        return self.shape[0]

    def array(self) -> np.ndarray:
        """The [tokens, layers, k] int16 array."""
        return np.frombuffer(self.data, DTYPE).reshape(self.shape)

    def to_json(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "int16": base64.b64encode(self.data).decode("ascii")}

    @classmethod
    def from_json(cls, d: Any, tokens: int, where: str) -> RoutedExperts:
        """From ``to_json``, checked against the completion's ``tokens``: ValueError naming
        ``where`` and what is wrong."""
        if not isinstance(d, dict) or set(d) != {"shape", "int16"}:
            raise ValueError(f"{where}: routed_experts must be {{'shape', 'int16'}}, got {d!r}")
        shape = d["shape"]
        if (
            not isinstance(shape, list)
            or len(shape) != 3
            or not all(isinstance(n, int) and n >= 0 for n in shape)
        ):
            raise ValueError(f"{where}: routed_experts.shape must be [tokens, layers, k]")
        if shape[0] != tokens:
            raise ValueError(
                f"{where}: routed_experts holds {shape[0]} tokens, the completion {tokens}"
            )
        try:
            data = base64.b64decode(d["int16"], validate=True)
        except (binascii.Error, TypeError, ValueError) as e:
            raise ValueError(f"{where}: routed_experts.int16 is not base64 ({e})") from e
        if len(data) != int(np.prod(shape)) * DTYPE.itemsize:
            raise ValueError(f"{where}: routed_experts holds {len(data)} bytes for shape {shape}")
        return cls((shape[0], shape[1], shape[2]), data)


def record_of(routes: np.ndarray | None) -> RoutedExperts | None:
    """``RoutedExperts.of`` of an array, None for None (a dense model's completion)."""
    return None if routes is None else RoutedExperts.of(routes)


def array_of(record: RoutedExperts | None) -> np.ndarray | None:
    """The array of a record (a writable copy), None for None."""
    return None if record is None else record.array().copy()
