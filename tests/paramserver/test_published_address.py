"""A parameter server reached through the address it published (services.endpoints), as on
slices: its clients follow it when it restarts elsewhere (a re-provisioned slice)."""

from __future__ import annotations

import numpy as np
import pytest

from rlax_tasks.paramserver import ServerUnavailableError
from rlax_tasks.services import endpoints


def _params(version: int) -> dict[str, np.ndarray]:
    return {"w": np.full((8, 16), version, np.float32)}


def test_a_client_follows_the_server_to_its_new_address(make_server, client_for, tmp_path):
    path = endpoints.service_file(str(tmp_path / "run"), "ps")
    client = client_for(path, timeout_s=2.0, retries=0)
    with pytest.raises(ServerUnavailableError, match="published"):  # nothing published yet
        client.latest_version()

    first = make_server(run_root=str(tmp_path / "run"))
    endpoints.publish(path, first.address)
    client.push(1, _params(1))
    assert client.latest_version() == 1 and client.url == first.address

    # the PS "moves": its slice was re-provisioned; it restores the mirror on a new address
    first.stop()
    second = make_server(run_root=str(tmp_path / "run"), host="127.0.0.2")
    assert second.address != first.address
    endpoints.publish(path, second.address)
    client._endpoint.refresh_s = 0.0  # the default 2 s: the test need not wait for it
    client.push(2, _params(2))
    version, arrays = client.pull(min_version=2)
    assert version == 2 and (np.asarray(arrays["w"]) == 2).all()
    assert client.url == second.address


def test_a_service_file_is_read_again_only_after_refresh_s(tmp_path):
    path = str(tmp_path / "services" / "trainer.json")
    endpoints.publish(path, "http://127.0.0.3:4000")
    ep = endpoints.Endpoint(path, refresh_s=3600.0)
    assert ep.host_port() == ("127.0.0.3", 4000)
    endpoints.publish(path, "http://127.0.0.4:4001")
    assert ep.url() == "http://127.0.0.3:4000"  # cached
    ep.refresh_s = 0.0
    assert ep.url() == "http://127.0.0.4:4001"


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("localhost:80", "URL or a service file"),
        ("http://host", "HOST:PORT"),
        ("", "URL or a service file"),
    ],
)
def test_a_bad_address_names_the_field(spec, match):
    with pytest.raises(ValueError, match=match):
        endpoints.Endpoint(spec, field="--ps-url")


def test_an_unreadable_service_file_is_not_published_yet(tmp_path):
    path = tmp_path / "ps.json"
    path.write_text('{"url": "ftp://x"}')
    with pytest.raises(endpoints.NotPublishedError, match="does not hold a service address"):
        endpoints.Endpoint(str(path)).url()
    assert issubclass(endpoints.NotPublishedError, ConnectionError)


def test_services_bind_the_host_address_the_agent_set(monkeypatch):
    monkeypatch.delenv("RLAX_HOST_ADDRESS", raising=False)
    assert endpoints.bind_host(None) == "127.0.0.1"
    monkeypatch.setenv("RLAX_HOST_ADDRESS", "127.0.0.5")
    assert endpoints.bind_host(None) == "127.0.0.5"
    assert endpoints.bind_host("0.0.0.0") == "0.0.0.0"
    sock, url = endpoints.listen(endpoints.bind_host(None), 0)
    try:
        assert url.startswith("http://127.0.0.5:")
    finally:
        sock.close()


def test_a_worker_waiting_for_a_published_ps_is_retried_not_a_configuration_error(tmp_path):
    """Past --ps-wait-s a URL the user gave is a configuration error (exit 2); a service file
    naming no reachable PS yet (its slice may still be provisioning) is not (exit 1: retried)."""
    from rlax_tasks.rollout.cli import _register

    class Down:
        def register(self):
            raise ConnectionRefusedError("refused")

    with pytest.raises(ValueError, match="unreachable for 0s"):
        _register(Down(), "http://127.0.0.1:9", wait_s=0.0)
    with pytest.raises(ConnectionError, match="unreachable for 0s") as info:
        _register(Down(), str(tmp_path / "services" / "ps.json"), wait_s=0.0)
    assert not isinstance(info.value, ValueError)
