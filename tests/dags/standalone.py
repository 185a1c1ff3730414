"""`airflow standalone` in a subprocess for the browser test: a temporary AIRFLOW_HOME (SQLite), the
repo's dags/ and plugins/, free ports on 127.0.0.1, and a clean stop of everything it started.

Every process started here carries ``RLAX_TEST_TAG=<uuid>`` in its environment: the local compute
backend starts each `rlax` job in a session of its own (so that it outlives the task process that
started it), outside the standalone's process group, and ``stop`` finds those by the tag too.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable
from typing import Any

import psutil

from tests.dags.conftest import DAGS, PLUGINS

TAG_ENV = "RLAX_TEST_TAG"
DAG_ID = "rlax_train"
_LOCAL = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # 127.0.0.1: no proxy


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(path: str, lines: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 256 * 1024))
            text = f.read().decode("utf-8", errors="replace")
    except OSError as e:
        return f"({path}: {e})"
    return "\n".join(text.splitlines()[-lines:])


def wait_for(what: str, check: Callable[[], Any], timeout: float, interval: float = 1.0) -> Any:
    """``check()``'s first truthy value, polled every ``interval`` s; TimeoutError after
    ``timeout`` s (``check`` may raise to give up at once)."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not after {timeout:.0f}s")
        time.sleep(interval)


def _tagged_processes(tag: str) -> list[psutil.Process]:
    out = []
    for proc in psutil.process_iter():
        try:
            if proc.pid != os.getpid() and proc.environ().get(TAG_ENV) == tag:
                out.append(proc)
        except (psutil.Error, OSError):
            continue  # gone, or not ours to read
    return out


def _running(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            continue
    return out


def stop_tagged(tag: str, leader: int | None = None) -> list[str]:
    """Stops every process carrying ``tag``: SIGINT first (Airflow's components shut down
    gracefully and quickly; ``leader``, the standalone, is left out: it hangs on SIGINT), then
    SIGTERM, then SIGKILL; the command lines of the processes that had to be killed."""
    killed: list[str] = []
    for sig, wait_s in ((signal.SIGINT, 15.0), (signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        procs = _running(_tagged_processes(tag))
        targets = [p for p in procs if sig != signal.SIGINT or p.pid != leader]
        for p in targets:
            try:
                if sig == signal.SIGKILL:
                    killed.append(" ".join(p.cmdline())[:160])
                p.send_signal(sig)
            except psutil.Error:
                pass
        deadline = time.monotonic() + wait_s
        while _running(targets) and time.monotonic() < deadline:
            time.sleep(0.2)
    return killed


class Standalone:
    """One `airflow standalone` under ``root`` (home/, runs/, cwd/, standalone.log)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.home = os.path.join(root, "airflow-home")
        self.run_root = os.path.join(root, "runs")
        self.cwd = os.path.join(root, "cwd")
        self.log_path = os.path.join(root, "standalone.log")
        for d in (self.home, self.run_root, self.cwd):
            os.makedirs(d, exist_ok=True)
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.tag = uuid.uuid4().hex
        self.proc: subprocess.Popen | None = None
        self._token: str | None = None

    # ----------------------------------------------------------------- lifecycle
    def env(self) -> dict[str, str]:
        # nothing Airflow-related from the test session (tests/dags/conftest.py sets its own
        # AIRFLOW_HOME and unit-test mode), nor the 8 fake XLA devices of tests/conftest.py
        env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
        bin_dir = os.path.dirname(sys.executable)  # standalone starts `airflow` from PATH
        env.update(
            {
                "PATH": bin_dir + os.pathsep + env.get("PATH", ""),
                "AIRFLOW_HOME": self.home,
                "AIRFLOW__CORE__DAGS_FOLDER": DAGS,
                "AIRFLOW__CORE__PLUGINS_FOLDER": PLUGINS,
                "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
                "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True",
                "AIRFLOW__API__HOST": "127.0.0.1",
                "AIRFLOW__API__PORT": str(self.port),
                "AIRFLOW__API__BASE_URL": self.base_url,
                "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{self.base_url}/execution/",
                # the log servers of the scheduler and the triggerer: fixed ports by default
                "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(free_port()),
                "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(free_port()),
                "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
                "AIRFLOW__SCHEDULER__SCHEDULER_HEARTBEAT_SEC": "2",
                "RLAX_RUN_ROOT": self.run_root,
                "RLAX_RUN_ROOTS": self.run_root,
                # a failing job is retried after seconds, not minutes: the test stays bounded
                "RLAX_RETRY_DELAY_S": "5",
                "RLAX_SIBLING_GRACE_S": "60",
                "PYTHONUNBUFFERED": "1",  # the log tail must be current when a test fails
                "JAX_PLATFORMS": "cpu",
                "XLA_FLAGS": "",
                TAG_ENV: self.tag,
            }
        )
        return env

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [os.path.join(os.path.dirname(sys.executable), "airflow"), "standalone"],
                cwd=self.cwd,
                env=self.env(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: stop() signals all of it
            )

    def stop(self) -> list[str]:
        """Stops everything the standalone started: its components, their task processes and
        the `rlax` jobs, which run in sessions of their own (see ``stop_tagged``); the command
        lines of what had to be killed."""
        killed = stop_tagged(self.tag, leader=self.proc.pid if self.proc else None)
        if self.proc is not None:
            try:  # anything left in the standalone's process group
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                killed.append(f"airflow standalone (pid {self.proc.pid}) did not exit")
        return killed

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 60) -> str:
        return tail(self.log_path, lines)

    # ----------------------------------------------------------------- REST API
    def token(self) -> str:
        if self._token is None:  # all-admins simple auth: a token for anyone who asks
            with _LOCAL.open(f"{self.base_url}/auth/token", timeout=10) as r:
                self._token = json.load(r)["access_token"]
        return self._token

    def get(self, path: str, timeout: float = 30) -> Any:
        """GET ``path`` on the api-server as JSON (raises urllib's errors)."""
        req = urllib.request.Request(
            self.base_url + path,
            headers={"Authorization": f"Bearer {self.token()}", "Accept": "application/json"},
        )
        with _LOCAL.open(req, timeout=timeout) as r:
            return json.load(r)

    def wait_ready(self, timeout: float = 240) -> None:
        """Until the api-server answers, every component is healthy and the DAG is parsed
        (an import error of the DAG file fails at once)."""

        def ready() -> bool:
            if not self.alive():
                raise RuntimeError(f"airflow standalone exited with {self.proc.returncode}")
            try:
                health = self.get("/api/v2/monitor/health", timeout=5)
                if any(v.get("status") != "healthy" for v in health.values()):
                    return False
                errors = self.get("/api/v2/importErrors", timeout=5)["import_errors"]
                for e in errors:
                    if e["filename"].endswith(f"{DAG_ID}.py"):
                        raise RuntimeError(f"{DAG_ID} does not import:\n{e['stack_trace']}")
                self.get(f"/api/v2/dags/{DAG_ID}", timeout=5)
                return True
            except (urllib.error.URLError, OSError, ValueError, KeyError):
                return False  # not up yet (URLError covers HTTP 404 until the DAG is parsed)

        wait_for("airflow standalone ready with DAG rlax_train", ready, timeout, interval=2)

    def dag_run(self, dag_run_id: str) -> dict[str, Any]:
        quoted = urllib.parse.quote(dag_run_id, safe="")
        return self.get(f"/api/v2/dags/{DAG_ID}/dagRuns/{quoted}")

    def task_instances(self, dag_run_id: str) -> list[dict[str, Any]]:
        quoted = urllib.parse.quote(dag_run_id, safe="")
        path = f"/api/v2/dags/{DAG_ID}/dagRuns/{quoted}/taskInstances?limit=200"
        return self.get(path)["task_instances"]

    # ----------------------------------------------------------------- diagnostics
    def task_states(self, dag_run_id: str) -> dict[str, str]:
        out = {}
        for ti in self.task_instances(dag_run_id):
            key = ti["task_id"] + (f"[{ti['map_index']}]" if ti["map_index"] >= 0 else "")
            out[key] = f"{ti['state']} (try {ti['try_number']})"
        return out

    def task_log_summary(self, dag_run_id: str, task_key: str, lines: int = 12) -> str:
        """The last events of a task's newest attempt log, errors first-class."""
        task_id, _, rest = task_key.partition("[")
        parts = [self.home, "logs", f"dag_id={DAG_ID}", f"run_id={dag_run_id}"]
        parts.append(f"task_id={task_id}")
        if rest:
            parts.append(f"map_index={rest.rstrip(']')}")
        pattern = os.path.join(*(glob.escape(p) for p in parts), "attempt=*.log")
        attempts = sorted(glob.glob(pattern), key=os.path.getmtime)
        if not attempts:
            return "(no log)"
        out = []
        for line in tail(attempts[-1], 400).splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                out.append(line[:300])
                continue
            if not isinstance(event, dict):
                continue
            text = f"{event.get('level', '')}: {str(event.get('event', ''))[:400]}"
            for err in event.get("error_detail") or []:
                text += f"\n    {err.get('exc_type')}: {str(err.get('exc_value'))[:800]}"
            out.append(text)
        return f"{os.path.basename(attempts[-1])}:\n  " + "\n  ".join(out[-lines:])

    def job_stderr_tails(self, run_id: str, lines: int = 15) -> str:
        """stderr tails of the run's `rlax` jobs that exited non-zero (local backend layout)."""
        out = []
        pattern = os.path.join(glob.escape(self.run_root), run_id, "slices", "*", "jobs", "*")
        for job_dir in sorted(glob.glob(pattern)):
            try:
                with open(os.path.join(job_dir, "exit.json")) as f:
                    code = json.load(f).get("returncode")
            except (OSError, ValueError):
                continue
            if code not in (0, None):
                stderr = tail(os.path.join(job_dir, "stderr.log"), lines)
                out.append(f"--- job {os.path.basename(job_dir)} (exit {code}) stderr:\n{stderr}")
        return "\n".join(out)

    def report(self, dag_run_id: str | None, run_id: str | None) -> str:
        """What went wrong, for an assertion message: task states, the failed tasks' log
        excerpts, the failed jobs' stderr and the standalone log tail."""
        parts = []
        if dag_run_id:
            try:
                states = self.task_states(dag_run_id)
                parts.append("task states: " + json.dumps(states, indent=1))
                for key, state in states.items():
                    if state.split()[0] in ("failed", "up_for_retry", "upstream_failed"):
                        summary = self.task_log_summary(dag_run_id, key)
                        parts.append(f"--- task {key} ({state}) {summary}")
            except Exception as e:  # noqa: BLE001 - a report must not hide the real failure
                parts.append(f"(task states unavailable: {e!r})")
        if run_id:
            parts.append(self.job_stderr_tails(run_id))
        parts.append(f"--- airflow standalone log tail ({self.log_path}):\n{self.log_tail()}")
        return "\n".join(p for p in parts if p)
