"""Connecting to a Ray cluster for the ``ray`` backend: Ray imported lazily, the address checked
before ``ray.init`` (which would retry for minutes, then exit the process), one connection per
process."""

from __future__ import annotations

import socket
import threading
from typing import Any

_CONNECT_LOCK = threading.Lock()


class RayBackendError(ValueError):
    """A mistake in the ray backend's settings, or a slice the cluster cannot hold: a user error
    (one line from `rlax`, not retried by the Airflow operators)."""


def import_ray():  # noqa: ANN202 - the ray module
    try:
        # lazy: Ray is an optional extra, and rlax_tasks.compute is imported by Airflow's
        # scheduler and triggerer, which must neither need Ray nor pay for importing it
        import ray
    except ImportError:
        raise RayBackendError(
            "the ray backend needs Ray, which is not installed here: install the ray extra "
            "(.venv/bin/pip install -c constraints.txt -e '.[ray]'; `bash scripts/setup.sh "
            "--test` installs it too)"
        ) from None
    return ray


def _check_reachable(address: str, timeout_s: float) -> None:
    """RayBackendError unless something listens at ``address`` (ray.init would retry for
    minutes, then exit the process)."""
    if address == "auto":
        return
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        raise RayBackendError(
            f"ray backend: address={address!r} is not host:port (the head node's GCS address, "
            "e.g. 10.0.0.2:6379), ray://host:port or auto"
        )
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise RayBackendError(
            f"cannot reach the Ray cluster at {address} ({e.strerror or e}): check the ray "
            "backend's address setting and that the cluster is up (`ray status` on its head)"
        ) from None


def _same_gcs(address: str, gcs: str) -> bool:
    """Whether ``address`` (a setting) names the GCS at ``gcs`` (host:port, as Ray reports it):
    the same port on the same host, any host for a loopback address, ``auto`` and ``ray://``
    always."""
    if address == "auto" or address.startswith("ray://"):
        return True
    host, _, port = address.rpartition(":")
    gcs_host, _, gcs_port = gcs.rpartition(":")
    try:
        ip = socket.gethostbyname(host.strip("[]"))
    except OSError:
        ip = host
    return port == gcs_port and (ip == gcs_host or ip.startswith("127."))


def connect(address: str, namespace: str, timeout_s: float) -> Any:
    """Ray, connected once per process (``ray.init``) to ``address`` in ``namespace``;
    RayBackendError when it cannot be reached, or when this process is connected elsewhere."""
    ray = import_ray()
    with _CONNECT_LOCK:
        if ray.is_initialized():
            _check_connection(ray, address, namespace)
            return ray
        _check_reachable(address, timeout_s)
        try:
            ray.init(address=address, namespace=namespace, log_to_driver=False)
        except (ConnectionError, SystemExit) as e:  # Ray exits when the GCS never answers
            raise RayBackendError(f"cannot connect to Ray at {address}: {e}") from None
    return ray


def _check_connection(ray: Any, address: str, namespace: str) -> None:
    """RayBackendError when this process is connected to Ray with other settings."""
    context = ray.get_runtime_context()
    gcs = context.gcs_address
    if context.namespace != namespace or not _same_gcs(address, gcs):
        raise RayBackendError(
            f"this process is connected to Ray at {gcs} (namespace {context.namespace!r}), "
            f"not {address} (namespace {namespace!r}): one process, one Ray connection"
        )
