"""A local fake of the Cloud TPU v2 REST API subset RLAX uses, for development and tests.

``python -m infra.fakes.cloud_tpu --port 0`` prints its URL, then serves queued resources,
nodes and operations; READY nodes run the real ``startup.sh`` on fake hosts (``tpu_vm.py``).
Each host has a metadata server (``/fake/metadata/...``: its worker number, ``tpu-env``, the
slice's endpoints) and a slice-wide rendezvous for the fake libtpu (``/fake/libtpu/...``,
``tpu_image/``). ``/fake/*`` control endpoints preempt, fail capacity, register images and dump
the state."""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import re
import signal
import sys
import tempfile
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from infra.fakes import docker_cli, tpu_catalog
from infra.fakes.tpu_catalog import Refused, check_node
from infra.fakes.tpu_vm import FakeTpuVm, allocate_host_addresses, kill_hosts
from rlax_tasks.services.http import send_json

log = logging.getLogger("fake_cloud_tpu")

_TYPE = "type.googleapis.com/google.cloud.tpu.v2."
_PARENT = r"(?P<parent>projects/[^/]+/locations/[^/]+)"


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class ApiError(Exception):
    def __init__(self, code: int, status: str, message: str) -> None:
        super().__init__(message)
        self.code, self.status, self.message = code, status, message


class FakeCloudTpu:
    """The fake's state and behaviour; ``serve``/``start`` put it behind HTTP."""

    def __init__(
        self,
        provision_delay_s: float = 0.5,
        run_agents: bool = True,
        log_dir: str | None = None,
        python: str = sys.executable,
        images: list[str] | tuple[str, ...] = (),
        url: str = "",
    ) -> None:
        self.provision_delay_s = provision_delay_s
        self.run_agents = run_agents
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="fake-cloud-tpu-")
        self.python = python
        self.url = url  # where the fake is served (for the hosts' metadata servers)
        self.lock = threading.RLock()
        self.qrs: dict[str, dict[str, Any]] = {}
        self.nodes: dict[str, dict[str, Any]] = {}
        self.ops: dict[str, dict[str, Any]] = {}
        self.hosts: dict[str, list[FakeTpuVm]] = {}
        # the fake libtpu's slice-wide runtimes: first host's key (one per boot) → host → pids
        self.libtpu: dict[str, dict[int, set[int]]] = {}
        # ... and the processes that met all the slice's hosts there (libtpu's barrier: once
        # passed, a process whose peers have finished since is still up)
        self.libtpu_met: dict[str, set[int]] = {}
        self.images: list[str] = []
        self.registry_path = os.path.join(self.log_dir, "registry.json")
        for image in images:
            self.add_image(image)
        self._write_registry()
        self._created_at: dict[str, float] = {}
        self._vms: dict[str, int] = {}  # queued resource → VMs of its node (the catalogue)
        self._op_counter = 0
        self._boots = 0
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick_loop, name="fake-tpu-ticker", daemon=True)
        self._ticker.start()

    # ------------------------------------------------------------------ API
    def _operation(self, parent: str, verb: str, target: str, response: dict | None) -> dict:
        self._op_counter += 1
        name = f"{parent}/operations/operation-{self._op_counter}"
        op = {
            "name": name,
            "metadata": {
                "@type": _TYPE + "OperationMetadata",
                "createTime": _now(),
                "endTime": _now(),
                "target": target,
                "verb": verb,
                "apiVersion": "v2",
            },
            "done": True,
            "response": response or {"@type": "type.googleapis.com/google.protobuf.Empty"},
        }
        self.ops[name] = op
        return op

    def create(self, parent: str, qr_id: str, body: dict[str, Any]) -> dict:
        if not re.match(r"^[a-z]([-a-z0-9]*[a-z0-9])?$", qr_id or ""):
            raise ApiError(400, "INVALID_ARGUMENT", f"invalid queuedResourceId {qr_id!r}")
        specs = body.get("tpu", {}).get("nodeSpec", [])
        if len(specs) != 1:
            raise ApiError(400, "INVALID_ARGUMENT", "the fake supports exactly one nodeSpec")
        node = specs[0].get("node", {})
        for field in ("acceleratorType", "runtimeVersion"):
            if not node.get(field):
                raise ApiError(400, "INVALID_ARGUMENT", f"tpu.nodeSpec[0].node.{field} is required")
        zone = parent.rsplit("/locations/", 1)[-1]
        try:  # the fake's own catalogue (Google's documentation), not the product's table
            hosts = check_node(node["acceleratorType"], zone, node["runtimeVersion"])
        except Refused as e:
            raise ApiError(400, "INVALID_ARGUMENT", str(e)) from None
        scheduling = node.get("schedulingConfig", {})
        if scheduling.get("spot") and scheduling.get("reserved"):
            raise ApiError(400, "INVALID_ARGUMENT", "a node cannot be both spot and reserved")
        if "spot" in body and not scheduling.get("spot"):
            raise ApiError(400, "INVALID_ARGUMENT", "a spot queued resource needs a spot node")
        email = node.get("serviceAccount", {}).get("email", "")
        if email and not re.match(r"^[^@\s]+@[^@\s]+$", email):
            raise ApiError(400, "INVALID_ARGUMENT", f"invalid service account email {email!r}")
        name = f"{parent}/queuedResources/{qr_id}"
        with self.lock:
            if name in self.qrs:
                raise ApiError(409, "ALREADY_EXISTS", f"{name} already exists")
            qr = {
                **body,
                "name": name,
                "createTime": _now(),
                "state": {"state": "ACCEPTED", "stateInitiator": "USER"},
            }
            self.qrs[name] = qr
            self._created_at[name] = time.monotonic()
            self._vms[name] = hosts
            return self._operation(
                parent, "create", name, {"@type": _TYPE + "QueuedResource", **qr}
            )

    def _lookup(self, table: dict[str, dict], name: str) -> dict:
        with self.lock:
            if name not in table:
                raise ApiError(404, "NOT_FOUND", f"{name} not found")
            return table[name]

    def get(self, name: str) -> dict:
        return self._lookup(self.qrs, name)

    def list(self, parent: str) -> dict:
        with self.lock:
            items = [q for n, q in sorted(self.qrs.items()) if n.startswith(parent + "/")]
            return {"queuedResources": items}

    def delete(self, name: str, force: bool) -> dict:
        with self.lock:
            qr = self.get(name)
            node_name = self._node_name(qr)
            if node_name in self.nodes and not force:
                raise ApiError(
                    400, "FAILED_PRECONDITION", f"{name} has a node: delete it or use force=true"
                )
            self._kill_hosts(node_name)
            self.hosts.pop(node_name, None)
            self.nodes.pop(node_name, None)
            del self.qrs[name]
            parent = name.split("/queuedResources/")[0]
            return self._operation(parent, "delete", name, None)

    def get_node(self, name: str) -> dict:
        return self._lookup(self.nodes, name)

    def get_operation(self, name: str) -> dict:
        return self._lookup(self.ops, name)

    def metadata(self, node_name: str, host: int, path: str) -> str:
        """The metadata server of host ``host`` of ``node_name``: the value at ``path``."""
        with self.lock:
            node = self.nodes.get(node_name)
            if node is None or host >= len(node.get("networkEndpoints", [])):
                raise ApiError(404, "NOT_FOUND", f"no host {host} of {node_name}")
            endpoints = node["networkEndpoints"]
            attributes = {
                **node.get("metadata", {}),
                "agent-worker-number": str(host),
                "accelerator-type": node["acceleratorType"],
                "tpu-env": tpu_catalog.tpu_env(node["acceleratorType"], host),
                "worker-network-endpoints": ",".join(
                    f"unknown:unknown:{e['ipAddress']}" for e in endpoints
                ),
            }
            if path.startswith("instance/attributes/"):
                key = path[len("instance/attributes/") :]
                if key in attributes:
                    return attributes[key]
            elif path == "instance/network-interfaces/0/ip":
                return node["networkEndpoints"][host]["ipAddress"]
            raise ApiError(404, "NOT_FOUND", f"metadata {path!r} not found")

    def libtpu_join(self, node_name: str, host: int, pid: int) -> dict:
        """The fake libtpu of process ``pid`` on host ``host`` joins its node's slice-wide
        runtime; returns the node's host count and the hosts whose joined process still runs
        (this boot's hosts only: a re-created node starts with none)."""
        with self.lock:
            hosts = self.hosts.get(node_name)
            if not hosts or host >= len(hosts):
                raise ApiError(404, "NOT_FOUND", f"no host {host} of {node_name}")
            joined = self.libtpu.setdefault(hosts[0].key, {})
            joined.setdefault(host, set()).add(pid)
            met = self.libtpu_met.setdefault(hosts[0].key, set())
            if pid in met:  # its runtime is up: the others may have finished since
                return {"hosts": len(hosts), "joined": list(range(len(hosts)))}
            live = {h: [p for p in pids if docker_cli.alive(p)] for h, pids in joined.items()}
            if len([h for h, pids in live.items() if pids]) == len(hosts):
                met.update(p for pids in live.values() for p in pids)  # the barrier passed
            return {"hosts": len(hosts), "joined": sorted(h for h, pids in live.items() if pids)}

    # ------------------------------------------------------------------ control
    def add_image(self, image: str) -> dict:
        """The docker stand-in's registry holds ``image`` from now on."""
        if not isinstance(image, str) or not image:
            raise ApiError(400, "INVALID_ARGUMENT", "image must be a non-empty string")
        with self.lock:
            if image not in self.images:
                self.images.append(image)
            self._write_registry()
            return {"images": list(self.images)}

    def _write_registry(self) -> None:
        os.makedirs(self.log_dir, exist_ok=True)
        tmp = self.registry_path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(self.images, fh)
        os.replace(tmp, self.registry_path)

    def _find(self, short_or_full: str) -> str:
        for name in self.qrs:
            if name == short_or_full or name.rsplit("/", 1)[-1] == short_or_full:
                return name
        raise ApiError(404, "NOT_FOUND", f"no queued resource {short_or_full!r}")

    def preempt(self, qr_id: str) -> dict:
        """A spot reclaim: the node and everything on it die at once."""
        with self.lock:
            name = self._find(qr_id)
            node_name = self._node_name(self.qrs[name])
            self._kill_hosts(node_name)
            if node_name in self.nodes:
                self.nodes[node_name]["state"] = "PREEMPTED"
            self.qrs[name]["state"] = {"state": "SUSPENDED", "stateInitiator": "SERVICE"}
            log.info("preempted %s", name)
            return {"name": name, "state": self.qrs[name]["state"]}

    def fail_capacity(self, qr_id: str) -> dict:
        with self.lock:
            name = self._find(qr_id)
            self._kill_hosts(self._node_name(self.qrs[name]))
            self.hosts.pop(self._node_name(self.qrs[name]), None)
            self.nodes.pop(self._node_name(self.qrs[name]), None)
            self.qrs[name]["state"] = {"state": "FAILED", "stateInitiator": "SERVICE"}
            return {"name": name, "state": self.qrs[name]["state"]}

    def state(self) -> dict:
        with self.lock:
            hosts = {n: [h.state() for h in hs] for n, hs in self.hosts.items()}
            agents = {}
            for n, states in hosts.items():
                pids = [c["pid"] for h in states for c in h["containers"].values() if c["running"]]
                if pids:
                    agents[n] = pids
            return {
                "queuedResources": {n: q["state"] for n, q in self.qrs.items()},
                "nodes": {n: nd["state"] for n, nd in self.nodes.items()},
                "hosts": hosts,
                "agents": agents,
                "images": list(self.images),
            }

    # ------------------------------------------------------------------ lifecycle
    @staticmethod
    def _node_name(qr: dict) -> str:
        spec = qr["tpu"]["nodeSpec"][0]
        return f"{spec['parent']}/nodes/{spec['nodeId']}"

    def _tick_loop(self) -> None:
        while not self._stop.wait(0.05):
            with self.lock:
                for name, qr in self.qrs.items():
                    if qr["state"]["state"] != "ACCEPTED":
                        continue
                    if time.monotonic() - self._created_at[name] < self.provision_delay_s:
                        continue
                    qr["state"] = {"state": "ACTIVE", "stateInitiator": "USER"}
                    node_name = self._node_name(qr)
                    node = dict(qr["tpu"]["nodeSpec"][0]["node"])
                    # a new VM per host, each with an address of its own (new ones every time)
                    addresses = allocate_host_addresses(self._vms[name])
                    node.update(
                        name=node_name,
                        state="READY",
                        createTime=_now(),
                        queuedResource=name,
                        health="HEALTHY",
                        networkEndpoints=[{"ipAddress": a, "port": 8470} for a in addresses],
                    )
                    self.nodes[node_name] = node
                    self._boot_hosts(node_name, node)

    def _boot_hosts(self, node_name: str, node: dict) -> None:
        """Every host of the node runs its startup script, as TPU VMs do when they boot."""
        script = node.get("metadata", {}).get("startup-script")
        if not self.run_agents or not script:
            return
        self._boots += 1
        short = node_name.rsplit("/", 1)[-1]
        hosts = [
            FakeTpuVm(
                node_name,
                k,
                endpoint["ipAddress"],
                os.path.join(self.log_dir, f"{short}-{self._boots}", f"host-{k}"),
                f"{self.url}/fake/metadata/{node_name}/hosts/{k}/computeMetadata/v1",
                f"{self.url}/fake/libtpu/{node_name}/hosts/{k}/join",
                self.registry_path,
                self.python,
            )
            for k, endpoint in enumerate(node["networkEndpoints"])
        ]
        self.hosts[node_name] = hosts
        for host in hosts:
            host.boot(script)
        log.info("node %s READY; %d host(s) booting (%s)", node_name, len(hosts), self.log_dir)

    def _kill_hosts(self, node_name: str) -> None:
        """SIGKILLs every process of every host of the node at once, as a reclaim does."""
        hosts = self.hosts.get(node_name, [])
        if hosts:
            killed = kill_hosts(hosts)
            log.info("killed %d process(es) on the hosts of %s", len(killed), node_name)

    def close(self) -> None:
        self._stop.set()
        with self.lock:
            for node_name in list(self.hosts):
                self._kill_hosts(node_name)


# ---------------------------------------------------------------------- HTTP
_ROUTES = [
    ("POST", re.compile(rf"^/v2/{_PARENT}/queuedResources$"), "create"),
    ("GET", re.compile(rf"^/v2/{_PARENT}/queuedResources$"), "list"),
    ("GET", re.compile(rf"^/v2/(?P<name>{_PARENT}/queuedResources/[^/]+)$"), "get"),
    ("DELETE", re.compile(rf"^/v2/(?P<name>{_PARENT}/queuedResources/[^/]+)$"), "delete"),
    ("GET", re.compile(rf"^/v2/(?P<name>{_PARENT}/nodes/[^/]+)$"), "get_node"),
    ("GET", re.compile(rf"^/v2/(?P<name>{_PARENT}/operations/[^/]+)$"), "get_operation"),
    ("POST", re.compile(r"^/fake/preempt$"), "preempt"),
    ("POST", re.compile(r"^/fake/fail-capacity$"), "fail_capacity"),
    ("POST", re.compile(r"^/fake/images$"), "add_image"),
    ("GET", re.compile(r"^/fake/state$"), "state"),
    (
        "POST",
        re.compile(rf"^/fake/libtpu/(?P<node>{_PARENT}/nodes/[^/]+)/hosts/(?P<host>\d+)/join$"),
        "libtpu_join",
    ),
]


_METADATA = re.compile(
    rf"^/fake/metadata/(?P<node>{_PARENT}/nodes/[^/]+)/hosts/(?P<host>\d+)"
    r"/computeMetadata/v1/(?P<path>.*)$"
)


def _make_handler(fake: FakeCloudTpu) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt: str, *args: Any) -> None:
            log.debug("%s " + fmt, self.address_string(), *args)

        def _reply(self, code: int, obj: dict) -> None:
            send_json(self, code, obj)

        def _dispatch(self, method: str) -> None:
            url = urllib.parse.urlsplit(self.path)
            query = {k: v[-1] for k, v in urllib.parse.parse_qs(url.query).items()}
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}") if length else {}
            try:
                for verb, pattern, action in _ROUTES:
                    m = pattern.match(url.path) if verb == method else None
                    if m is None:
                        continue
                    g = m.groupdict()
                    if action == "create":
                        out = fake.create(g["parent"], query.get("queuedResourceId", ""), body)
                    elif action == "list":
                        out = fake.list(g["parent"])
                    elif action == "delete":
                        out = fake.delete(g["name"], query.get("force", "") in ("true", "1"))
                    elif action in ("preempt", "fail_capacity"):
                        out = getattr(fake, action)(body.get("name", ""))
                    elif action == "add_image":
                        out = fake.add_image(body.get("image", ""))
                    elif action == "state":
                        out = fake.state()
                    elif action == "libtpu_join":
                        out = fake.libtpu_join(g["node"], int(g["host"]), int(body.get("pid", 0)))
                    else:
                        out = getattr(fake, action)(g["name"])
                    self._reply(200, out)
                    return
                raise ApiError(404, "NOT_FOUND", f"no route for {method} {url.path}")
            except ApiError as e:
                self._reply(
                    e.code, {"error": {"code": e.code, "message": e.message, "status": e.status}}
                )

        def _metadata(self, m: re.Match) -> None:
            """The metadata server of one host: text values, as the real one serves them."""
            if self.headers.get("Metadata-Flavor") != "Google":
                code, text = 403, "Missing Metadata-Flavor:Google header.\n"
            else:
                try:
                    code, text = 200, fake.metadata(m["node"], int(m["host"]), m["path"])
                except ApiError as e:
                    code, text = e.code, e.message + "\n"
            data = text.encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/text")
            self.send_header("Metadata-Flavor", "Google")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 - http.server naming
            m = _METADATA.match(urllib.parse.urlsplit(self.path).path)
            if m is not None:
                self._metadata(m)
                return
            self._dispatch("GET")

        def do_POST(self) -> None:  # noqa: N802
            self._dispatch("POST")

        def do_DELETE(self) -> None:  # noqa: N802
            self._dispatch("DELETE")

    return Handler


class FakeCloudTpuServer:
    """The fake behind an HTTP server on a background thread (``url`` once started)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, **fake_kwargs: Any) -> None:
        self.fake = FakeCloudTpu(**fake_kwargs)
        self.httpd = ThreadingHTTPServer((host, port), _make_handler(self.fake))
        self.httpd.daemon_threads = True
        self.url = f"http://{host}:{self.httpd.server_address[1]}"
        self.fake.url = self.url
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def start(self) -> FakeCloudTpuServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.fake.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--provision-delay", type=float, default=0.5, help="ACCEPTED → ACTIVE seconds")
    p.add_argument("--no-agents", action="store_true", help="do not run the startup scripts")
    p.add_argument("--log-dir", default=None, help="where the hosts' files and logs go")
    p.add_argument(
        "--image",
        action="append",
        default=[],
        help="an image the registry holds (repeatable): the one the backend's image setting names",
    )
    args = p.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    server = FakeCloudTpuServer(
        args.host,
        args.port,
        provision_delay_s=args.provision_delay,
        run_agents=not args.no_agents,
        log_dir=args.log_dir,
        images=args.image,
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    server.start()
    print(server.url, flush=True)
    stop.wait()
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
