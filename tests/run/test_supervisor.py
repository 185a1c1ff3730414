"""The supervisor's judgement of a dead component: restart it, or stop the run with its own
error line. Small Python programs stand in for the components (``Component.command``)."""

from __future__ import annotations

import itertools
import os
import pathlib
import signal
import subprocess
import sys
import time

import psutil
import pytest

from rlax_tasks.process.host_malloc import is_glibc
from rlax_tasks.run.supervisor import (
    Component,
    ComponentFailed,
    Interrupted,
    Supervisor,
    error_line,
    stop_on_signals,
)
from rlax_tasks.rundir import notices
from tests.compute.helpers import wait_for

PY = sys.executable


def _program(code: str) -> list[str]:
    return [PY, "-c", code]


def _poll_until(sup: Supervisor, done, timeout_s: float = 60.0) -> dict:
    """Polls the supervisor until ``done(finished)``; ComponentFailed propagates."""
    deadline = time.monotonic() + timeout_s
    while True:
        finished = sup.poll()
        if done(finished):
            return finished
        assert time.monotonic() < deadline, "the supervisor never got there"
        time.sleep(0.05)


def _controller_failure(tmp_path: pathlib.Path, code: str) -> tuple[Supervisor, str]:
    """Runs ``code`` as a controller that is never restarted; (supervisor, ComponentFailed text)."""
    sup = Supervisor(str(tmp_path / "logs"), backoff_s=0.05)
    sup.add(Component("controller", [], command=_program(code), restart=False))
    try:
        with pytest.raises(ComponentFailed) as info:
            _poll_until(sup, lambda f: False)
    finally:
        sup.stop()
    return sup, str(info.value)


# a program that fails on its first ``n`` starts (counted in a file), then exits 0
COUNTED = """
import pathlib, sys
f = pathlib.Path({path!r}); n = int(f.read_text()) if f.exists() else 0
f.write_text(str(n + 1))
if n < {fails}:
    print("some log line before the failure", flush=True)
    raise {error}
"""


def test_a_component_failing_the_same_way_twice_stops_the_run_with_its_error(tmp_path):
    code = "raise RuntimeError('snapshots/12.json does not verify (sha256 mismatch)')"
    sup, msg = _controller_failure(tmp_path, code)
    assert "controller failed twice in a row" in msg
    assert "RuntimeError: snapshots/12.json does not verify (sha256 mismatch)" in msg
    assert str(tmp_path / "logs" / "controller.log") in msg
    assert sup.components["controller"].restarts == 1  # restarted once, not 50 times


def test_exit_2_stops_at_once_with_the_components_own_error_line(tmp_path):
    code = (
        "import sys; print('rlax controller: error: datasets[0]: /data/x.jsonl: no such file', "
        "file=sys.stderr); sys.exit(2)"
    )
    sup, msg = _controller_failure(tmp_path, code)
    assert msg == (
        f"controller failed: datasets[0]: /data/x.jsonl: no such file "
        f"(log: {tmp_path / 'logs' / 'controller.log'})"
    )
    assert sup.components["controller"].restarts == 0


def test_transient_errors_and_progress_in_between_keep_restarting(tmp_path):
    """A connection refused (a service still starting) is retried however often it repeats; the
    same error with progress between the failures is retried too."""
    sup = Supervisor(str(tmp_path / "logs"), backoff_s=0.05)
    refused = COUNTED.format(
        path=str(tmp_path / "a"), fails=3,
        error="ConnectionRefusedError(111, 'Connection refused')",
    )  # fmt: skip
    sup.add(Component("trainer", [], command=_program(refused), restart=False))
    _poll_until(sup, lambda f: "trainer" in f)
    assert sup.components["trainer"].restarts == 3

    sup = Supervisor(str(tmp_path / "logs2"), backoff_s=0.05)
    sup.progress = itertools.count().__next__  # a step trained between any two failures
    same = COUNTED.format(path=str(tmp_path / "b"), fails=3, error="RuntimeError('flaky')")
    sup.add(Component("worker-0", [], command=_program(same), restart=False))
    _poll_until(sup, lambda f: "worker-0" in f)
    assert sup.components["worker-0"].restarts == 3


def test_a_component_killed_by_a_signal_is_restarted_every_time(tmp_path):
    sup = Supervisor(str(tmp_path / "logs"), backoff_s=0.05)
    # its last error line is the same at every kill: still not "failing the same way"
    sleeper = _program(
        "print('ValueError: a row skipped', flush=True); import time; time.sleep(600)"
    )
    c = sup.add(Component("ps", [], command=sleeper))
    try:
        log = tmp_path / "logs" / "ps.log"
        for kill in range(1, 4):
            pid = c.proc.pid
            wait_for(lambda kill=kill: log.read_text().count("ValueError") == kill)
            sup.kill("ps")
            _poll_until(sup, lambda f, pid=pid: c.proc.pid != pid)
            assert c.restarts == kill
    finally:
        sup.stop()
    assert c.proc.poll() is not None


def test_each_component_posts_notices_under_its_own_name(tmp_path):
    run_dir = str(tmp_path / "run")
    sup = Supervisor(str(tmp_path / "logs"), backoff_s=0.05)
    code = (
        f"from rlax_tasks.rundir import notices; notices.post({run_dir!r}, 'fallback', "
        "'snapshots/12.json set aside, using 10.json')"
    )
    sup.add(Component("controller", [], command=_program(code), restart=False))
    _poll_until(sup, lambda f: "controller" in f)
    (notice,), _ = notices.read_since(run_dir)
    assert notice.format() == "[fallback] controller: snapshots/12.json set aside, using 10.json"


@pytest.mark.skipif(not is_glibc(), reason="glibc only")
def test_components_computing_on_the_host_start_with_their_heap_on_huge_pages(tmp_path):
    """glibc reads its tunables at start only: the supervisor sets the huge-page one for each
    component that computes on the host CPU (rlax_tasks.process.host_malloc), not for the others."""
    sup = Supervisor(str(tmp_path / "logs"), backoff_s=0.05)
    code = "import os, sys; open(sys.argv[1], 'w').write(os.environ.get('GLIBC_TUNABLES', ''))"
    for platforms in ("cpu", "tpu"):
        out = str(tmp_path / platforms)
        env = {"JAX_PLATFORMS": platforms}
        sup.add(Component(platforms, [], command=[*_program(code), out], restart=False, env=env))
    try:
        _poll_until(sup, lambda f: {"cpu", "tpu"} <= set(f))
    finally:
        sup.stop()
    assert (tmp_path / "cpu").read_text().split(":")[-1] == "glibc.malloc.hugetlb=1"
    assert "hugetlb" not in (tmp_path / "tpu").read_text()


def test_children_die_with_a_supervisor_killed_by_sigkill(tmp_path):
    """kill -9 of the supervising process: the kernel kills its children (parent-death signal),
    though each runs in a session of its own."""
    up = tmp_path / "up"
    up.mkdir()
    # each child says it runs (the component itself, past any launcher), then sleeps
    child = (
        f"import os, time; open(os.path.join({str(up)!r}, str(os.getpid())), 'w'); time.sleep(600)"
    )
    script = (
        "import sys, time\n"
        "from rlax_tasks.run.supervisor import Component, Supervisor\n"
        f"sup = Supervisor({str(tmp_path / 'logs')!r})\n"
        "for name in ('a', 'b'):\n"
        f"    sup.add(Component(name, [], command=[sys.executable, '-c', {child!r}]))\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen([PY, "-c", script])
    children: list[psutil.Process] = []
    try:
        wait_for(lambda: len(os.listdir(up)) == 2, timeout_s=60)
        children = psutil.Process(parent.pid).children(recursive=True)
        assert sorted(str(c.pid) for c in children) == sorted(os.listdir(up))
        assert all(os.getsid(c.pid) == c.pid for c in children)  # sessions of their own
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        wait_for(lambda: not any(_alive(c) for c in children), timeout_s=30)
    finally:
        parent.kill()
        parent.wait()
        for c in children:
            if _alive(c):
                c.kill()


def _alive(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_error_line_prefers_the_rlax_error_then_the_traceback(tmp_path):
    log = tmp_path / "x.log"
    log.write_text(
        "==== start ====\n"
        "Traceback (most recent call last):\n  File 'x', line 1\nValueError: inner\n"
        "rlax trainer: error: trainer.learning_rate: must be >= 0\n"
        "2026-01-01 12:00:00,000 INFO absl: closing\n"
    )
    assert error_line(str(log)) == "rlax trainer: error: trainer.learning_rate: must be >= 0"
    log.write_text("Traceback (most recent call last):\nRuntimeError: boom\nlogging after\n")
    assert error_line(str(log)) == "RuntimeError: boom"
    size = log.stat().st_size
    assert error_line(str(log), offset=size) == ""  # nothing written since that start


def test_stop_on_signals_raises_once_and_keeps_ignored_signals_ignored():
    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as under nohup
    term, intr = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    try:
        with stop_on_signals() as guard:
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            with pytest.raises(Interrupted) as info:
                os.kill(os.getpid(), signal.SIGTERM)
                wait_for(lambda: False, timeout_s=10)  # the handler raises in this thread
            assert info.value.signum == signal.SIGTERM and str(info.value) == "SIGTERM"
            guard.stopping()
            os.kill(os.getpid(), signal.SIGINT)  # while stopping: logged, not raised
        assert signal.getsignal(signal.SIGTERM) is term  # the handlers from before come back
        assert signal.getsignal(signal.SIGINT) is intr
    finally:
        signal.signal(signal.SIGHUP, before)


def test_a_stopped_component_stays_stopped_until_it_is_added_again(tmp_path):
    """``stop`` of some components (the training jobs before the final evaluation, a held-out
    job done with its devices): later polls restart none of them; adding one starts it."""
    sup = Supervisor(str(tmp_path / "logs"), backoff_s=0.05)
    try:
        for name in ("service", "other"):
            sup.add(Component(name, [], command=_program("import time; time.sleep(60)")))
        sup.stop(["service"])
        for _ in range(5):  # past the back-off: a dead restartable component would restart
            time.sleep(0.1)
            assert sup.poll() == {}
        service = sup.components["service"]
        assert service.proc.poll() is not None and service.restarts == 0
        assert sup.components["other"].proc.poll() is None  # the rest go on
        sup.add(Component("service", [], command=_program("import time; time.sleep(60)")))
        assert sup.components["service"].proc.poll() is None
    finally:
        sup.stop()
