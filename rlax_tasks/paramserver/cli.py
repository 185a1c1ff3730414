"""`rlax ps serve`: the command that runs one parameter server until SIGINT/SIGTERM.

Light to import (no numpy, no JAX): ``rlax --help`` and the other commands load only this; the
server itself is imported when the command runs. Each flag sets the ``ServerConfig`` field it is
named after, with that field's default (docs/design.md §6)."""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from typing import Any

from rlax_tasks.paramserver.server_config import ServerConfig
from rlax_tasks.services.endpoints import add_address_args, announce, bind_host
from rlax_tasks.services.http import service_token
from rlax_tasks.utils.byte_sizes import parse_bytes_arg

log = logging.getLogger(__name__)

# flag: (the ServerConfig field it sets, add_argument's options; the default is the field's)
SETTINGS: dict[str, tuple[str, dict[str, Any]]] = {
    "--run-root": ("run_root", dict(help="local dir or gs:// URI for the mirror")),
    "--keep-versions": ("keep_versions", dict(type=int)),
    "--keep-bytes": ("keep_bytes", dict(
        type=parse_bytes_arg, metavar="SIZE",
        help="most weight bytes held in RAM (versions + pushes in flight), e.g. 64GiB, 500MB or "
        "a plain integer; a push that does not fit waits for workers' acks (default: no limit)",
    )),
    "--mirror-every": ("mirror_every", dict(type=int)),
    "--mirror-keep": ("mirror_keep", dict(type=int, help="committed mirrors to keep")),
    "--worker-timeout": ("worker_timeout_s", dict(type=float, help="seconds without contact")),
    "--io-timeout": ("io_timeout_s", dict(type=float, help="socket stall limit, seconds")),
    "--assembly-timeout": ("assembly_timeout_s", dict(
        type=float, metavar="SECONDS",
        help="a multi-host push is discarded unless every trainer host's part arrives within "
        "this many seconds of the first (default %(default)s)",
    )),
    "--replica-id": ("replica_id", dict(
        help="this replica's id at its upstreams (where it registers like a worker)",
    )),
    "--egress-limit": ("egress_bytes_per_s", dict(
        type=parse_bytes_arg, metavar="SIZE",
        help="bytes per second this server sends at most, e.g. 1250MB (a 10 Gbit/s link); "
        "default: no limit",
    )),
}  # fmt: skip
# flag: (the ServerConfig field it turns off, help)
SWITCHES: dict[str, tuple[str, str]] = {
    "--no-verify-push": ("verify_push", "skip the server-side CRC32C check of pushes"),
    "--no-shared-memory": (
        "shared_memory",
        "keep versions in private memory: workers on this host pull over TCP too",
    ),
}


def add_ps_parser(sub: argparse._SubParsersAction) -> None:
    """Registers `rlax ps serve`."""
    ps = sub.add_parser("ps", help="parameter server")
    ps_sub = ps.add_subparsers(dest="ps_command", required=True)
    p = ps_sub.add_parser(
        "serve",
        help="serve weight versions (token from $RLAX_PS_TOKEN); prints its URL on stdout line 1",
    )
    add_address_args(p)
    for flag, (field, options) in SETTINGS.items():
        options = {"metavar": flag[2:].replace("-", "_").upper(), **options}  # named as before
        p.add_argument(flag, dest=field, default=getattr(ServerConfig, field), **options)
    for flag, (field, help_text) in SWITCHES.items():
        p.add_argument(flag, dest=field, action="store_false", help=help_text)
    p.add_argument(
        "--upstream",
        dest="upstreams",
        action="append",
        default=[],
        metavar="URL",
        help="run as a replica: relay every version from this server (repeat the flag: the "
        "next ones are tried when it is down or sends a corrupted version); needs --replica-id",
    )
    p.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    """`rlax ps serve` with its parsed ``args``: the validated config, then the server."""
    fields = [field for field, _ in (*SETTINGS.values(), *SWITCHES.values())]
    config = ServerConfig(
        token=service_token(),
        host=bind_host(args.host),
        port=args.port,
        upstreams=tuple(args.upstreams),
        **{field: getattr(args, field) for field in fields},
    )
    return serve_forever(config, publish_to=args.publish)


def serve_forever(config: ServerConfig, publish_to: str | None = None) -> int:
    """Runs a server until SIGINT/SIGTERM; its URL is the first line on stdout (and written to
    the service file ``publish_to``, rlax_tasks.services.endpoints)."""
    from rlax_tasks.paramserver.server import ParameterServer  # numpy: only when it runs

    server = ParameterServer(config).start()
    announce(server.address, publish_to)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    try:
        done.wait()
    finally:
        server.stop()
    log.info("parameter server stopped")
    return 0
