"""Partial rollouts in the controller (docs/design.md §7): what in-flight groups held when their
workers last reported goes into each snapshot and back to the worker a group is issued to again."""

from __future__ import annotations

import threading

from rlax_tasks.controller import SnapshotStore
from rlax_tasks.controller.partials import PartialRollouts
from rlax_tasks.rollout.requests import SampleProgress
from rlax_tasks.rundir import storage
from tests.controller.fakes import FakePool, World, controller, trained


class ReportingPool(FakePool):
    """Fake workers whose groups each hold two tokens of sample 0 (sampled with the version
    the worker holds) until they are polled; every submitted GroupRequest is kept."""

    def __init__(self, trainer, **kwargs) -> None:  # noqa: ANN001
        super().__init__(trainer, **kwargs)
        self.requests: list[tuple[str, object]] = []
        self.reports = 0

    def submit(self, worker_id, groups) -> None:  # noqa: ANN001
        super().submit(worker_id, groups)
        self.requests += [(worker_id, g) for g in groups]

    def progress(self, worker_id):  # noqa: ANN001, ANN201
        super().progress(worker_id)
        self.reports += 1
        v = self.workers[worker_id].held or 0
        return {
            g.prompt_id: [SampleProgress(0, (7, 8), (-0.5, -0.25), (v, v))]
            for g in self.workers[worker_id].queue
        }


def world() -> World:
    w = World()
    w.pool = ReportingPool(w.trainer, reload_every=2, rate=3)
    return w


def test_snapshots_hold_partial_rollouts_and_groups_issued_again_resume_them(tmp_path):
    w = world()
    run_dir, c = trained(tmp_path, w, 2)
    w.pool.hung.add("w0")  # w0 takes groups and finishes none: they stay in flight
    for _ in range(3):
        c.iterate()
    held = [pid for pid, e in c._in_flight.items() if e.worker == "w0"]
    assert held, "nothing in flight on w0"
    snap = c.snapshot()
    # one row per held sample, kept in a Parquet file beside the snapshot, with its sha256
    rows = {r["prompt_id"]: r for r in SnapshotStore(run_dir).load_latest().partials}
    assert set(held) <= set(rows) and rows[held[0]]["tokens"] == [7, 8]
    assert rows[held[0]]["versions"] == [w.pool.workers["w0"].held] * 2
    assert storage.exists(storage.join(run_dir, "snapshots", f"{snap.step}.partials.parquet"))

    # w0 fails: its groups go to w1 with what they held
    w.pool.hung.discard("w0")
    w.pool.fail_next.add("w0")
    w.pool.down.add("w0")
    before = len(w.pool.requests)
    for _ in range(20):  # (w1 takes them as it has room)
        c.iterate()
    again = {g.prompt_id: g for worker, g in w.pool.requests[before:] if worker == "w1"}
    assert set(held) <= set(again), "a group of w0 was not issued again"
    assert all([r.tokens for r in again[pid].resume] == [(7, 8)] for pid in held)
    assert c.counters["resumed_tokens"] >= 2 * len(held)


def test_a_restarted_controller_resumes_the_snapshots_partial_rollouts(tmp_path):
    w = world()
    run_dir, first = trained(tmp_path, w, 2)
    w.pool.hung.add("w0")
    for _ in range(3):
        first.iterate()
    snap = first.snapshot()
    on_w0 = [e["prompt_id"] for e in snap.in_flight if e["worker"] == "w0"]
    assert on_w0
    # kill -9 of the controller and of both workers: nothing left to ask but the snapshot
    w.pool.down.update({"w0", "w1"})
    w.pool.hung.discard("w0")
    for worker in w.pool.workers.values():
        worker.queue.clear()
    w.pool.down.clear()
    before = len(w.pool.requests)
    second = controller(run_dir, w)
    assert second.start() is True
    again = {g.prompt_id: g for _, g in w.pool.requests[before:]}
    assert set(on_w0) <= set(again)
    assert all([r.tokens for r in again[pid].resume] == [(7, 8)] for pid in on_w0)


def test_every_worker_is_asked_at_once_and_one_that_fails_keeps_its_older_records():
    """A snapshot's progress reports are asked together: each answer below waits for all the
    others (a barrier), so asking one worker after another would never get past the first."""
    workers = [f"w{i}" for i in range(6)]
    everyone_asked = threading.Barrier(len(workers), timeout=10)
    old = SampleProgress(0, (1,), (-0.1,), (0,))

    class Pool:
        def progress(self, worker):  # noqa: ANN001, ANN201
            everyone_asked.wait()
            if worker == "w5":
                raise ConnectionError("w5 is down")
            return {f"{worker}/p": [SampleProgress(0, (7, 8), (-0.5, -0.25), (1, 1))]}

    partials = PartialRollouts()
    partials.load([{"prompt_id": "w5/p", **old.to_dict()}])
    partials.gather(Pool(), {w: [f"{w}/p"] for w in workers})
    assert [len(partials.resume(f"{w}/p", 0)[0].tokens) for w in workers] == [2] * 5 + [1]


def test_records_older_than_the_staleness_bound_are_not_resumed(tmp_path):
    """A record with a token older than min_version would make the group too stale to train:
    the group is generated afresh instead."""
    c = controller(str(tmp_path / "run"), world())
    c.start()
    c.version = 5  # max_staleness 2: min_version 4
    old = SampleProgress(0, (7, 8), (-0.5, -0.25), (3, 4))
    new = SampleProgress(1, (9,), (-0.1,), (4,))
    c.partials._held["p"] = [old, new]
    assert c.partials.resume("p", 4) == (new,)
    assert [r.sample for r in c.partials.resume("p", 3)] == [0, 1]


def test_tokens_a_snapshot_holds_are_not_generated_again_after_a_worker_is_killed(tmp_path):
    """Real inference workers: w0 stops part-way through its groups, a snapshot records them,
    w0 dies; w1 takes its groups and goes on from the records. Each sample the snapshot held
    is trained with those tokens first, counted as resumed (not sampled again)."""
    import threading
    import time

    from rlax_tasks.controller import read_rollouts
    from rlax_tasks.models import Policy
    from rlax_tasks.rollout import Sampler, SamplingParams
    from rlax_tasks.rollout.weight_source import FixedWeights
    from rlax_tasks.rollout.worker import InferenceWorker
    from rlax_tasks.run.colocated import InProcessWorkers
    from tests.rollout.test_worker import CONFIG, TOKENIZER

    class StallingSampler(Sampler):
        """Stops decoding after ``steps`` steps (a preempted host's last moments): its
        requests stay part-way, and the worker still answers between steps."""

        def __init__(self, *args, steps: int, **kwargs) -> None:  # noqa: ANN002, ANN003
            super().__init__(*args, **kwargs)
            self.left, self.stalled = steps, threading.Event()

        def step(self):  # noqa: ANN202
            if self.left <= 0:
                self.stalled.set()
                time.sleep(0.005)
                return []
            self.left -= 1
            return super().step()

    class KillablePool(InProcessWorkers):
        def __init__(self, workers) -> None:  # noqa: ANN001
            super().__init__(workers)
            self.dead: set[str] = set()

        def _alive(self, w: str) -> None:
            if w in self.dead:
                raise ConnectionError(f"{w} was killed")

        def submit(self, w, groups):  # noqa: ANN001
            self._alive(w)
            super().submit(w, groups)

        def results(self, w):  # noqa: ANN001, ANN201
            self._alive(w)
            return super().results(w)

        def progress(self, w):  # noqa: ANN001, ANN201
            self._alive(w)
            return super().progress(w)

    policy = Policy.init(CONFIG, seed=0, tokenizer=TOKENIZER)
    weights = FixedWeights(policy.params, version=0)
    stalling = StallingSampler(policy, max_slots=8, max_len=64, decode_chunk=1, steps=6)
    samplers = {"w0": stalling, "w1": Sampler(policy, max_slots=8, max_len=64, decode_chunk=4)}
    workers = {w: InferenceWorker(s, weights, poll_interval_s=0.01) for w, s in samplers.items()}
    w = World()
    w.pool = KillablePool(workers)
    run_dir = str(tmp_path / "run")
    sampling = SamplingParams(max_new_tokens=24, temperature=1.0, ignore_eos=True)
    overrides = dict(group_size=2, prompts_per_step=2, groups_per_worker=2, sampling=sampling)
    overrides |= dict(max_staleness=1000, dynamic_sampling=False, max_outstanding_groups=4)
    c = controller(run_dir, w, **overrides, idle_sleep_s=0.01)
    for worker in workers.values():
        worker.start()
    try:
        c.start()
        deadline = time.monotonic() + 120
        while not stalling.stalled.is_set() and time.monotonic() < deadline:
            c.iterate()
        assert stalling.stalled.is_set(), "w0 never took work"
        c.snapshot()
        snap = SnapshotStore(run_dir).load_latest()
        on_w0 = {e["prompt_id"] for e in snap.in_flight if e["worker"] == "w0"}
        held = {(r["prompt_id"], r["sample"]): r for r in snap.partials if r["prompt_id"] in on_w0}
        assert held and all(0 < len(r["tokens"]) < 24 for r in held.values())
        w.pool.dead.add("w0")  # kill -9 of w0: what it held is gone with it
        workers["w0"].stop()
        c.run(8, max_iterations=20000)
    finally:
        for worker in workers.values():
            worker.stop()
    rows = read_rollouts(run_dir).set_index(["prompt_id", "sample"])
    assert set(held) <= set(rows.index), "a group of w0 was not trained"
    resumed = 0
    for key, record in held.items():
        row, n = rows.loc[key], len(record["tokens"])
        assert row["resumed_tokens"] == n and list(row["tokens"])[:n] == record["tokens"], key
        resumed += n
    assert c.counters["resumed_tokens"] == resumed
