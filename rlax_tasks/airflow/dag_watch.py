"""What a person sees of an `rlax airflow train` run while it goes: one line per task
transition, the training status line, new notices, and the end of a failed task's log.

``DagRunWatcher`` is a thread beside ``dag.test()``: every ``poll_s`` it reads the task states
from Airflow's metadata database and the run's files. It writes nothing but its lines."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TextIO

from rlax_tasks.run.progress import format_duration, status_line, trained_step
from rlax_tasks.rundir import notices

log = logging.getLogger(__name__)

# states worth a line (scheduled / queued / none are the runner's bookkeeping)
SHOWN = frozenset(
    {"running", "deferred", "success", "failed", "skipped", "up_for_retry", "up_for_reschedule",
     "upstream_failed", "removed"}
)  # fmt: skip
STARTED = frozenset({"queued", "running"})  # dag.test() keeps a starting or deferred task queued
ACTIVE = frozenset({"scheduled", "queued", "running", "deferred", "up_for_reschedule"})
FINISHED = frozenset({"success", "failed", "skipped", "upstream_failed", "removed"})
TRAINING_TASKS = ("controller",)  # the task watching the job whose steps the status line shows
FAILED_TAIL_LINES = 30  # a failed task's log lines shown
RETRY_TAIL_LINES = 8  # ...and those of a try that will be retried
MAX_LINE_CHARS = 400
# the task runner's bookkeeping lines, left out of a failed task's tail
_BOOKKEEPING = (
    "::group::", "::endgroup::", "Task instance state updated", "[DAG TEST]", "Pushing xcom",
    "RenderedTaskInstanceFields", "Task started",
)  # fmt: skip

TaskStates = Callable[[], dict[str, str]]


class DagRunWatcher(threading.Thread):
    """Prints the progress of one DAG run to ``out`` (see the module docstring).

    ``task_states``: returns {task id (``id[i]`` when mapped): state}; ``steps``: the run's total
    training steps; ``airflow_log``: the file of the task logs (None: no tails)."""

    def __init__(
        self,
        out: TextIO,
        task_states: TaskStates,
        run_dir: str,
        steps: int,
        airflow_log: str | None,
        *,
        poll_s: float = 1.0,
        status_every_s: float = 5.0,
        quiet_status_s: float = 30.0,
    ) -> None:
        super().__init__(name="dag-watch", daemon=True)
        self.out, self.task_states, self.run_dir, self.steps = out, task_states, run_dir, steps
        self.airflow_log = airflow_log
        self.poll_s, self.status_every_s, self.quiet_status_s = (
            poll_s, status_every_s, quiet_status_s,
        )  # fmt: skip
        self.t0 = time.monotonic()
        self.states: dict[str, str] = {}
        self.training_started: float | None = None
        self.training_seconds: float | None = None
        self._announced: set[str] = set()  # tasks whose current try was shown running
        self._marks: dict[str, int] = {}  # task -> Airflow log size before its try started
        self._notice_offset = notices.read_since(run_dir, 0)[1]  # new notices only
        self._status_at, self._status_step = 0.0, -1
        self._halt = threading.Event()
        self._lock = threading.Lock()  # one poll at a time (the thread's and the final one)

    # ------------------------------------------------------------------ loop
    def run(self) -> None:
        while not self._halt.wait(self.poll_s):
            try:
                self.poll()
            except Exception as e:  # noqa: BLE001 - watching must never stop the run
                log.warning("watching the DAG run: %s", e)

    def stop(self) -> None:
        """Stops the thread, then reads the final states (the last tasks end between polls)."""
        self._halt.set()
        if self.is_alive():
            self.join(timeout=30)
        try:
            self.poll(final=True)
        except Exception as e:  # noqa: BLE001
            log.warning("watching the DAG run: %s", e)

    def poll(self, final: bool = False) -> None:
        """One round: task transitions, new notices, the status line while training."""
        with self._lock:
            log_size = _size(self.airflow_log)
            for task, state in self.task_states().items():
                old = self.states.get(task)
                if state != old:
                    self.states[task] = state
                    self._transition(task, state)
                if state not in ACTIVE or old not in ACTIVE:
                    self._marks[task] = log_size  # its next try logs after this
            found, self._notice_offset = notices.read_since(self.run_dir, self._notice_offset)
            for notice in found:
                self._print(notice.format())
            if not final:
                self._maybe_status()

    # ------------------------------------------------------------------ lines
    def _print(self, text: str, stamp: bool = True) -> None:
        prefix = f"[{format_duration(time.monotonic() - self.t0):>7}] " if stamp else ""
        self.out.write("".join(f"{prefix}{line}\n" for line in text.splitlines()))
        self.out.flush()

    def _transition(self, task: str, state: str) -> None:
        if task.partition("[")[0] in TRAINING_TASKS:
            self._training(state)
        if state in STARTED:  # one "running" line a try (dag.test: queued while it runs)
            if task in self._announced:
                return
            self._announced.add(task)
            state = "running"
        elif state == "up_for_retry":
            self._announced.discard(task)
        if state not in SHOWN:
            return
        self._print(f"{task:<16} {state}")
        if state in ("failed", "up_for_retry") and self.airflow_log:
            n = FAILED_TAIL_LINES if state == "failed" else RETRY_TAIL_LINES
            tail = self.task_log_tail(task, n)
            if tail:
                why = "the end of its log" if state == "failed" else "why (it will be retried)"
                self._print(f"  {task} {state}: {why}, from {self.airflow_log}:")
                self._print("\n".join("  | " + ln[:MAX_LINE_CHARS] for ln in tail), stamp=False)

    def _training(self, state: str) -> None:
        now = time.monotonic()
        if state in STARTED and self.training_started is None:
            self.training_started = now
        elif state in FINISHED and self.training_started is not None:
            self.training_seconds = now - self.training_started
            if state == "success" and self._status_step != self._metrics_step():
                self._print(status_line(self.run_dir, self.steps, self.training_started))

    def _maybe_status(self) -> None:
        """The status line every ``status_every_s`` while training when the step moved, else
        every ``quiet_status_s``."""
        if self.training_started is None or self.training_seconds is not None:
            return
        now = time.monotonic()
        if now - self._status_at < self.status_every_s:
            return
        step = self._metrics_step()
        if step == self._status_step and now - self._status_at < self.quiet_status_s:
            return
        self._status_at, self._status_step = now, step
        self._print(status_line(self.run_dir, self.steps, self.training_started))

    def _metrics_step(self) -> int:
        return trained_step(self.run_dir)

    # ------------------------------------------------------------------ failed task's log
    def task_log_tail(self, task: str, n: int) -> list[str]:
        """The last ``n`` lines ``task`` wrote to the Airflow log in its latest try (tasks run
        one at a time under dag.test: from before it started to its "end task" line), without
        the runner's bookkeeping lines and traceback frames inside installed packages."""
        if not self.airflow_log:
            return []
        try:
            with open(self.airflow_log, "rb") as f:
                f.seek(self._marks.get(task, 0))
                lines = f.read().decode("utf-8", errors="replace").splitlines()
        except OSError:
            return []
        task_id, _, index = task.partition("[")
        end = f"end task task_id={task_id} map_index={index.rstrip(']') or -1}"
        for i, line in enumerate(lines):
            if end in line:
                lines = lines[:i]
                break
        return _readable(lines)[-n:]


def _readable(lines: list[str]) -> list[str]:
    """Log lines without the task runner's bookkeeping, and tracebacks without the frames of
    installed packages (Airflow's own) or the ``^^^`` markers: the user's frames and the error."""
    out, in_package_frame = [], False
    for line in lines:
        text = line.rstrip()
        if not text.strip() or any(b in text for b in _BOOKKEEPING):
            continue
        if text.startswith('  File "'):
            in_package_frame = "site-packages" in text
        elif not text.startswith("    "):
            in_package_frame = False
        if in_package_frame or set(text.strip()) <= {"^", "~"}:
            continue
        out.append(text)
    return out


def _size(path: str | None) -> int:
    try:
        return os.path.getsize(path) if path else 0
    except OSError:
        return 0


def metadata_task_states(dag_id: str) -> TaskStates:
    """Task states of the newest run of ``dag_id`` created after this call, read from the
    Airflow metadata database (a short session per call, from any thread)."""
    # lazy: Airflow reads its settings when imported; `rlax airflow train` makes them first
    from airflow.models.dagrun import DagRun
    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.session import create_session
    from sqlalchemy import func, select

    with create_session(scoped=False) as session:
        before = session.scalar(select(func.max(DagRun.id)).where(DagRun.dag_id == dag_id)) or 0

    def read() -> dict[str, str]:
        with create_session(scoped=False) as session:
            run_id = session.scalar(
                select(DagRun.run_id)
                .where(DagRun.dag_id == dag_id, DagRun.id > before)
                .order_by(DagRun.id.desc())
                .limit(1)
            )
            if run_id is None:
                return {}
            rows = session.execute(
                select(TaskInstance.task_id, TaskInstance.map_index, TaskInstance.state).where(
                    TaskInstance.dag_id == dag_id, TaskInstance.run_id == run_id
                )
            ).all()
        return {
            task_id + (f"[{index}]" if index >= 0 else ""): str(getattr(state, "value", state))
            for task_id, index, state in rows
        }

    return read
