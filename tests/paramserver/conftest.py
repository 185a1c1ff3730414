"""Fixtures: an in-process parameter server (with a local mirror) and a client factory."""

from __future__ import annotations

import pytest

from rlax_tasks.paramserver import ParameterServer, ParameterServerClient, ServerConfig
from tests.paramserver.helpers import TOKEN


@pytest.fixture
def make_server(tmp_path):
    servers = []

    def make(**overrides) -> ParameterServer:
        kwargs = {"token": TOKEN, "run_root": str(tmp_path / "run"), "keep_versions": 2}
        kwargs.update(overrides)
        server = ParameterServer(ServerConfig(**kwargs)).start()
        servers.append(server)
        return server

    yield make
    for s in servers:
        s.stop()


@pytest.fixture
def server(make_server):
    return make_server()


@pytest.fixture
def client_for():
    clients = []

    def make(url: str, **kwargs) -> ParameterServerClient:
        kwargs.setdefault("token", TOKEN)
        kwargs.setdefault("timeout_s", 10.0)
        c = ParameterServerClient(url, **kwargs)
        clients.append(c)
        return c

    yield make
    for c in clients:
        c.close()
