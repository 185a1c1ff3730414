"""A local fake of the Cloud TPU v2 REST API subset RLAX uses, for development and tests.

``python -m infra.fakes.cloud_tpu --port 0`` prints its URL (``http://127.0.0.1:PORT``) on the
first line of stdout and serves until killed. Point the real client at it with
``client_options={"api_endpoint": URL}``, ``AnonymousCredentials()`` and ``transport="rest"``
(the REST transport keeps an explicit ``http://`` scheme, so no TLS is needed) — the
``cloud_tpu`` backend does this with ``api_endpoint=URL, anonymous=True``.

Served (JSON, as the real API; errors as ``{"error": {code, message, status}}``):
- ``POST   /v2/{parent}/queuedResources?queuedResourceId=ID``  → long-running operation
- ``GET    /v2/{parent}/queuedResources``                      list
- ``GET    /v2/{parent}/queuedResources/ID``                   get
- ``DELETE /v2/{parent}/queuedResources/ID[?force=true]``      → long-running operation
- ``GET    /v2/{parent}/nodes/ID``                             the node of a queued resource
- ``GET    /v2/{parent}/operations/OP``                        operation polling

Life of a queued resource: ACCEPTED → (after ``--provision-delay`` s) ACTIVE with its node READY.
When the node becomes READY the fake does what ``infra/tpu/startup.sh`` does on a real node,
minus Docker: it starts the node agent (``python -m rlax_tasks.compute.agent``) with the slice
root and entrypoint from the node metadata (``--no-agents`` turns this off).

Control endpoints (not part of the real API):
- ``POST /fake/preempt {"name": ID}``: kills the node's agent and jobs (SIGKILL), node → PREEMPTED,
  queued resource → SUSPENDED by SERVICE, as a spot reclaim does.
- ``POST /fake/fail-capacity {"name": ID}``: queued resource → FAILED by SERVICE.
- ``GET  /fake/state``: every queued resource, node state and agent pid.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

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
    ) -> None:
        self.provision_delay_s = provision_delay_s
        self.run_agents = run_agents
        self.log_dir = log_dir
        self.python = python
        self.lock = threading.RLock()
        self.qrs: dict[str, dict[str, Any]] = {}
        self.nodes: dict[str, dict[str, Any]] = {}
        self.ops: dict[str, dict[str, Any]] = {}
        self.agents: dict[str, subprocess.Popen] = {}
        self._created_at: dict[str, float] = {}
        self._op_counter = 0
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
            return self._operation(
                parent, "create", name, {"@type": _TYPE + "QueuedResource", **qr}
            )

    def get(self, name: str) -> dict:
        with self.lock:
            if name not in self.qrs:
                raise ApiError(404, "NOT_FOUND", f"{name} not found")
            return self.qrs[name]

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
            self._kill_agent(node_name)
            self.nodes.pop(node_name, None)
            del self.qrs[name]
            parent = name.split("/queuedResources/")[0]
            return self._operation(parent, "delete", name, None)

    def get_node(self, name: str) -> dict:
        with self.lock:
            if name not in self.nodes:
                raise ApiError(404, "NOT_FOUND", f"{name} not found")
            return self.nodes[name]

    def get_operation(self, name: str) -> dict:
        with self.lock:
            if name not in self.ops:
                raise ApiError(404, "NOT_FOUND", f"{name} not found")
            return self.ops[name]

    # ------------------------------------------------------------------ control
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
            self._kill_agent(node_name)
            if node_name in self.nodes:
                self.nodes[node_name]["state"] = "PREEMPTED"
            self.qrs[name]["state"] = {"state": "SUSPENDED", "stateInitiator": "SERVICE"}
            log.info("preempted %s", name)
            return {"name": name, "state": self.qrs[name]["state"]}

    def fail_capacity(self, qr_id: str) -> dict:
        with self.lock:
            name = self._find(qr_id)
            self._kill_agent(self._node_name(self.qrs[name]))
            self.nodes.pop(self._node_name(self.qrs[name]), None)
            self.qrs[name]["state"] = {"state": "FAILED", "stateInitiator": "SERVICE"}
            return {"name": name, "state": self.qrs[name]["state"]}

    def state(self) -> dict:
        with self.lock:
            return {
                "queuedResources": {n: q["state"] for n, q in self.qrs.items()},
                "nodes": {n: nd["state"] for n, nd in self.nodes.items()},
                "agents": {n: p.pid for n, p in self.agents.items() if p.poll() is None},
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
                    node.update(
                        name=node_name,
                        state="READY",
                        createTime=_now(),
                        queuedResource=name,
                        health="HEALTHY",
                    )
                    self.nodes[node_name] = node
                    self._start_agent(node_name, node)

    def _start_agent(self, node_name: str, node: dict) -> None:
        """What the startup script does on a real node, without Docker."""
        md = node.get("metadata", {})
        if not self.run_agents or "rlax-slice-root" not in md:
            return
        cmd = [
            self.python,
            "-m",
            "rlax_tasks.compute.agent",
            "--slice-root",
            md["rlax-slice-root"],
            "--entrypoint",
            md.get("rlax-entrypoint", '["rlax"]'),
            "--poll",
            md.get("rlax-agent-poll-s", "2"),
            "--worker",
            "0",
        ]
        out = subprocess.DEVNULL
        if self.log_dir:
            os.makedirs(self.log_dir, exist_ok=True)
            short = node_name.rsplit("/", 1)[-1]
            out = open(os.path.join(self.log_dir, f"agent-{short}.log"), "ab")  # noqa: SIM115
        self.agents[node_name] = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True
        )
        log.info("node %s READY; agent pid %d", node_name, self.agents[node_name].pid)

    def _kill_agent(self, node_name: str) -> None:
        proc = self.agents.pop(node_name, None)
        if proc is None:
            return
        import psutil

        try:
            family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            family = []
        for p in family:  # SIGKILL every process of the node at once, as a reclaim does
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        proc.wait()

    def close(self) -> None:
        self._stop.set()
        with self.lock:
            for node_name in list(self.agents):
                self._kill_agent(node_name)


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
    ("GET", re.compile(r"^/fake/state$"), "state"),
]


def _make_handler(fake: FakeCloudTpu) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt: str, *args: Any) -> None:
            log.debug("%s " + fmt, self.address_string(), *args)

        def _reply(self, code: int, obj: dict) -> None:
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

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
                    elif action == "state":
                        out = fake.state()
                    else:
                        out = getattr(fake, action)(g["name"])
                    self._reply(200, out)
                    return
                raise ApiError(404, "NOT_FOUND", f"no route for {method} {url.path}")
            except ApiError as e:
                self._reply(
                    e.code, {"error": {"code": e.code, "message": e.message, "status": e.status}}
                )

        def do_GET(self) -> None:  # noqa: N802 - http.server naming
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
    p.add_argument("--no-agents", action="store_true", help="do not run node agents")
    p.add_argument("--log-dir", default=None, help="where node agents' logs go")
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
