"""Where a service is reached: a fixed URL, or the address the service published in the run root.

On slices addresses are unknown before they exist and change after a preemption (docs/design.md
§10), so a service writes where it listens to ``<run_dir>/services/<job>.json`` (``publish``), and
an ``Endpoint`` given that file reads it again every few seconds. JAX-free."""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
import time
import urllib.parse

from rlax_tasks.rundir import storage
from rlax_tasks.rundir.paths import run_paths

# this host's address, where a service can be reached (the node agent sets it on slices)
HOST_ADDRESS_ENV = "RLAX_HOST_ADDRESS"
# how long a client trusts the address it read before reading the service file again
REFRESH_S = 2.0
LOOPBACK = "127.0.0.1"


class NotPublishedError(ConnectionRefusedError):
    """The service has not published an address (yet): a connection error, retried as one."""


def service_file(run_dir: str, job: str) -> str:
    """``<run_dir>/services/<job>.json``: where job ``job`` publishes its address."""
    return run_paths(run_dir).service(job)


def bind_host(host: str | None = None) -> str:
    """The address a service binds: ``host`` when given, else this host's address as the node
    agent set it (``RLAX_HOST_ADDRESS``: reachable from the run's other slices), else loopback."""
    return host or os.environ.get(HOST_ADDRESS_ENV, "").strip() or LOOPBACK


def url_of(host: str, port: int) -> str:
    """``http://host:port`` (IPv6 addresses bracketed)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def parse_url(url: str, field: str = "url") -> tuple[str, int]:
    """(host, port) of ``http://HOST:PORT``; ValueError naming ``field`` otherwise."""
    parsed = urllib.parse.urlsplit(url)
    try:
        port = parsed.port
    except ValueError:
        port = None
    if parsed.scheme != "http" or not parsed.hostname or not port:
        raise ValueError(f"{field} must look like http://HOST:PORT, got {url!r}")
    return parsed.hostname, port


def listen(host: str, port: int, backlog: int = 128) -> tuple[socket.socket, str]:
    """A listening TCP socket on ``host``:``port`` (0: a free port) and its ``http://`` URL."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(backlog)
    bound_host, bound_port = sock.getsockname()[:2]
    return sock, url_of(bound_host, bound_port)


def add_address_args(parser: argparse.ArgumentParser) -> None:
    """``--host``, ``--port`` and ``--publish``: where a service listens and says it does (one
    definition for every `rlax` service)."""
    parser.add_argument(
        "--host",
        default=None,
        help=f"address to bind (default: ${HOST_ADDRESS_ENV}, set on slices by the node agent, "
        f"else {LOOPBACK})",
    )
    parser.add_argument("--port", type=int, default=0, help="port to bind (0: a free one)")
    parser.add_argument(
        "--publish",
        default=None,
        metavar="PATH",
        help="once listening, write the URL to this service file (local or gs://; clients "
        "given PATH instead of a URL follow it), e.g. <run_dir>/services/ps.json",
    )


def add_url_arg(
    parser: argparse.ArgumentParser, flag: str, service: str, required: bool = False, note: str = ""
) -> None:
    """``flag``: where a client finds ``service`` (e.g. "the trainer's"): its URL, or the service
    file it publishes its address to (one wording for every `rlax` command)."""
    parser.add_argument(
        flag,
        required=required,
        help=f"{service} URL, or the service file it publishes its address to{note}",
    )


def publish(path: str, url: str) -> None:
    """Writes ``url`` (where this process's service listens) to the service file ``path``,
    whole (readers never see half of it), with this process's host and pid for people."""
    parse_url(url)
    record = {"url": url, "hostname": socket.gethostname(), "pid": os.getpid(), "time": time.time()}
    storage.write_bytes(path, json.dumps(record).encode())


def announce(url: str, publish_to: str | None = None) -> None:
    """Says where this process's service listens: ``url`` as the first line of stdout (what the
    launcher reads), then, with ``publish_to``, in that service file (what slices' clients read)."""
    sys.stdout.write(url + "\n")
    sys.stdout.flush()
    if publish_to:
        publish(publish_to, url)


def read_published(path: str) -> str:
    """The URL published at ``path``; NotPublishedError when there is none (or it is unreadable,
    which a service restarting and publishing again mends)."""
    try:
        record = json.loads(storage.read_bytes(path))
        url = record["url"]
        parse_url(url)
    except FileNotFoundError:
        raise NotPublishedError(f"no service has published its address at {path} yet") from None
    except (ValueError, KeyError, TypeError) as e:
        raise NotPublishedError(f"{path} does not hold a service address: {e}") from None
    return url


def is_url(spec: str) -> bool:
    return spec.startswith(("http://", "https://"))


class Endpoint:
    """A service's address: ``spec`` is its URL, or the service file it publishes its URL to
    (read again after ``refresh_s``, so clients follow a service that moved). Thread-safe."""

    def __init__(self, spec: str, refresh_s: float = REFRESH_S, field: str = "url") -> None:
        if not isinstance(spec, str) or not spec.strip():
            raise ValueError(f"{field} must be an http://HOST:PORT URL or a service file path")
        self.spec = spec.strip().rstrip("/") if is_url(spec.strip()) else spec.strip()
        self.refresh_s = refresh_s
        self.fixed = is_url(self.spec)
        if self.fixed:
            parse_url(self.spec, field)
        elif not self.spec.endswith(".json"):
            raise ValueError(
                f"{field} must be an http://HOST:PORT URL or a service file (<run_dir>/services/"
                f"<job>.json) the service publishes its URL to, got {spec!r}"
            )
        self._lock = threading.Lock()
        self._url: str | None = self.spec if self.fixed else None
        self._read_at = 0.0

    def url(self) -> str:
        """The service's URL now; NotPublishedError while a published service has none."""
        if self.fixed:
            return self.spec
        with self._lock:
            now = time.monotonic()
            if self._url is None or now - self._read_at >= self.refresh_s:
                self._url = read_published(self.spec)
                self._read_at = now
            return self._url

    def host_port(self) -> tuple[str, int]:
        return parse_url(self.url())

    def __str__(self) -> str:
        """The URL when known (for messages), else the spec."""
        return self._url or self.spec

    def __repr__(self) -> str:
        return f"Endpoint({self.spec!r})"
