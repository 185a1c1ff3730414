"""`rlax worker`: the command that runs one inference worker behind the run's token, serving
rollout/service.py's app to the controller. Light to import (no JAX): the model, the sampler and
the worker load when the command runs, after the process tuning."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import socket
import time
from typing import Any

from rlax_tasks.process.device_check import check_job_devices
from rlax_tasks.process.garbage_collection import defer_full_collections, freeze_startup
from rlax_tasks.process.host_malloc import tune_if_host_compute
from rlax_tasks.services.endpoints import (
    Endpoint,
    add_address_args,
    add_url_arg,
    announce,
    bind_host,
    listen,
)
from rlax_tasks.services.http import serve_app, service_token

log = logging.getLogger(__name__)


def _register(source: Any, url: str, wait_s: float) -> None:
    """Registers with the PS (docs/design.md §6 GC rule), waiting while it is down (it may be
    restarting); a refused token, or a PS URL unreachable for ``wait_s``, is a configuration
    error (a service file that names no reachable PS yet is not: the job is retried)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            source.register()
            return
        except ConnectionError as e:
            if time.monotonic() >= deadline:
                message = f"--ps-url {url}: unreachable for {wait_s:.0f}s: {e}"
                if Endpoint(url).fixed:  # a URL the user gave: most likely a wrong one
                    raise ValueError(message) from e
                # a published address: the PS's slice may still be provisioning (exit 1: the
                # job is retried, where exit 2 would be a configuration error)
                raise ConnectionError(message) from e
            log.info("parameter server %s not reachable yet (%s); retrying", url, e)
            time.sleep(1.0)
        except RuntimeError as e:
            raise ValueError(f"--ps-url {url}: {e}") from e


def _worker_command(args: argparse.Namespace) -> int:
    defer_full_collections()  # before the imports: see rlax_tasks.process.garbage_collection
    tune_if_host_compute()  # before JAX starts its threads: see rlax_tasks.process.host_malloc
    token = service_token()  # before anything slow: no token, no worker (exit 2)
    # lazy: only a worker loads JAX (and FastAPI, to serve)
    from rlax_tasks.models import load_pretrained
    from rlax_tasks.rollout.sampler import Sampler
    from rlax_tasks.rollout.service import GRACEFUL_S, create_app, worker_mesh
    from rlax_tasks.rollout.weight_source import FixedWeights
    from rlax_tasks.rollout.worker import InferenceWorker

    check_job_devices(args.worker_id or "worker")  # exit 2: JAX's devices not the placement's
    mesh = worker_mesh(args.mesh_shape)
    policy = load_pretrained(args.model_dir, dtype=args.dtype, mesh=mesh)
    sampler = Sampler(
        policy,
        args.max_slots,
        args.max_len,
        decode_chunk=args.decode_chunk,
        precompile=True,
        support_capacity=args.support_capacity,
        layer_copies=args.decode_layer_copies,
    )
    if args.ps_url:
        from rlax_tasks.paramserver import ParameterServerClient  # lazy: JAX, as above

        if args.ps_failover:  # replicas (docs/design.md §16): --ps-url is this worker's home
            from rlax_tasks.paramserver.replicas import ReplicaClient

            source: Any = ReplicaClient(
                [args.ps_url, *args.ps_failover], 0, token, worker_id=args.worker_id,
                delta=args.delta_pulls,
            )  # fmt: skip
        else:
            source = ParameterServerClient(
                args.ps_url, token, worker_id=args.worker_id, delta=args.delta_pulls
            )
        _register(source, args.ps_url, args.ps_wait_s)
        source.start_heartbeats(args.heartbeat_s)
    else:
        source = FixedWeights(sampler.params, version=0)
    worker = InferenceWorker(
        sampler, source, reload_every=args.reload_every, interrupt=args.interrupt_on_reload
    )
    sock, url = listen(bind_host(args.host), args.port)
    try:
        worker.start()
    except RuntimeError as e:  # e.g. the PS refused our token: a configuration mistake
        raise ValueError(f"cannot load weights: {e}") from e
    freeze_startup()
    announce(url, args.publish)  # first-line contract: the controller reads the address
    log.info(
        "worker %s serving %s on %s (weights v%s)",
        args.worker_id,
        args.model_dir,
        url,
        worker.version,
    )
    app = create_app(worker, token)
    try:
        # a worker whose generation failed stops serving and exits 1 (its job is restarted)
        # rather than answering every request with the error
        serve_app(app, sock, graceful_s=GRACEFUL_S, until=worker.failed)
    finally:
        worker.stop()
        if args.ps_url:
            with contextlib.suppress(ConnectionError, OSError, RuntimeError):
                source.deregister()
            source.close()
    if worker.failed.is_set():
        log.error("worker %s stopped: its generation failed (see above)", args.worker_id)
        return 1
    return 0


def add_worker_parser(sub: argparse._SubParsersAction) -> None:
    """Registers `rlax worker`."""
    p = sub.add_parser("worker", help="inference worker: generates version-tagged rollouts")
    p.add_argument(
        "--model-dir",
        required=True,
        help="HF directory: architecture and tokenizer (and the weights, without --ps-url)",
    )
    add_url_arg(
        p,
        "--ps-url",
        "the parameter server's",
        note=" (token from RLAX_PS_TOKEN): weights follow it; without it the model "
        "directory's weights serve as version 0",
    )
    p.add_argument(
        "--ps-failover",
        action="append",
        default=[],
        metavar="URL",
        help="another parameter-server replica to pull from when --ps-url's is gone or sends "
        "a corrupted version (repeat: tried in order); the worker returns to --ps-url's "
        "replica once it answers again",
    )
    p.add_argument("--worker-id", default=f"worker-{socket.gethostname()}-{os.getpid()}")
    add_address_args(p)
    p.add_argument("--max-slots", type=int, default=32)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--decode-chunk", type=int, default=8)
    p.add_argument(
        "--support-capacity",
        type=int,
        default=0,
        help="record up to this many ids a top-k/top-p request kept per token, for the "
        "trainer's sampling-mask replay (0: none)",
    )
    p.add_argument("--reload-every", type=int, default=1, help="j of docs/design.md §3")
    p.add_argument(
        "--no-decode-layer-copies",
        dest="decode_layer_copies",
        action="store_false",
        help="decode through slices of the stacked layers (default: each layer's weights as "
        "arrays of their own, a second copy of the layers in device memory)",
    )
    p.add_argument(
        "--no-interrupt",
        dest="interrupt_on_reload",
        action="store_false",
        help="at a reload, generate the sequences in flight again (default: they continue on "
        "the new weights, each token recording its version)",
    )
    p.add_argument(
        "--no-delta-pulls",
        dest="delta_pulls",
        action="store_false",
        help="pull whole versions over TCP (default: keep a host copy of the version held and "
        "receive the next as its changed elements)",
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument(
        "--mesh-shape",
        default="1,1,-1",
        help="DATA,FSDP,TENSOR mesh over this worker's devices (-1: the remaining ones); "
        "default: tensor parallel over every device the worker sees",
    )
    p.add_argument("--heartbeat-s", type=float, default=10.0, help="PS heartbeat interval")
    p.add_argument("--ps-wait-s", type=float, default=300.0, help="how long to wait for the PS")
    p.set_defaults(func=_worker_command)
