"""The run lock: a local flock, and a gs:// lease (on the GCS emulator) renewed in the
background and taken over once it expired; the deciding job of a run started without `rlax run`
(the rlax_train DAG's, one started by hand) takes it too."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time

import pytest

from rlax_tasks.rundir import lock as run_lock
from rlax_tasks.rundir import storage
from rlax_tasks.rundir.lock import FileLock, Holder, Lease, RunLocked
from rlax_tasks.rundir.paths import run_paths
from tests.compute.helpers import wait_for
from tests.run.test_local_run import small_config


def test_a_local_run_is_locked_until_released(tmp_path, caplog):
    run_dir = str(tmp_path / "run")
    first = run_lock.acquire(run_dir)
    assert isinstance(first, FileLock)
    with pytest.raises(RunLocked) as info:  # a second holder (its own open file) is refused
        run_lock.acquire(run_dir)
    msg = str(info.value)
    assert f"run {run_dir} is in use by pid {os.getpid()} on {socket.gethostname()} since" in msg
    assert f"kill {os.getpid()}" in msg and "the same command resumes it" in msg
    first.release()
    caplog.set_level(logging.WARNING, logger="rlax_tasks.rundir.lock")
    with run_lock.acquire(run_dir):  # released cleanly: taken without a word
        pass
    assert "taken over" not in caplog.text


def test_a_lock_left_by_a_dead_run_is_taken_over_and_logged(tmp_path, caplog):
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    dead = Holder("x", 999999, "old-host", time.time() - 3600)
    with open(run_paths(run_dir).lock, "wb") as f:  # written, but nobody holds the flock
        f.write(dead.to_bytes())
    caplog.set_level(logging.WARNING, logger="rlax_tasks.rundir.lock")
    with run_lock.acquire(run_dir):
        held = Holder.parse(open(run_paths(run_dir).lock, "rb").read())
        assert held is not None and held.pid == os.getpid()
    assert "pid 999999 on old-host" in caplog.text and "taken over" in caplog.text


def test_gcs_lease_refuses_a_second_holder_then_is_taken_over_after_expiry(gcs_bucket, caplog):
    run_dir = f"{gcs_bucket}/runs/lease"
    first = Lease(run_dir, ttl_s=1.5, renew_every_s=3600).acquire()  # never renewed
    with pytest.raises(RunLocked, match=rf"in use by pid {os.getpid()} on .* \(its lease runs to"):
        run_lock.acquire(run_dir, ttl_s=1.5)
    wait_for(lambda: time.time() > first.holder.expires, timeout_s=10)
    caplog.set_level(logging.WARNING, logger="rlax_tasks.rundir.lock")
    second = run_lock.acquire(run_dir, ttl_s=30)
    assert isinstance(second, Lease)
    assert "expired at" in caplog.text and "taken over" in caplog.text
    with pytest.raises(RunLocked, match="lost its lock"):  # the first one learns it lost it
        first.check()
    assert first.renew() is False
    first.release()  # not its lease any more: left alone
    holder = Holder.parse(storage.read_bytes(run_paths(run_dir).lock))
    assert holder is not None and holder.id == second.holder.id
    second.release()
    caplog.clear()
    with run_lock.acquire(run_dir):  # released: free at once, no takeover
        pass
    assert "taken over" not in caplog.text


def test_gcs_lease_is_renewed_while_the_run_lives(gcs_bucket):
    run_dir = f"{gcs_bucket}/runs/renewed"
    lease = Lease(run_dir, ttl_s=1.0, renew_every_s=0.1).acquire()
    first_expiry = lease.holder.expires
    try:

        def renewed_past_first_expiry() -> bool:
            raw = json.loads(storage.read_bytes(run_paths(run_dir).lock))
            return time.time() > first_expiry and raw["expires"] > time.time()

        wait_for(renewed_past_first_expiry, timeout_s=20)
        with pytest.raises(RunLocked):
            run_lock.acquire(run_dir, ttl_s=1.0)
        lease.check()
    finally:
        lease.release()


@pytest.mark.parametrize("store", ["local", "gcs"])
def test_a_lease_race_has_one_winner(store, tmp_path, monkeypatch, request):
    """Two runs see the same expired lease; the second write fails its generation precondition
    (local ``commit_pointer`` enforces it, GCS its ``ifGenerationMatch``: on the emulator, by
    tests.gcs_generations)."""
    root = str(tmp_path) if store == "local" else request.getfixturevalue("gcs_bucket")
    run_dir = f"{root}/runs/race"
    path = run_paths(run_dir).lock
    expired = Holder("old", 1, "h", 0.0, expires=1.0)
    storage.commit_pointer(path, expired.to_bytes())
    seen = storage.read_versioned(path)
    winner = Lease(run_dir, ttl_s=60, renew_every_s=3600).acquire()
    read = storage.read_versioned
    stale = [seen]  # the loser read the lease before the winner wrote it
    monkeypatch.setattr(storage, "read_versioned", lambda p: stale.pop() if stale else read(p))
    with pytest.raises(RunLocked, match=f"is in use by pid {os.getpid()}"):
        Lease(run_dir, ttl_s=60).acquire()
    assert Holder.parse(read(path)[0]).id == winner.holder.id
    winner.release()


def test_a_job_takes_the_lock_unless_the_rlax_run_that_started_it_holds_it(tmp_path, monkeypatch):
    run_dir = str(tmp_path / "run")
    parent = run_lock.acquire(run_dir)  # `rlax run`'s lock
    monkeypatch.setenv(run_lock.HOLDER_ENV, parent.holder.id)
    with run_lock.for_job(run_dir) as inherited:  # started by it: its lock covers the job
        assert isinstance(inherited, run_lock.InheritedLock)
        inherited.check()
    monkeypatch.setenv(run_lock.HOLDER_ENV, "another-run")  # started by some other run
    with pytest.raises(RunLocked, match=f"is in use by pid {os.getpid()}"):
        run_lock.for_job(run_dir)
    monkeypatch.delenv(run_lock.HOLDER_ENV)  # started by a DAG task or by hand
    with pytest.raises(RunLocked, match=f"is in use by pid {os.getpid()}"):
        run_lock.for_job(run_dir)
    parent.release()
    monkeypatch.setenv(run_lock.HOLDER_ENV, parent.holder.id)  # its rlax run has ended
    with run_lock.for_job(run_dir) as own:
        assert isinstance(own, FileLock)
        with pytest.raises(RunLocked):
            run_lock.acquire(run_dir)


def test_a_job_waits_for_the_lease_of_a_preempted_holder_to_run_out(gcs_bucket, monkeypatch):
    run_dir = f"{gcs_bucket}/runs/preempted"
    dead = Lease(run_dir, ttl_s=2.0, renew_every_s=3600).acquire()  # never renewed again
    with pytest.raises(RunLocked, match=r"its lease runs to"):  # rlax run does not wait
        run_lock.acquire(run_dir)
    monkeypatch.setattr(run_lock, "JOB_WAIT_S", 20.0)
    with run_lock.for_job(run_dir) as lock:  # a restarted job: waits, then takes it over
        assert isinstance(lock, Lease) and time.time() >= dead.holder.expires
        lock.check()
    monkeypatch.setattr(run_lock, "JOB_WAIT_S", 0.5)
    live = Lease(run_dir, ttl_s=60, renew_every_s=3600).acquire()
    t0 = time.monotonic()
    with pytest.raises(RunLocked, match=f"is in use by pid {os.getpid()}"):
        run_lock.for_job(run_dir)  # a live holder: refused once the wait is over
    assert time.monotonic() - t0 < 10
    live.release()


@pytest.mark.parametrize("command", ["colocated", "controller"])
def test_a_run_started_without_rlax_run_refuses_a_second_live_process(tmp_path, command):
    """The DAG's colocated job and controller job take the run lock: while another process holds
    it they exit 2 (no retry) with one line naming the holder, before they write anything."""
    from rlax_tasks.config import save_resolved

    mode = {"colocated": "colocated", "controller": "disaggregated"}[command]
    cfg = small_config(tmp_path, **{"placement.mode": mode, "workers.count": 1})
    argv = [sys.executable, "-m", "rlax_tasks.cli", command, "--config", save_resolved(cfg)]
    argv += ["--steps", "2"]
    if command == "controller":
        argv += ["--trainer-url", "http://127.0.0.1:9", "--workers-file", str(tmp_path / "w.json")]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "RLAX_PS_TOKEN": "t"}
    env.pop(run_lock.HOLDER_ENV, None)
    with run_lock.acquire(cfg.run_dir):
        before = sorted(os.listdir(cfg.run_dir))
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
        assert sorted(os.listdir(cfg.run_dir)) == before
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"rlax {command}: error: run {cfg.run_dir} is in use by pid {os.getpid()}" in done.stderr
    assert "Traceback" not in done.stderr
