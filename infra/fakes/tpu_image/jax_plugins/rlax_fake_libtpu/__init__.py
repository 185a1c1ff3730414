"""The fake TPU VM's libtpu (infra/fakes/cloud_tpu.py): the TPU runtime's start-up checks.

JAX calls ``initialize()`` of every ``jax_plugins`` module when it sets up its backends, the
moment the real libtpu loads. Unless the process's JAX_PLATFORMS leaves the TPU out, this one
checks the process's TPU variables against its VM (the ``tpu-env`` metadata: its chip grid, the
slice's hosts) and, for a process that takes a slice of several hosts, waits until every host of
the slice has started one, as libtpu does. It refuses inconsistent process bounds at once and a
slice whose other hosts never start after RLAX_FAKE_LIBTPU_WAIT_S: "TPU initialization failed"
and exit status 1. Otherwise it stands the host's CPU in for the chips the process was given:
JAX's "tpu" backend is a CPU client of that many devices (one process of the jax.distributed
group, if the process started one), so a job sees the platform and device count a TPU VM's
libtpu would give it, and computes on the CPU."""

from __future__ import annotations

import json
import math
import os
import sys
import time
import urllib.request
from collections.abc import Mapping

WAIT_VAR = "RLAX_FAKE_LIBTPU_WAIT_S"
DEFAULT_WAIT_S = 120.0
# what makes a process a slice of some chips of its host (Cloud TPU's multi-process recipe)
SUBSLICE_VARS = (
    "TPU_PROCESS_BOUNDS",
    "TPU_CHIPS_PER_PROCESS_BOUNDS",
    "TPU_VISIBLE_CHIPS",
    "CLOUD_TPU_TASK_ID",
    "TPU_PROCESS_ADDRESSES",
)


class TpuInitError(RuntimeError):
    """What libtpu would refuse."""


def wants_tpu(environ: Mapping[str, str]) -> bool:
    """Whether JAX would load libtpu: JAX_PLATFORMS unset or naming tpu."""
    platforms = {p.strip() for p in environ.get("JAX_PLATFORMS", "").split(",") if p.strip()}
    return not platforms or "tpu" in platforms


def parse_tpu_env(text: str) -> dict[str, str]:
    """The ``KEY: 'value'`` lines of the tpu-env metadata attribute."""
    out = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            out[key.strip()] = value.strip().strip("'")
    return out


def _bounds(name: str, value: str) -> tuple[int, int, int]:
    parts = value.split(",")
    if len(parts) != 3 or not all(p.strip().isdigit() and int(p) >= 1 for p in parts):
        raise TpuInitError(f"{name}={value!r} is not three positive integers 'x,y,z'")
    x, y, z = (int(p) for p in parts)
    return x, y, z


def check_process_bounds(environ: Mapping[str, str], chips_per_host: str) -> str | None:
    """A process given some chips of its host: checks its variables against each other and
    the host's chip grid ``chips_per_host`` ("x,y,z"); describes its slice. None when the
    process takes the whole slice (no such variable set)."""
    given = sorted(k for k in SUBSLICE_VARS if environ.get(k))
    if not given:
        return None
    missing = [k for k in SUBSLICE_VARS[:2] if not environ.get(k)]
    if missing:
        raise TpuInitError(f"{' and '.join(missing)} not set, though {', '.join(given)} is")
    grid = _bounds("CHIPS_PER_HOST_BOUNDS", chips_per_host)
    processes = _bounds("TPU_PROCESS_BOUNDS", environ["TPU_PROCESS_BOUNDS"])
    chips = _bounds("TPU_CHIPS_PER_PROCESS_BOUNDS", environ["TPU_CHIPS_PER_PROCESS_BOUNDS"])
    if any(c > g for c, g in zip(chips, grid, strict=True)):
        raise TpuInitError(
            f"TPU_CHIPS_PER_PROCESS_BOUNDS={environ['TPU_CHIPS_PER_PROCESS_BOUNDS']} does not fit "
            f"the host's chip grid {chips_per_host}"
        )
    n_processes, n_chips, host_chips = math.prod(processes), math.prod(chips), math.prod(grid)
    if n_processes * n_chips > host_chips:
        raise TpuInitError(
            f"TPU_PROCESS_BOUNDS={environ['TPU_PROCESS_BOUNDS']} processes of "
            f"TPU_CHIPS_PER_PROCESS_BOUNDS={environ['TPU_CHIPS_PER_PROCESS_BOUNDS']} chips need "
            f"{n_processes * n_chips} chips; this host has {host_chips}"
        )
    raw = environ.get("TPU_VISIBLE_CHIPS", "")
    if not raw:
        if n_chips < host_chips:
            raise TpuInitError(
                f"TPU_VISIBLE_CHIPS is not set: a process of {n_chips} of the host's {host_chips} "
                "chips must name them"
            )
        visible = list(range(host_chips))
    else:
        try:
            visible = [int(c) for c in raw.split(",")]
        except ValueError:
            raise TpuInitError(f"TPU_VISIBLE_CHIPS={raw!r} is not a list of chip ids") from None
        if len(set(visible)) != n_chips or len(visible) != n_chips:
            raise TpuInitError(
                f"TPU_VISIBLE_CHIPS={raw} names {len(visible)} chip(s) but "
                f"TPU_CHIPS_PER_PROCESS_BOUNDS={environ['TPU_CHIPS_PER_PROCESS_BOUNDS']} is "
                f"{n_chips}"
            )
        if not all(0 <= c < host_chips for c in visible):
            raise TpuInitError(f"TPU_VISIBLE_CHIPS={raw}: this host's chips are 0-{host_chips - 1}")
    task = environ.get("CLOUD_TPU_TASK_ID", "0")
    if not task.isdigit() or int(task) >= n_processes:
        raise TpuInitError(f"CLOUD_TPU_TASK_ID={task!r} is not in [0, {n_processes})")
    addresses = [a for a in environ.get("TPU_PROCESS_ADDRESSES", "").split(",") if a]
    if n_processes > 1 and len(addresses) != n_processes:
        raise TpuInitError(
            f"TPU_PROCESS_ADDRESSES names {len(addresses)} address(es) for {n_processes} processes"
        )
    return f"chips {','.join(map(str, visible))} as process {task} of {n_processes}"


def _metadata(key: str) -> str:
    url = f"{os.environ['RLAX_FAKE_METADATA_URL']}/instance/attributes/{key}"
    request = urllib.request.Request(url, headers={"Metadata-Flavor": "Google"})
    with urllib.request.urlopen(request, timeout=10) as reply:
        return reply.read().decode()


def _join() -> dict:
    body = json.dumps({"pid": os.getpid()}).encode()
    request = urllib.request.Request(
        os.environ["RLAX_FAKE_LIBTPU_URL"], data=body, method="POST",
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(request, timeout=10) as reply:
        return json.loads(reply.read())


def join_slice(worker: int, accelerator_type: str, wait_s: float) -> int:
    """Waits until every host of the slice has a process in the TPU runtime; its host count."""
    deadline = time.monotonic() + wait_s
    while True:
        reply = _join()
        if len(reply["joined"]) == reply["hosts"]:
            return reply["hosts"]
        if time.monotonic() > deadline:
            missing = sorted(set(range(reply["hosts"])) - set(reply["joined"]))
            raise TpuInitError(
                f"host {worker} of {accelerator_type} waited {wait_s:g} s for the slice's other "
                f"hosts, and host(s) {', '.join(map(str, missing))} never started the TPU "
                f"runtime: a process of a {reply['hosts']}-host slice needs one on every host"
            )
        time.sleep(0.2)


def process_chips(environ: Mapping[str, str], chips_per_host: str) -> int:
    """How many chips libtpu gives the process: those it names, else its whole host."""
    if environ.get("TPU_VISIBLE_CHIPS"):
        return len(environ["TPU_VISIBLE_CHIPS"].split(","))
    if environ.get("TPU_CHIPS_PER_PROCESS_BOUNDS"):
        return math.prod(
            _bounds("TPU_CHIPS_PER_PROCESS_BOUNDS", environ["TPU_CHIPS_PER_PROCESS_BOUNDS"])
        )
    return math.prod(_bounds("CHIPS_PER_HOST_BOUNDS", chips_per_host))


def register_chips(count: int) -> None:
    """JAX's "tpu" backend (the default: libtpu's priority): a CPU client of ``count`` devices,
    distributed over the process's jax.distributed group when there is one; its "cpu" backend
    one local device (two distributed CPU clients would clash in the group's topology)."""
    from jax._src import distributed, xla_bridge
    from jax._src.lib import _jax, xla_client

    def tpu_client():
        state = distributed.global_state
        collectives = None
        if state.client is not None:
            collectives = _jax.make_gloo_tcp_collectives(distributed_client=state.client)
        return xla_client.make_cpu_client(
            distributed_client=state.client,
            node_id=state.process_id,
            num_nodes=state.num_processes,
            collectives=collectives,
            num_devices=count,
        )

    def cpu_client():
        return xla_client.make_cpu_client(num_devices=1)

    xla_bridge.register_backend_factory("tpu", tpu_client, priority=300, fail_quietly=False)
    xla_bridge.register_backend_factory("cpu", cpu_client, priority=0, fail_quietly=False)


def initialize() -> None:
    """JAX's plugin hook: libtpu's start-up checks (see the module's docstring)."""
    if not wants_tpu(os.environ) or "RLAX_FAKE_METADATA_URL" not in os.environ:
        return
    try:
        env = parse_tpu_env(_metadata("tpu-env"))
        worker, kind = int(env["WORKER_ID"]), env["ACCELERATOR_TYPE"]
        part = check_process_bounds(os.environ, env["CHIPS_PER_HOST_BOUNDS"])
        if part is not None:
            note = f"host {worker} of {kind}: a slice of its {part}"
        elif math.prod(_bounds("HOST_BOUNDS", env["HOST_BOUNDS"])) == 1:
            note = f"{kind}: every chip of its one host"
        else:
            wait_s = float(os.environ.get(WAIT_VAR) or DEFAULT_WAIT_S)
            hosts = join_slice(worker, kind, wait_s)
            note = f"host {worker} of {kind}: the slice's {hosts} hosts joined"
    except TpuInitError as e:
        sys.stderr.write(f"fake libtpu: TPU initialization failed: {e}\n")
        sys.stderr.flush()
        os._exit(1)
    chips = process_chips(os.environ, env["CHIPS_PER_HOST_BOUNDS"])
    register_chips(chips)
    sys.stderr.write(f"fake libtpu: {note}; {chips} TPU device(s), on the CPU\n")
    sys.stderr.flush()
