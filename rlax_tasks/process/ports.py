"""Ports a process can listen on: free when drawn and below the kernel's ephemeral range, where
no outgoing connection takes one before its listener binds it (`rlax run`'s services, a
multi-host job's coordinator on a Ray node)."""

from __future__ import annotations

import random
import socket
from collections.abc import Sequence

# where the kernel takes the local ports of outgoing connections (Linux's default when unread)
EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
DEFAULT_EPHEMERAL_RANGE = (32768, 60999)
LOWEST_PORT = 10000  # listening ports are drawn from here up to the ephemeral range


def ephemeral_range() -> tuple[int, int]:
    """The (first, last) port the kernel gives outgoing connections."""
    try:
        with open(EPHEMERAL_RANGE_FILE) as f:
            first, last = (int(x) for x in f.read().split())
        return first, last
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL_RANGE


def free_port(host: str = "127.0.0.1", taken: Sequence[int] = ()) -> int:
    """A port free now, not one of ``taken``, that no outgoing connection will take before a
    component listens on it: drawn below the kernel's ephemeral range, since a run's own
    connections took ``bind(0)``'s ports before its worker listened ("Address already in use").
    Falls back to ``bind(0)`` when the range leaves no room below it."""
    first, _ = ephemeral_range()
    if first - LOWEST_PORT >= 1000:
        rng = random.SystemRandom()
        for _ in range(200):
            port = rng.randrange(LOWEST_PORT, first)
            if port in taken:
                continue
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:  # something listens there (or holds it): another draw
                    continue
            return port
    while True:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in taken:
            return port
