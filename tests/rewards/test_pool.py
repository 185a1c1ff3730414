"""The isolated worker pool: hard timeouts and crashes are contained and workers replaced."""

from __future__ import annotations

import os
import threading
import time

import psutil
import pytest

from rlax_tasks.rewards.pool import IsolatedPool


def test_timeout_kills_and_replaces_the_worker():
    with IsolatedPool(1) as pool:
        (victim,) = pool.pids()
        out = pool.call(time.sleep, (30,), timeout_s=0.5)
        assert out.status == "timeout" and out.wall_s < 2
        assert not psutil.pid_exists(victim)
        assert pool.call(abs, (-2,), timeout_s=10).value == 2
        assert pool.replaced == 1


def test_crash_is_an_error_and_the_pool_keeps_going():
    with IsolatedPool(1) as pool:
        crashed = pool.call(os._exit, (3,), timeout_s=10)
        assert crashed.status == "error" and "died" in crashed.error
        raised = pool.call(int, ("not a number",), timeout_s=10)
        assert raised.status == "error" and "ValueError" in raised.error
        assert pool.call(max, (1, 5), timeout_s=10).value == 5


def test_workers_outlive_the_thread_that_made_the_pool():
    # an environment step makes the process's verifier on its own short-lived thread
    made: list[IsolatedPool] = []

    def make_and_use() -> None:
        made.append(IsolatedPool(1))
        assert made[0].call(abs, (-2,), timeout_s=30).value == 2  # the worker is running

    thread = threading.Thread(target=make_and_use)
    thread.start()
    thread.join()
    with made[0] as pool:
        (pid,) = pool.pids()
        time.sleep(0.5)  # a worker killed with its parent thread is gone by now
        assert pool.call(abs, (-3,), timeout_s=10).value == 3
        assert pool.pids() == [pid] and pool.replaced == 0


def test_close_leaves_no_worker_behind():
    pool = IsolatedPool(2)
    assert pool.call(abs, (-1,)).value == 1
    pids = pool.all_pids()
    assert len(pids) == 2
    pool.close()
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids)
    with pytest.raises(RuntimeError, match="closed"):
        pool.call(abs, (1,))


def test_bad_size():
    with pytest.raises(ValueError, match="pool size"):
        IsolatedPool(0)
