"""The hosts of a fake TPU node: each runs the node's real startup script, as a TPU VM does.

When the fake Cloud TPU API (``infra/fakes/cloud_tpu.py``) makes a node READY it starts one
``FakeTpuVm`` per host of the node's accelerator type. A host runs the ``startup-script``
metadata (the real ``infra/tpu/startup.sh`` the backend sent) with ``bash``, as root's startup
service does, with:

- ``RLAX_METADATA_URL``: this host's metadata server, served by the fake (the node's metadata
  attributes, ``agent-worker-number`` = the host's index, ``instance/network-interfaces/0/ip`` =
  the host's own address; ``Metadata-Flavor: Google`` required);
- ``infra/fakes/bin`` first on ``PATH``: stand-ins for ``docker`` (``docker_cli.py``, with this
  host's own container state), ``tini``, ``gcloud``, and ``python``/``rlax`` resolving to the
  virtualenv's (as inside the image); ``curl`` and ``bash`` are the real ones;
- ``RLAX_FAKE_HOST=<node>/hosts/<K>/<boot id>`` in the environment, inherited by everything the
  host starts (the script, docker's "containers", the agent, its jobs): a preemption or deletion
  SIGKILLs every process so marked, all hosts at once, as a spot reclaim does.

Addresses: as every TPU VM has its own internal IP, every host of every node creation has its own
loopback address (``allocate_host_addresses``: 127.X.Y.<host+1>, never 127.0.0.1; Linux routes
all of 127.0.0.0/8 to the loopback interface, so any of them can be bound and connected to with no
setup), and a node created again after a preemption or deletion gets new ones. The same address is
the node's ``networkEndpoints[K].ipAddress``, host K's metadata
``instance/network-interfaces/0/ip``, the ``--address`` startup.sh gives the agent (published at
``<slice root>/hosts/<K>.json``, ``RLAX_HOST_ADDRESS`` of its jobs) and ``address`` in
``state()``. Nothing isolates the hosts' network namespaces: a process may still bind another
host's address or 0.0.0.0, and a port bound on the wildcard address is taken for every host.

Files: ``<state dir>/startup-script``, ``startup.log`` (the script's output) and ``docker/``
(the stand-in's containers, with their logs).
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterable
from typing import Any

from infra.fakes import docker_cli

BIN = pathlib.Path(__file__).resolve().parent / "bin"
HOST_VAR = "RLAX_FAKE_HOST"

# /24 blocks of 127.0.0.0/8 handed out so far in this process (see allocate_host_addresses)
_next_block = 0
_blocks_lock = threading.Lock()
_HOSTS_PER_BLOCK = 254  # last octet 1..254: never .0 nor .255
_BLOCKS = 254 * 256  # 127.1.0.0/24 .. 127.254.255.0/24


def allocate_host_addresses(n_hosts: int) -> list[str]:
    """New loopback addresses for the ``n_hosts`` hosts of one node creation, in host order.

    Each call takes fresh /24 blocks of 127.0.0.0/8 from a process-wide counter, so an address
    is unique within the process (across nodes, re-creations of a node, and fakes sharing the
    process): block B is 127.<1 + B // 256>.<B % 256>.0/24 and host K of a call is
    127.X.Y.<K + 1> in its first block (a node of more than 254 hosts goes on in the next
    blocks): the first node created gets 127.1.0.1, 127.1.0.2, ..., the next 127.1.1.1, ...
    The last octet is never 0 or 255, and 127.0.x.x (the fake API's own 127.0.0.1; 127.0.1.1,
    Debian's hostname entry) is never used. The counter wraps after 65,024 blocks, far more node
    creations than a fake lives through.
    """
    global _next_block
    if n_hosts < 1:
        raise ValueError(f"a node has at least one host, got {n_hosts}")
    n_blocks = -(-n_hosts // _HOSTS_PER_BLOCK)
    with _blocks_lock:
        first, _next_block = _next_block, _next_block + n_blocks
    out = []
    for k in range(n_hosts):
        block = (first + k // _HOSTS_PER_BLOCK) % _BLOCKS
        out.append(f"127.{1 + block // 256}.{block % 256}.{k % _HOSTS_PER_BLOCK + 1}")
    return out


class FakeTpuVm:
    """One host of a fake TPU node."""

    def __init__(
        self,
        node_name: str,
        index: int,
        address: str,
        state_dir: str,
        metadata_url: str,
        registry_path: str,
        python: str = sys.executable,
    ) -> None:
        self.node_name, self.index = node_name, index
        self.address = address  # the node's networkEndpoints[index].ipAddress
        # unique per boot, across fakes: two fakes on one machine never kill each other's hosts
        self.key = f"{node_name}/hosts/{index}/{uuid.uuid4().hex[:12]}"
        self.state_dir = pathlib.Path(state_dir)
        self.metadata_url = metadata_url
        self.registry_path = registry_path
        self.python = python
        self.startup: subprocess.Popen | None = None

    @property
    def docker_state(self) -> pathlib.Path:
        return self.state_dir / "docker"

    def boot(self, script: str) -> None:
        """Runs the startup script (in the background, its own session)."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        path = self.state_dir / "startup-script"
        path.write_text(script)
        env = {
            **os.environ,
            "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}",
            "RLAX_METADATA_URL": self.metadata_url,
            "RLAX_FAKE_PYTHON": self.python,
            "RLAX_FAKE_DOCKER_STATE": str(self.docker_state),
            "RLAX_FAKE_REGISTRY": self.registry_path,
            HOST_VAR: self.key,
        }
        with open(self.state_dir / "startup.log", "ab") as out:
            self.startup = subprocess.Popen(
                ["bash", str(path)],
                env=env,
                cwd="/",
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                start_new_session=True,
            )
        threading.Thread(target=self.startup.wait, name=f"reap-{self.key}", daemon=True).start()

    def containers(self) -> dict[str, dict[str, Any]]:
        """The stand-in docker's containers on this host: name → {pid, running, restarts,
        command}."""
        out = {}
        for path in sorted((self.docker_state / "containers").glob("*.json")):
            record = json.loads(path.read_text())
            pid = record.get("SupervisorPid", 0)
            out[record["Name"]] = {
                "pid": pid,
                # a killed container could not record its end: its process tells
                "running": bool(record["State"].get("Running")) and docker_cli.alive(pid),
                "restarts": record.get("RestartCount", 0),
                "command": [record["Path"], *record["Args"]],
            }
        return out

    def pids(self) -> list[int]:
        """Every live process of this host."""
        return sorted(docker_cli.marked_pids(HOST_VAR, [self.key]))

    def state(self) -> dict[str, Any]:
        startup = self.startup
        return {
            "host": self.index,
            "address": self.address,
            "state_dir": str(self.state_dir),
            "startup": {
                "pid": startup.pid if startup else None,
                "returncode": startup.returncode if startup else None,
            },
            "containers": self.containers(),
            "pids": self.pids(),
        }


def kill_hosts(hosts: Iterable[FakeTpuVm]) -> list[int]:
    """SIGKILLs every process of ``hosts`` at once (startup scripts, containers, jobs)."""
    hosts = list(hosts)
    for host in hosts:  # the scripts first: no `docker run` starts anything afterwards
        if host.startup is not None and host.startup.poll() is None:
            try:
                os.killpg(host.startup.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    return docker_cli.kill_marked(HOST_VAR, [h.key for h in hosts])
