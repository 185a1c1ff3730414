"""The hosts of a fake TPU node: each runs the node's real startup script, as a TPU VM does.

A host runs the ``startup-script`` metadata with bash, its own metadata server, stand-ins for
docker/tini/gcloud first on ``PATH`` and its own loopback address; every process it starts is
marked (``RLAX_FAKE_HOST``) so a preemption SIGKILLs them all. A host's environment is its own
(``docker_cli.passed_env``: nothing of the test process but what stands for the world outside
a VM); network namespaces, the kernel and /tmp are shared."""

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

BIN = docker_cli.BIN
HOST_VAR = "RLAX_FAKE_HOST"

# /24 blocks of 127.0.0.0/8 handed out so far in this process (see allocate_host_addresses)
_next_block = 0
_blocks_lock = threading.Lock()
_HOSTS_PER_BLOCK = 254  # last octet 1..254: never .0 nor .255
_BLOCKS = 254 * 256  # 127.1.0.0/24 .. 127.254.255.0/24


def allocate_host_addresses(n_hosts: int) -> list[str]:
    """New loopback addresses for the ``n_hosts`` hosts of one node creation, in host order.

    Each call takes fresh /24 blocks of 127.0.0.0/8 from a process-wide counter (host K:
    127.X.Y.<K + 1>), so an address is unique in the process; 127.0.x.x and octets 0 and 255 are
    never used. The counter wraps after 65,024 blocks."""
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
        libtpu_url: str,
        registry_path: str,
        python: str = sys.executable,
    ) -> None:
        self.node_name, self.index = node_name, index
        self.address = address  # the node's networkEndpoints[index].ipAddress
        # unique per boot, across fakes: two fakes on one machine never kill each other's hosts
        self.key = f"{node_name}/hosts/{index}/{uuid.uuid4().hex[:12]}"
        self.state_dir = pathlib.Path(state_dir)
        self.metadata_url = metadata_url
        self.libtpu_url = libtpu_url  # where this host's fake libtpu joins its slice
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
        # a VM's own environment: nothing of the test process's but docker_cli.passed_env
        home = self.state_dir / "home"
        home.mkdir(exist_ok=True)
        env = {
            **docker_cli.passed_env(os.environ),
            "PATH": f"{BIN}{os.pathsep}{docker_cli.SYSTEM_PATH}",
            "HOME": str(home),
            "LANG": "C.UTF-8",
            "RLAX_METADATA_URL": self.metadata_url,
            # read by the fake libtpu in the containers (infra/fakes/tpu_image)
            "RLAX_FAKE_METADATA_URL": self.metadata_url,
            "RLAX_FAKE_LIBTPU_URL": self.libtpu_url,
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
