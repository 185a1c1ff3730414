"""`airflow standalone` in a subprocess for the browser test: a temporary AIRFLOW_HOME (SQLite), the
repo's dags/ and plugins/, free ports on 127.0.0.1, and a clean stop of everything it started.
``Components`` starts the same Airflow as separate processes (api-server, scheduler,
dag-processor, triggerer), each of which a test may kill and start again (the fault drills).

Every process started here carries ``RLAX_TEST_TAG=<uuid>`` in its environment: the local compute
backend starts each `rlax` job in a session of its own (so that it outlives the task process that
started it), outside the standalone's process group, and ``stop`` finds those by the tag too.
"""

from __future__ import annotations

import glob
import json
import os
import signal
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

from rlax_tasks.process.ports import free_port
from tests.conftest import TEST_XLA_FLAGS
from tests.dags.conftest import DAGS, PLUGINS

TAG_ENV = "RLAX_TEST_TAG"
DAG_ID = "rlax_train"
_LOCAL = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # 127.0.0.1: no proxy


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
        # the scheduler's and the triggerer's log servers (fixed ports by default)
        worker_log = free_port(taken=[self.port])
        self.log_ports = (worker_log, free_port(taken=[self.port, worker_log]))
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
                "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(self.log_ports[0]),
                "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(self.log_ports[1]),
                "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
                "AIRFLOW__SCHEDULER__SCHEDULER_HEARTBEAT_SEC": "2",
                # the LocalExecutor forks this many workers at start (Airflow's 32 took the
                # standalone 8-36 s longer to be ready on 2 cores; a run's tasks defer)
                "AIRFLOW__CORE__PARALLELISM": "8",
                "RLAX_RUN_ROOT": self.run_root,
                "RLAX_RUN_ROOTS": self.run_root,
                # a failing job is retried after seconds, not minutes: the test stays bounded
                "RLAX_RETRY_DELAY_S": "5",
                "RLAX_SIBLING_GRACE_S": "60",
                "RLAX_POLL_INTERVAL_S": "2",  # slices and jobs checked every 2 s, not 10-15 s
                "PYTHONUNBUFFERED": "1",  # the log tail must be current when a test fails
                "JAX_PLATFORMS": "cpu",
                "XLA_FLAGS": TEST_XLA_FLAGS,
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

    def exited(self) -> str:
        """What exited when ``alive()`` says no."""
        return f"airflow standalone exited with {self.proc.returncode if self.proc else None}"

    def log_tail(self, lines: int = 60) -> str:
        return tail(self.log_path, lines)

    def log_title(self) -> str:
        return f"airflow standalone log tail ({self.log_path})"

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

    def send(self, method: str, path: str, body: Any, timeout: float = 30) -> Any:
        """``method`` (POST, PATCH) of the JSON ``body`` to ``path`` on the api-server; the
        JSON answer (raises urllib's errors)."""
        req = urllib.request.Request(
            self.base_url + path,
            data=json.dumps(body).encode(),
            method=method,
            headers={
                "Authorization": f"Bearer {self.token()}",
                "Accept": "application/json",
                "Content-Type": "application/json",
            },
        )
        with _LOCAL.open(req, timeout=timeout) as r:
            return json.load(r)

    def trigger(self, conf: dict[str, Any]) -> str:
        """Unpauses rlax_train and triggers it with ``conf`` (its Params); the DAG run's id."""
        self.send("PATCH", f"/api/v2/dags/{DAG_ID}", {"is_paused": False})
        run = self.send(
            "POST", f"/api/v2/dags/{DAG_ID}/dagRuns", {"logical_date": None, "conf": conf}
        )
        return run["dag_run_id"]

    def wait_ready(self, timeout: float = 240) -> None:
        """Until the api-server answers, every component is healthy and the DAG is parsed
        (an import error of the DAG file fails at once)."""

        def ready() -> bool:
            if not self.alive():
                raise RuntimeError(self.exited())
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
        parts.append(f"--- {self.log_title()}:\n{self.log_tail()}")
        return "\n".join(p for p in parts if p)


# --------------------------------------------------------------------------- separate components
COMPONENTS = ("api-server", "dag-processor", "scheduler", "triggerer")
SIMPLE_AUTH_MANAGER = (
    "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager"
)


class Components(Standalone):
    """Airflow's components as separate processes under ``root`` (``<component>.log`` each),
    with the Standalone's environment, REST API and reports: what `airflow standalone` runs,
    except that its supervisor is left out so that a test can SIGKILL one component and start
    it again. The database is migrated first (that also writes airflow.cfg, whose generated JWT
    secret every component must share). SQLite with the LocalExecutor, as the standalone's."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.log_path = os.path.join(root, "migrate.log")
        self.procs: dict[str, subprocess.Popen] = {}

    def env(self) -> dict[str, str]:
        env = super().env()
        env.update(
            {
                "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",  # what the standalone forces
                "AIRFLOW__CORE__AUTH_MANAGER": SIMPLE_AUTH_MANAGER,
                # a killed triggerer's triggers go to the next one after seconds, not 30 s
                "AIRFLOW__TRIGGERER__JOB_HEARTBEAT_SEC": "2",
                "AIRFLOW__TRIGGERER__TRIGGERER_HEALTH_CHECK_THRESHOLD": "10",
                "RLAX_RETRY_DELAY_S": "1",  # a killed job's task is retried at once
            }
        )
        return env

    def _airflow(self) -> str:
        return os.path.join(os.path.dirname(sys.executable), "airflow")

    def start(self) -> None:
        """Migrates the database, then starts every component."""
        with open(self.log_path, "ab") as log:
            code = subprocess.call(
                [self._airflow(), "db", "migrate"],
                cwd=self.cwd,
                env=self.env(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=300,
            )
        if code != 0:
            raise RuntimeError(f"airflow db migrate exited with {code}:\n{tail(self.log_path, 30)}")
        for name in COMPONENTS:
            self.start_component(name)

    def start_component(self, name: str) -> int:
        """Starts ``airflow <name>`` in a process group of its own; its pid."""
        if name not in COMPONENTS:
            raise ValueError(f"component {name!r}: expected one of {COMPONENTS}")
        with open(os.path.join(self.root, f"{name}.log"), "ab") as log:
            self.procs[name] = subprocess.Popen(
                [self._airflow(), name],
                cwd=self.cwd,
                env=self.env(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # kill_component takes its children with it
            )
        return self.procs[name].pid

    def kill_component(self, name: str, timeout: float = 30) -> None:
        """SIGKILLs ``name`` and the rest of its process group (log server, executor workers,
        trigger runner), as when its machine dies, and waits until all of them are gone."""
        proc = self.procs[name]
        try:
            leader = psutil.Process(proc.pid)
            group = [leader, *leader.children(recursive=True)]
        except psutil.Error:
            group = []  # already gone
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=timeout)
        wait_for(f"airflow {name}'s processes to die", lambda: not _running(group), timeout, 0.2)

    def alive(self) -> bool:
        return bool(self.procs) and all(p.poll() is None for p in self.procs.values())

    def exited(self) -> str:
        codes = {n: p.poll() for n, p in self.procs.items() if p.poll() is not None}
        return f"airflow components exited: {codes or 'none started'}\n{self.log_tail()}"

    def stop(self) -> list[str]:
        """Stops every component (SIGKILL: a test's Airflow leaves nothing worth a graceful
        shutdown), then whatever else carries the tag: task processes, the `rlax` jobs; the
        command lines of those that had to be killed."""
        killed = []
        for name, proc in self.procs.items():
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                killed.append(f"airflow {name} (pid {proc.pid}) did not exit")
        return killed + stop_tagged(self.tag)

    def log_tail(self, lines: int = 60) -> str:
        parts = []
        for name in COMPONENTS:
            path = os.path.join(self.root, f"{name}.log")
            parts.append(f"--- {name} ({path}):\n{tail(path, max(10, lines // 3))}")
        return "\n".join(parts)

    def log_title(self) -> str:
        return f"log tails of the airflow components (under {self.root})"
