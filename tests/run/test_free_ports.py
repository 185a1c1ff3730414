"""The ports `rlax run` gives its services: free when drawn, distinct, and below the kernel's
ephemeral range, where no outgoing connection of the run can take one before its service
listens (a worker once failed with "cannot listen on 127.0.0.1:38491: Address already in use")."""

from __future__ import annotations

import socket

import pytest

from rlax_tasks.config import load_config
from rlax_tasks.plan.topology import free_ports
from rlax_tasks.process import ports as port_draws
from rlax_tasks.process.ports import free_port


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_the_services_ports_are_distinct_free_and_below_the_ephemeral_range():
    cfg = load_config("tiny-arith", {"placement.mode": "disaggregated", "workers.count": 6})
    first, _ = port_draws.ephemeral_range()
    ports = free_ports(cfg)
    every = [ports.ps, ports.trainer, ports.coordinator, *ports.workers]
    assert len(every) == 9 and len(set(every)) == 9
    assert all(port_draws.LOWEST_PORT <= p < first for p in every), (every, first)
    assert all(_bindable(p) for p in every)


def test_the_ephemeral_range_is_the_kernels(tmp_path, monkeypatch):
    path = tmp_path / "ip_local_port_range"
    path.write_text("40000\t50000\n")
    monkeypatch.setattr(port_draws, "EPHEMERAL_RANGE_FILE", str(path))
    assert port_draws.ephemeral_range() == (40000, 50000)
    path.write_text("garbage")
    assert port_draws.ephemeral_range() == port_draws.DEFAULT_EPHEMERAL_RANGE
    monkeypatch.setattr(port_draws, "EPHEMERAL_RANGE_FILE", str(tmp_path / "missing"))
    assert port_draws.ephemeral_range() == port_draws.DEFAULT_EPHEMERAL_RANGE


class Draws:
    """Stands in for random.SystemRandom: hands out the given ports in order."""

    def __init__(self, ports: list[int]) -> None:
        self.ports = ports

    def __call__(self) -> Draws:
        return self

    def randrange(self, low: int, high: int) -> int:
        port = self.ports.pop(0)
        assert low <= port < high
        return port


def test_a_port_in_use_or_already_given_is_drawn_again(monkeypatch):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        used = busy.getsockname()[1]
        monkeypatch.setattr(port_draws, "ephemeral_range", lambda: (65000, 65535))
        monkeypatch.setattr(port_draws, "LOWEST_PORT", 1024)
        free = next(p for p in range(20011, 30000, 7) if p != used and _bindable(p))
        monkeypatch.setattr(port_draws.random, "SystemRandom", Draws([used, 20004, free]))
        assert free_port(taken=[20004]) == free


def test_no_room_below_the_range_falls_back_to_any_free_port(monkeypatch):
    monkeypatch.setattr(port_draws, "ephemeral_range", lambda: (1024, 65535))
    monkeypatch.setattr(port_draws.random, "SystemRandom", Draws([]))  # never drawn from
    port = free_port()
    assert port > 0 and _bindable(port)


@pytest.mark.skipif(not hasattr(socket, "SO_REUSEADDR"), reason="POSIX sockets")
def test_an_outgoing_connection_never_gets_a_drawn_port():
    """What the draw avoids: the local port of a connection comes from the ephemeral range."""
    first, last = port_draws.ephemeral_range()
    with socket.socket() as server:
        server.bind(("127.0.0.1", free_port()))
        server.listen()
        with socket.create_connection(server.getsockname()) as client:
            assert first <= client.getsockname()[1] <= last
