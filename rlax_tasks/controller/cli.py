"""`rlax controller`: the command that runs the controller of a disaggregated run until its last
step, wired over HTTP by controller/service.py. Light to import (no JAX): the wiring loads when
the command runs."""

from __future__ import annotations

import argparse
import json
import logging
import time

from rlax_tasks.process.garbage_collection import (
    collect_if_due,
    defer_full_collections,
    freeze_startup,
)
from rlax_tasks.services.endpoints import add_url_arg
from rlax_tasks.services.http import service_token

log = logging.getLogger(__name__)


def _controller_command(args: argparse.Namespace) -> int:
    defer_full_collections()  # before the imports: see rlax_tasks.process.garbage_collection
    token = service_token()  # the trainer and the workers refuse calls without it
    # after the GC deferral: the wiring (the config, the scorer, the clients) loads here
    from rlax_tasks.config import load_config
    from rlax_tasks.controller.service import build_controller
    from rlax_tasks.rundir import lock as run_lock

    cfg = load_config(args.config)
    steps = args.steps or cfg.trainer.total_steps
    if not steps:
        raise ValueError("give --steps (the run config has no trainer.total_steps)")
    # one live controller per run: a second one (a DAG task's retry beside a job still running,
    # a hand-started copy) is refused here rather than at its first snapshot
    with run_lock.for_job(cfg.run_dir) as lock:
        controller = build_controller(cfg, args.trainer_url, args.workers_file, token)
        controller.start()
        freeze_startup()
        last = time.monotonic()
        while controller.step < steps:
            lock.check()
            if not controller.iterate(last_step=steps):
                time.sleep(0.02)
            collect_if_due()
            if time.monotonic() - last > args.status_every_s:
                last = time.monotonic()
                log.info("controller: %s", json.dumps(controller.status(), sort_keys=True))
        log.info("controller done at step %d: %s", controller.step, controller.status())
        controller.close()
    return 0


def add_controller_parser(sub: argparse._SubParsersAction) -> None:
    """Registers `rlax controller`."""
    p = sub.add_parser("controller", help="the controller: drives workers and the trainer")
    p.add_argument("--config", required=True, help="run config YAML (or a preset name)")
    add_url_arg(p, "--trainer-url", "the trainer's", required=True)
    p.add_argument(
        "--workers-file",
        required=True,
        help='JSON {"worker-id": URL or service file}, local or gs:// (re-read when it changes)',
    )
    p.add_argument("--steps", type=int, default=None, help="training steps (total, resumable)")
    p.add_argument("--status-every-s", type=float, default=10.0)
    p.set_defaults(func=_controller_command)
