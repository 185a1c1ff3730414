"""`rlax run`: every component as a local process under a supervisor, then a report.

Starts the parameter server, the trainer, the inference workers and the controller (each a
`rlax` sub-command), restarts any that dies (they all resume from the run's checkpoints,
snapshots and weight mirror), prints a status line while the run goes, and ends with held-out
pass@k before and after plus plots (rlax_tasks.run.report). Running it again with the same run
id resumes the run.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import time
from typing import Any

from rlax_tasks import storage
from rlax_tasks.config import RunConfig, save_resolved
from rlax_tasks.run.supervisor import Component, Supervisor, free_port

log = logging.getLogger(__name__)


def ensure_model(cfg: RunConfig) -> None:
    """Builds the base model by the supervised warm-up when the config asks for it."""
    if not cfg.model.warmup_if_missing:
        return
    from rlax_tasks.warmup import ensure_base_model

    # reuses the cached model when its recipe fingerprint matches, rebuilds it otherwise
    parent, name = os.path.split(os.path.abspath(cfg.model.path))
    ensure_base_model(parent, name=name)


def _last_json_line(path: str) -> dict[str, Any] | None:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 65536))
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            return json.loads(line)
        except ValueError:
            continue
    return None


def _status_line(run_dir: str, steps: int, started: float) -> str:
    m = _last_json_line(os.path.join(run_dir, "metrics.jsonl")) or {}
    step = m.get("step", 0)
    reward = m.get("reward_mean")
    elapsed = time.monotonic() - started
    eta = (elapsed / step * (steps - step)) if step else float("nan")
    reward_txt = f"{reward:.3f}" if isinstance(reward, float) else "-"
    return f"step {step}/{steps}  reward {reward_txt}  elapsed {elapsed:.0f}s  eta {eta:.0f}s"


def run_local(
    cfg: RunConfig,
    steps: int,
    *,
    evaluate: bool = True,
    status_every_s: float = 10.0,
    supervisor_hook: Any = None,
) -> dict[str, Any]:
    """Runs ``steps`` training steps (in total, across resumes) of ``cfg`` on this machine."""
    if "://" in cfg.run_root:
        raise ValueError("rlax run with local processes needs a local run_root")
    run_dir = cfg.run_dir
    os.makedirs(run_dir, exist_ok=True)
    ensure_model(cfg)
    config_path = save_resolved(cfg)
    report: dict[str, Any] = {"run_dir": run_dir, "steps": steps}
    if evaluate:
        from rlax_tasks.run.report import evaluate_version

        report["before"] = evaluate_version(cfg, None)

    token = secrets.token_hex(16)
    env = {"RLAX_PS_TOKEN": token, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    ps_url = f"http://127.0.0.1:{free_port()}"
    trainer_url = f"http://127.0.0.1:{free_port()}"
    s = cfg.staleness
    sup = Supervisor(os.path.join(run_dir, "logs"))
    t0 = time.monotonic()
    try:
        sup.add(
            Component(
                "ps",
                [
                    "ps",
                    "serve",
                    "--port",
                    ps_url.rsplit(":", 1)[1],
                    "--run-root",
                    run_dir,
                    "--keep-versions",
                    str(max(4, (s.max_staleness or s.reload_every) + 2)),
                    "--worker-timeout",
                    "60",
                ],
                env,
            )
        )
        sup.add(
            Component(
                "trainer",
                [
                    "trainer",
                    "--config",
                    config_path,
                    "--ps-url",
                    ps_url,
                    "--port",
                    trainer_url.rsplit(":", 1)[1],
                ],
                env,
            )
        )
        workers = {}
        for i in range(cfg.workers.count):
            wid = f"worker-{i}"
            port = free_port()
            workers[wid] = f"http://127.0.0.1:{port}"
            sup.add(
                Component(
                    wid,
                    [
                        "worker",
                        "--model-dir",
                        cfg.model.path,
                        "--ps-url",
                        ps_url,
                        "--worker-id",
                        wid,
                        "--port",
                        str(port),
                        "--dtype",
                        cfg.model.dtype,
                        "--max-slots",
                        str(cfg.workers.slots),
                        "--max-len",
                        str(cfg.workers.max_len),
                        "--reload-every",
                        str(s.reload_every),
                    ],
                    env,
                )
            )
        workers_file = os.path.join(run_dir, "workers.json")
        storage.write_bytes(workers_file, json.dumps(workers).encode())
        sup.add(
            Component(
                "controller",
                [
                    "controller",
                    "--config",
                    config_path,
                    "--trainer-url",
                    trainer_url,
                    "--workers-file",
                    workers_file,
                    "--steps",
                    str(steps),
                ],
                env,
                restart=False,
            )
        )  # exit 0 = done; a crash is still restarted
        last = 0.0
        while True:
            finished = sup.poll()
            if "controller" in finished:
                break
            if supervisor_hook is not None:
                supervisor_hook(sup)
            if time.monotonic() - last >= status_every_s:
                last = time.monotonic()
                log.info("%s", _status_line(run_dir, steps, t0))
            time.sleep(0.2)
        report["train_seconds"] = time.monotonic() - t0
        report["restarts"] = {n: c.restarts for n, c in sup.components.items()}
        if evaluate:
            from rlax_tasks.paramserver import ParameterServerClient
            from rlax_tasks.run.report import evaluate_version

            client = ParameterServerClient(ps_url, token=token)
            report["after"] = evaluate_version(cfg, client)
            client.close()
    finally:
        sup.stop()
    if evaluate:
        from rlax_tasks.run.report import write_report

        report.update(write_report(cfg, report))
    return report
