"""`rlax verify serve`: the command that runs the verifier service (rewards/service.py).

Light to import (the service's own imports: no JAX); ``python -m rlax_tasks.rewards.cli verify
serve ...`` runs it without the rest of `rlax`."""

import argparse
import logging
import sys
from collections.abc import Sequence

from rlax_tasks.rewards.service import MAX_BODY_MB, serve
from rlax_tasks.services.http import service_token


def _serve_command(args: argparse.Namespace) -> int:
    token = service_token()  # it runs code: never without the run's token (exit 2)
    if args.max_body_mb <= 0:
        raise ValueError(f"--max-body-mb must be > 0, got {args.max_body_mb}")
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper(), logging.INFO), stream=sys.stderr
    )
    serve(
        token,
        args.host,
        args.port,
        math_workers=args.math_workers,
        math_timeout_s=args.math_timeout,
        max_parallel=args.max_parallel,
        max_body_bytes=int(args.max_body_mb * (1 << 20)),
        log_level=args.log_level,
    )
    return 0


def add_verify_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `verify serve` on an argparse subparsers object; sets `func(args) -> int`."""
    verify = subparsers.add_parser("verify", help="reward verifiers (math, code)")
    verify_sub = verify.add_subparsers(dest="verify_command", metavar="COMMAND")
    verify_sub.required = True
    serve_p = verify_sub.add_parser(
        "serve", help="serve the verifiers over HTTP (prints its URL on the first line)"
    )
    serve_p.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1)")
    serve_p.add_argument("--port", type=int, default=0, help="port to bind (0: any free port)")
    serve_p.add_argument(
        "--math-workers",
        type=int,
        default=None,
        help="math-verify worker processes (default: min(4, CPUs))",
    )
    serve_p.add_argument(
        "--math-timeout",
        type=float,
        default=5.0,
        help="hard timeout in seconds per math extraction/comparison",
    )
    serve_p.add_argument(
        "--max-parallel", type=int, default=None, help="concurrent sandboxes (default: CPU count)"
    )
    serve_p.add_argument(
        "--max-body-mb",
        type=float,
        default=MAX_BODY_MB,
        help=f"largest request body in MiB, refused before it is read (default {MAX_BODY_MB})",
    )
    serve_p.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    serve_p.set_defaults(func=_serve_command)
    return verify


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone entry point: `python -m rlax_tasks.rewards.cli verify serve ...`."""
    parser = argparse.ArgumentParser(prog="rlax")
    add_verify_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:  # a user mistake: one line, exit 2 (as `rlax` does)
        print(f"rlax verify: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
