"""The controller: the one component that decides (docs/design.md §2).

It hands the mixture's prompts to workers, has their groups scored, buffers them under the
staleness rules, sends batches to the trainer, records lineage and snapshots every j versions;
a failed worker's prompts go back to the queue front, and ``start()`` resumes a run (recovery)."""

from __future__ import annotations

import collections
import dataclasses
import heapq
import logging
import time
import zlib
from collections.abc import Callable, Sequence
from typing import Any

from rlax_tasks.controller import recovery
from rlax_tasks.controller.buffer import Batch, RolloutBuffer
from rlax_tasks.controller.lineage import LineageWriter, lineage_record
from rlax_tasks.controller.mixture import Prompt, PromptMixture
from rlax_tasks.controller.partials import PartialRollouts
from rlax_tasks.controller.phases import PhaseClock
from rlax_tasks.controller.ports import (
    WORKER_ERRORS,
    Scorer,
    TrainStep,
    WorkerPool,
)
from rlax_tasks.controller.rollouts import write_step as write_rollouts
from rlax_tasks.controller.score_queue import ScoreQueue
from rlax_tasks.controller.scoring import scored_group
from rlax_tasks.controller.settings import ControllerSettings
from rlax_tasks.controller.snapshot import Snapshot, SnapshotStore
from rlax_tasks.controller.worker_health import WorkerHealth
from rlax_tasks.rollout.requests import GroupRequest, GroupResult
from rlax_tasks.services.protocol import TrainerBehindError

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _InFlight:
    prompt: Prompt
    worker: str
    sent: float


class Controller:
    """Ties the mixture, workers, scorer, buffer, trainer, lineage and snapshots together."""

    def __init__(
        self,
        settings: ControllerSettings,
        mixture: PromptMixture,
        pool: WorkerPool,
        scorer: Scorer,
        train_step: TrainStep,
        encode: Callable[[str], Sequence[int]],
        run_dir: str,
        *,
        clock: Callable[[], float] = time.monotonic,
        idle_sleep_s: float = 0.05,
        snapshots_kept: int | None = 5,
    ) -> None:
        self.settings = settings
        self.mixture, self.pool, self.scorer = mixture, pool, scorer
        self.train_step, self.encode = train_step, encode
        self.clock, self.idle_sleep_s = clock, idle_sleep_s
        self.run_dir = run_dir
        self.store = SnapshotStore(run_dir, keep=snapshots_kept)
        self.lineage = LineageWriter(run_dir)
        self._verifiers = {c.name: c.verifier for c in mixture.components}
        self.buffer = RolloutBuffer(
            settings.prompts_per_step, settings.max_staleness, settings.dynamic_sampling
        )
        self.step = 0
        self.version = 0
        self._queue: collections.deque[Prompt] = collections.deque()
        self._in_flight: dict[str, _InFlight] = {}  # insertion order = dispatch order
        self._encoded: dict[str, tuple[int, ...]] = {}  # prompt id -> tokens, until submitted
        self.partials = PartialRollouts()  # what in-flight groups held when last asked
        self._skipped_in_a_row = 0
        self._steps_since_snapshot: list[dict[str, Any]] = []
        self.health = WorkerHealth(settings.worker_retry_s, clock)
        self.counters: collections.Counter[str] = collections.Counter()
        self.scoring = ScoreQueue(scorer, settings.scoring_threads, self._add_scored, self.counters)
        self.phases = PhaseClock(clock)  # seconds per phase in this process
        self._idle_since: float | None = None  # clock when the last iterate() ended
        self._started = False

    # ------------------------------------------------------------------ lifecycle
    def start(self, initial_version: int = 0) -> bool:
        """Restores the newest committed snapshot (True) or starts fresh at ``initial_version``
        (False); resets every worker and re-issues the snapshot's in-flight prompts.

        The trainer must be at the snapshot's version (restored from its checkpoint).
        """
        self.phases.cycle_start = self.clock()  # the first step's cycle includes the start-up
        try:
            return self._restore(initial_version)
        finally:
            self._idle_since = self.clock()

    def _restore(self, initial_version: int) -> bool:
        snap = self.store.load_latest()
        live = self._live_workers()
        if snap is not None:  # what the workers held at the crash, newer than the snapshot's
            issued = [*snap.in_flight_ids, *(q["prompt_id"] for q in snap.queued)]
            self.partials.load(snap.partials)
            self.partials.gather(self.pool, {w: issued for w in live})
        for w in live:
            self._reset_worker(w)
        if snap is None:
            self.step, self.version = 0, initial_version
            self._started = True
            log.info("controller starts fresh at version %d", self.version)
            return False
        recovery.check_seed(snap, self.settings.seed)
        self.step, self.version = snap.step, snap.version
        self.mixture.load_state_dict(snap.mixture)
        self.buffer.load_state_dict(snap.buffer)
        self.counters.clear()  # in place: the score queue counts into it too
        self.counters.update(snap.counters)
        recovery.restore_lineage(self.run_dir, self.lineage, snap)
        later = recovery.committed_after(self.lineage, snap)  # after an older snapshot's step
        trained = {pid for r in later for pid in r["prompt_ids"]}
        plan = recovery.reissue(snap, self.mixture, live, trained)
        self._queue = collections.deque(plan.queued)
        for w, prompts in plan.by_worker.items():
            self._submit(w, prompts)
        # a pending snapshot carries the steps since the last full one; a full one flushed them
        self._steps_since_snapshot = list(snap.steps) if snap.pending is not None else []
        if later:
            self._roll_forward(snap, later, trained)
        self._started = True
        log.info(
            "controller restored step %d (version %d): %d buffered, %d re-issued, %d queued",
            self.step,
            self.version,
            len(self.buffer),
            len(snap.in_flight),
            len(self._queue),
        )
        if later:  # the state now matches the trainer's steps: committed as a snapshot
            self.snapshot()
        elif snap.pending is not None:  # a step was under way: train exactly that batch again
            batch = recovery.check_pending(snap, self.buffer.take(self.version + 1))
            log.info("replaying the pending training step %d", self.step + 1)
            self._train(batch, sent_before=True)
        return True

    def _roll_forward(self, snap: Snapshot, later: list[dict[str, Any]], trained: set[str]) -> None:
        """Moves a restored older snapshot on to the steps trained since (``recovery``)."""
        budget = max(self.settings.max_outstanding_groups, self.settings.prompts_per_step)
        usable = lambda p: self._unusable(p) is None  # noqa: E731
        rf = recovery.roll_forward(snap, later, trained, self.buffer, self.mixture, usable, budget)
        self._queue.extend(rf.queued)
        self.counters["drawn"] += rf.draws
        self.step, self.version = rf.step, rf.version
        self.counters["trained_groups"] += rf.trained_groups
        self._steps_since_snapshot += rf.steps

    def run(self, num_steps: int, max_iterations: int | None = None) -> None:
        """Iterates until ``num_steps`` training steps are done (in total, across restarts)."""
        if not self._started:
            self.start()
        iterations = 0
        while self.step < num_steps:
            if max_iterations is not None and iterations >= max_iterations:
                raise TimeoutError(
                    f"no training step {self.step + 1} after {max_iterations} iterations"
                )
            iterations += 1
            progressed = self.iterate(last_step=num_steps)
            if not progressed and self.idle_sleep_s > 0:
                time.sleep(self.idle_sleep_s)

    def iterate(self, last_step: int | None = None) -> bool:
        """One round: dispatch, collect, score, and at most one training step.

        ``last_step``: the run's last step: the next step's prompts go out as soon as a step is
        trained, except after that one. Returns whether anything happened (a result arrived or
        a step was trained)."""
        if not self._started:
            raise RuntimeError("call start() first: it restores a snapshot or starts fresh")
        if self._idle_since is not None:
            self.phases.add("wait", self.clock() - self._idle_since)
        try:
            with self.phases.timed("dispatch"):
                self._dispatch()
            with self.phases.timed("collect"):
                got = self._collect()
            with self.phases.timed("score"):
                self.scoring.advance()
            with self.phases.timed("batch"):
                before = self.buffer.copy()  # its state is built only when a batch forms
                pending = [p.seq for p in self._queue]
                pending += [e.prompt.seq for e in self._in_flight.values()]
                pending += [p.seq for p, _ in self.scoring.pending()]
                batch = self.buffer.take(self.version + 1, pending)
            if batch is None:
                return got > 0
            with self.phases.timed("snapshot"):
                self.snapshot(pending=batch, buffer_state=before.state_dict())
            self._train(batch, dispatch_next=last_step is None or self.step + 1 < last_step)
            return True
        finally:
            self._idle_since = self.clock()

    def wait_for_scoring(self, timeout_s: float) -> bool:
        """Waits up to ``timeout_s`` for the oldest scoring job on the scorer's threads to end;
        returns False at once when none runs. A driver idling between ``iterate`` calls waits
        here rather than sleeping a fixed interval: the batch forms as soon as it is scored."""
        return self.scoring.wait(timeout_s)

    # ------------------------------------------------------------------ dispatch
    def _live_workers(self) -> list[str]:
        return self.health.live(self.pool.worker_ids())

    @property
    def outstanding(self) -> int:
        """Prompts drawn and not yet trained or dropped: queued, in flight, unscored, buffered."""
        unscored = len(self.scoring.pending())
        return len(self._queue) + len(self._in_flight) + unscored + len(self.buffer)

    @property
    def queued_ids(self) -> list[str]:
        """Prompt ids waiting to be (re-)issued, front first."""
        return [p.id for p in self._queue]

    @property
    def in_flight_ids(self) -> list[str]:
        """Prompt ids handed to workers and not yet returned, in dispatch order."""
        return list(self._in_flight)

    def _dispatch(self) -> None:
        s = self.settings
        budget = max(s.max_outstanding_groups, s.prompts_per_step)
        live = self._live_workers()
        load = {w: 0 for w in live}
        for entry in self._in_flight.values():
            if entry.worker in load:
                load[entry.worker] += 1
        plan: dict[str, list[Prompt]] = {w: [] for w in live}
        idle = {w for w in live if load[w] == 0}
        drawn = kept = 0
        outstanding = self.outstanding  # a prompt taken off the queue below stays outstanding
        # the least loaded worker next, the first listed among equals
        order = [(load[w], i, w) for i, w in enumerate(live)]
        heapq.heapify(order)
        while order:
            _, i, w = order[0]
            if load[w] >= s.groups_per_worker:
                break
            if self._queue:
                prompt = self._queue.popleft()
            elif outstanding + kept < budget:
                prompt = self.mixture.next()
                drawn += 1
                problem = self._unusable(prompt)
                if problem is not None:
                    self._skip(prompt, problem)
                    continue
                kept += 1
            else:
                break
            plan[w].append(prompt)
            load[w] += 1
            heapq.heapreplace(order, (load[w], i, w))
        self.counters["drawn"] += drawn
        for w in live:
            if plan[w]:
                self._submit(w, plan[w], idle=w in idle)

    def _unusable(self, prompt: Prompt) -> str | None:
        """Why a drawn prompt cannot be generated (None when it can; its tokens are kept)."""
        try:
            tokens = tuple(int(t) for t in self.encode(prompt.content))
        except ValueError as e:
            return f"cannot be encoded: {e}"
        limit = self.settings.max_prompt_tokens
        if limit is not None and len(tokens) > limit:
            return (
                f"prompt has {len(tokens)} tokens, more than the {limit} a worker takes "
                "(workers.max_len - rollout.max_new_tokens)"
            )
        self._encoded[prompt.id] = tokens
        self._skipped_in_a_row = 0
        return None

    def _skip(self, prompt: Prompt, reason: str) -> None:
        """Skips a prompt for good: counted, and listed in the next step's lineage record."""
        self.buffer.skip(prompt.id, reason)
        self.partials.drop(prompt.id)
        self.counters["skipped_prompts"] += 1
        self._skipped_in_a_row += 1
        skipped = self.counters["skipped_prompts"]
        if skipped <= 10 or skipped % 100 == 0:
            log.warning("prompt %s skipped (%d so far): %s", prompt.id, skipped, reason)
        if self._skipped_in_a_row >= max(64, 4 * self.settings.prompts_per_step):
            raise ValueError(
                f"the last {self._skipped_in_a_row} prompts drawn were all skipped; the last, "
                f"{prompt.id}: {reason}. Check workers.max_len, rollout.max_new_tokens, the "
                "datasets and the tokenizer (`rlax data preview FILE --model-dir DIR`)"
            )

    def _request(self, prompt: Prompt) -> GroupRequest:
        seed = zlib.crc32(f"{self.settings.seed}:{prompt.id}".encode()) & 0x7FFFFFFF
        k = self.settings.max_staleness
        tokens = self._encoded.pop(prompt.id, None)
        if tokens is None:
            tokens = tuple(int(t) for t in self.encode(prompt.content))
        # trains at version + 1 at the earliest: older rollouts would only be dropped
        min_version = 0 if k is None else max(0, self.version + 1 - k)
        return GroupRequest(
            prompt.id,
            tokens,
            self.settings.group_size,
            dataclasses.replace(self.settings.sampling, seed=seed),
            min_version=min_version,
            resume=self.partials.resume(prompt.id, min_version),
            # an episode's prompt is rendered by the worker from its environment's first
            # messages (tokens above: the dataset's prompt, what the length screen used)
            environment=prompt.environment,
            row=None if prompt.environment is None else prompt.episode_row(),
        )

    def _submit(self, worker: str, prompts: list[Prompt], idle: bool | None = None) -> None:
        """Hands ``prompts`` to ``worker`` (``idle``: whether it holds none of ours, if known)."""
        requests, sendable = [], []
        for p in prompts:  # re-issued prompts were not screened by _unusable in this process
            try:
                requests.append(self._request(p))
                sendable.append(p)
            except ValueError as e:
                self._skip(p, f"cannot be encoded: {e}")
        if not requests:
            return
        prompts = sendable
        try:
            self.pool.submit(worker, requests)
        except ValueError as e:  # the worker refused a request as invalid (HTTP 400)
            if len(prompts) > 1:  # find which: the others go through
                for p in prompts:
                    self._submit(worker, [p])
                return
            self._skip(prompts[0], f"worker {worker} rejected it: {e}")
            return
        except WORKER_ERRORS as e:
            if not self.health.has_answered(worker):  # still starting (address planned ahead)
                self._not_up_yet(worker, prompts, e)
                return
            log.log(
                logging.WARNING if self.health.failures[worker] == 0 else logging.INFO,
                "worker %s refused %d groups: %s",
                worker,
                len(prompts),
                e,
            )
            self._worker_failed(worker, also=prompts)
            return
        if idle is None:
            idle = not any(e.worker == worker for e in self._in_flight.values())
        self.health.took_work(worker, was_idle=idle)
        now = self.clock()
        for p in prompts:
            self._in_flight[p.id] = _InFlight(p, worker, now)
        self.counters["issued"] += len(prompts)
        self.counters["resumed_tokens"] += sum(len(x.tokens) for r in requests for x in r.resume)

    def _requeue(self, prompts: Sequence[Prompt]) -> None:
        """Puts prompts back at the queue front: re-issued first, earliest draw first."""
        self._queue = collections.deque(sorted([*prompts, *self._queue], key=lambda p: p.seq))

    def _not_up_yet(self, worker: str, prompts: Sequence[Prompt], error: Exception) -> None:
        """A worker that has not taken work yet refused a submission: it is starting, not failed
        (nothing of it to reset, nothing lost); a warning once the retries reach their cap."""
        self._requeue(prompts)
        delay = self.health.back_off(worker)
        log.log(
            logging.WARNING if delay >= self.settings.worker_retry_s else logging.INFO,
            "worker %s is not up yet (%s): next try in %.2gs",
            worker,
            error,
            delay,
        )

    def _worker_failed(self, worker: str, also: Sequence[Prompt] = ()) -> None:
        """Resets a failed worker; its in-flight prompts (and ``also``) go to the queue front."""
        back = [e.prompt for e in self._in_flight.values() if e.worker == worker]
        for p in back:
            del self._in_flight[p.id]
        lost = len(back)  # prompts it held (the refused ones, ``also``, it never had)
        back.extend(also)
        self._requeue(back)  # (whichever worker held them)
        self.counters["worker_failures"] += 1
        self.counters["reissued"] += len(back)
        delay = self.health.failed(worker)
        self._reset_worker(worker)
        log.log(
            logging.WARNING if lost or self.health.failures[worker] == 1 else logging.INFO,
            "worker %s failed: %d prompts go back to the queue front; next try in %.2gs",
            worker,
            len(back),
            delay,
        )

    def _reset_worker(self, worker: str) -> None:
        try:
            self.pool.reset(worker)
        except WORKER_ERRORS as e:
            log.info("could not reset worker %s (%s)", worker, e)

    # ------------------------------------------------------------------ collect and score
    def _collect(self) -> int:
        holders = list(dict.fromkeys(e.worker for e in self._in_flight.values()))
        got = 0
        for w in holders:
            try:
                results = self.pool.results(w)
            except WORKER_ERRORS as e:
                log.warning("worker %s: %s", w, e)
                self._worker_failed(w)
                continue
            if results:
                self.health.returned(w)
            malformed = next(
                (r for r in results if len(r.completions) != self.settings.group_size), None
            )
            if malformed is not None:  # refused whole: the worker's prompts go out again
                log.error(
                    "worker %s returned %d completions for %s, not the group's %d: its answer "
                    "is refused and its prompts re-issued", w, len(malformed.completions),
                    malformed.prompt_id, self.settings.group_size,
                )  # fmt: skip
                self.counters["malformed_results"] += 1
                self._worker_failed(w)
                continue
            for r in results:
                entry = self._in_flight.get(r.prompt_id)
                if entry is None or entry.worker != w:
                    self.counters["ignored_results"] += 1  # re-issued elsewhere meanwhile
                    continue
                if r.version > self.version:
                    raise RuntimeError(
                        f"worker {w} returned {r.prompt_id} generated by version {r.version}, "
                        f"but the trainer is at version {self.version}: the parameter server "
                        f"is ahead of the controller's snapshot (restore the trainer and the "
                        f"parameter server to version {self.version})"
                    )
                del self._in_flight[r.prompt_id]
                self.partials.drop(r.prompt_id)
                self.scoring.put(entry.prompt, r)
                got += 1
            if not results:  # (it still holds all it held: nothing of it was taken)
                idle = self.health.idle_s(w)
                if idle > self.settings.worker_timeout_s:
                    log.warning("worker %s returned nothing for %.0fs", w, idle)
                    self.counters["worker_timeouts"] += 1
                    self._worker_failed(w)
        return got

    def _add_scored(self, prompt: Prompt, result: GroupResult, scores: Sequence[Any]) -> None:
        self.buffer.add(scored_group(prompt, result, scores, self.settings))

    def close(self) -> None:
        """Stops the scoring threads (a scoring job under way finishes first)."""
        self.scoring.close()

    # ------------------------------------------------------------------ train, record, snapshot
    def _train(self, batch: Batch, sent_before: bool = False, dispatch_next: bool = False) -> None:
        """Trains the next step on ``batch`` (``sent_before``: the pending step of the restored
        snapshot, which the trainer may have applied before this controller heard back;
        ``dispatch_next``: hands out the next prompts before the step's records are written)."""
        batch = dataclasses.replace(batch, timings=self.phases.end_cycle())
        step = self.step + 1
        sent_before = sent_before or self.lineage.has(step)
        with self.phases.timed("train"):
            try:
                new_version = recovery.send_step(self.train_step, batch, step, sent_before)
            except TrainerBehindError as e:
                self._replay_trainer(e.trainer_step)
                new_version = recovery.send_step(self.train_step, batch, step, sent_before)
        if new_version != batch.version:
            raise RuntimeError(
                f"the trainer returned version {new_version} for the step producing version "
                f"{batch.version}: versions must advance by one per step"
            )
        self.step += 1
        self.version = new_version
        self.counters["trained_groups"] += len(batch.groups)
        unusable: ValueError | None = None
        if dispatch_next:
            # the next prompts go out before this step's records are written: the workers (on
            # the new version) generate while the lineage, rollouts and snapshot are written,
            # and the snapshot records them in flight (a lockstep run otherwise leaves the
            # sampler idle meanwhile)
            try:
                with self.phases.timed("dispatch"):
                    self._dispatch()
            except ValueError as e:  # every prompt drawn was unusable: raised once recorded
                unusable = e
        with self.phases.timed("lineage"):
            self.lineage.append(lineage_record(self.step, batch))
        with self.phases.timed("rollouts"):
            write_rollouts(self.run_dir, self.step, batch, self._verifiers)
        self._steps_since_snapshot.append({"step": self.step, "prompt_ids": batch.prompt_ids})
        if self.version % self.settings.reload_every == 0:
            with self.phases.timed("snapshot"):
                self.snapshot()
        if unusable is not None:
            raise unusable

    def _replay_trainer(self, trainer_step: int) -> None:
        """Gives a trainer restored at ``trainer_step`` the steps after it again, up to ours."""
        self.counters["replayed_steps"] += recovery.replay_steps(
            self.run_dir, trainer_step, self.step, self.train_step
        )

    def snapshot(
        self, pending: Batch | None = None, buffer_state: dict[str, Any] | None = None
    ) -> Snapshot:
        """Writes and commits a snapshot of the current state (also called every j versions).

        With ``pending`` it is the write-ahead record of a training step about to happen:
        ``buffer_state`` is the buffer before that batch was taken.
        """
        queued = [p for p, _ in self.scoring.pending()] + list(self._queue)  # regenerate
        holders: dict[str, list[str]] = collections.defaultdict(list)
        for e in self._in_flight.values():
            holders[e.worker].append(e.prompt.id)
        self.partials.gather(self.pool, holders)
        counters = dict(self.counters)
        snap = Snapshot(
            step=self.step,
            version=self.version,
            seed=self.settings.seed,
            mixture=self.mixture.state_dict(),
            in_flight=[
                {"prompt_id": e.prompt.id, "seq": e.prompt.seq, "worker": e.worker}
                for e in self._in_flight.values()
            ],
            queued=[{"prompt_id": p.id, "seq": p.seq} for p in queued],
            buffer=self.buffer.state_dict() if buffer_state is None else buffer_state,
            steps=list(self._steps_since_snapshot),
            counters=counters,
            pending=None if pending is None else pending.prompt_ids,
            partials=self.partials.rows([*self._in_flight, *(p.id for p in self._queue)]),
        )
        self.store.write(snap)
        if pending is None:
            self._steps_since_snapshot = []
        return snap

    def status(self) -> dict[str, Any]:
        """Progress figures for logs and dashboards."""
        return {
            **dict(self.counters),
            "step": self.step,
            "version": self.version,
            "queued": len(self._queue),
            "in_flight": len(self._in_flight),
            "buffered": len(self.buffer),
            "dropped_stale": self.buffer.counts["stale"],
            "dropped_zero_variance": self.buffer.counts["zero_variance"],
            "scoring": len(self.scoring.pending()),
        }
