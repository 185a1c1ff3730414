"""The controller: the one component that decides (DESIGN §2).

It draws prompts from the mixture, hands them to workers (G completions each), collects
version-tagged groups, has them scored, buffers them under the staleness rules, forms batches for
the trainer, records lineage and snapshots its state at every weight-reload boundary (every j
versions). Workers, the scorer and the trainer are injected through small protocols, so the
decision logic runs in-process in tests; the process wiring adapts HTTP clients to them.

A worker whose call fails or that returns nothing for ``worker_timeout_s`` while holding work is
treated as dead: it is reset and its in-flight prompts go back to the front of the queue in
dispatch order. On restart, ``start()`` restores the newest committed snapshot, resets every
worker and re-issues the in-flight prompts (to the same worker when it is still there, in the
same order), so with deterministic workers the run continues exactly as an uninterrupted one.

Where the time goes: the controller times its phases with its clock (``PHASES``: dispatch,
collect, score, wait = time outside ``iterate()`` such as the driver's idle sleeps, batch =
forming the batch, snapshot, train = the ``train_step`` call, lineage, rollouts = writing
``rollouts/``). A cycle runs from one ``train_step`` call to the next; the batch sent at the
end of a cycle carries that cycle's seconds per phase as ``Batch.timings`` (``time_<phase>_s``,
``time_other_s`` for time in no phase and ``time_cycle_s`` for the whole cycle), so they land in
that step's metrics row with the batch's other stats, whatever carries the batch (HTTP or an
in-process trainer). The train, lineage and rollouts times in the row of step s are therefore
those of step s - 1, and a row's phases add up to the time between two steps.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import math
import numbers
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import Any, Protocol

import numpy as np

from rlax_tasks.algorithms import overlong_penalty
from rlax_tasks.config import RunConfig
from rlax_tasks.controller.buffer import Batch, RolloutBuffer, ScoredGroup
from rlax_tasks.controller.lineage import LineageWriter, lineage_record, recovered_record
from rlax_tasks.controller.mixture import Prompt, PromptMixture
from rlax_tasks.controller.rollouts import read_step_batch, rollouts_dir
from rlax_tasks.controller.rollouts import write_step as write_rollouts
from rlax_tasks.controller.snapshot import Snapshot, SnapshotStore
from rlax_tasks.rollout.requests import GroupRequest, GroupResult, SamplingParams
from rlax_tasks.rundir import notices
from rlax_tasks.services.protocol import StepReplayedError, TrainerBehindError  # (re-exported)

log = logging.getLogger(__name__)


class WorkerError(RuntimeError):
    """A worker failed (adapters raise it, or ConnectionError / TimeoutError / OSError)."""


class ScorerError(RuntimeError):
    """The scorer (verifier) failed; the groups are kept and scored again later."""


WORKER_ERRORS = (WorkerError, ConnectionError, TimeoutError, OSError)
SCORER_ERRORS = (ScorerError, ConnectionError, TimeoutError, OSError)
# the controller's timed phases, in the order of a cycle (see the module docstring)
PHASES = (
    "wait",
    "dispatch",
    "collect",
    "score",
    "batch",
    "snapshot",
    "train",
    "lineage",
    "rollouts",
)


class WorkerPool(Protocol):
    """The inference fleet as the controller sees it; workers may join or leave at any time."""

    def worker_ids(self) -> list[str]:
        """The workers that can take work now, in a stable order."""
        ...

    def submit(self, worker_id: str, groups: Sequence[GroupRequest]) -> None: ...

    def results(self, worker_id: str) -> list[GroupResult]:
        """Finished groups of that worker (possibly none); raises a WORKER_ERRORS on failure."""
        ...

    def reset(self, worker_id: str) -> None:
        """Drops all work of that worker."""
        ...


def finite_or_none(value: Any) -> float | None:
    """``value`` as a finite float; None for a null, a NaN or infinity, or a non-number (robust
    parsing of what a verifier or worker sent)."""
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return out if math.isfinite(out) else None


def reward_and_verdict(score: Any) -> tuple[float, str]:
    """A ``Scorer``'s score as (reward, verdict): a bare reward (any real number, numpy's
    too) has the verdict ""; a reward that is null or not a finite number (a verifier's
    failure) scores 0 with the verdict "verifier_error"."""
    if isinstance(score, numbers.Real) or score is None:
        reward, verdict = score, ""
    else:
        reward, verdict = getattr(score, "reward", None), str(getattr(score, "verdict", ""))
    value = finite_or_none(reward)
    if value is None:
        log.warning("a verifier's reward %r is not a finite number: scored 0", reward)
        return 0.0, "verifier_error"
    return value, verdict


class Scorer(Protocol):
    """Verifier verdicts: one list of G scores per (prompt, result) pair; a score is a reward
    (float) or has ``.reward`` and ``.verdict`` (``rlax_tasks.rewards.scoring.SampleScore``)."""

    def score(
        self, prompts: Sequence[Prompt], results: Sequence[GroupResult]
    ) -> list[list[Any]]: ...


# the trainer side: trains on a batch, pushes the new weights and returns their version; it
# raises TrainerBehindError when it restarted from a checkpoint older than the previous step,
# and may raise StepReplayedError when it had applied the step already (a replay, not applied)
TrainStep = Callable[[Batch], int]


@dataclasses.dataclass(frozen=True)
class ControllerSettings:
    """The decision parameters of the controller (derived from a RunConfig)."""

    prompts_per_step: int
    group_size: int
    sampling: SamplingParams
    reload_every: int = 1
    max_staleness: int | None = 1
    dynamic_sampling: bool = False
    overlong_cache_len: int | None = None  # DAPO overlong shaping when set
    overlong_factor: float = 1.0
    max_outstanding_groups: int = 0  # 0 = prompts_per_step
    groups_per_worker: int = 1
    worker_timeout_s: float = 300.0
    worker_retry_s: float = 5.0  # longest wait before a failed worker is tried again
    seed: int = 0
    # longest prompt a worker can take (workers.max_len - rollout.max_new_tokens); longer ones
    # are skipped and counted, never sent (None: no limit)
    max_prompt_tokens: int | None = None
    # scoring jobs in flight on threads beside the controller's (0: score in its own thread)
    scoring_threads: int = 0

    @classmethod
    def from_run_config(cls, cfg: RunConfig) -> ControllerSettings:
        r, obj = cfg.rollout, cfg.objective_config()
        return cls(
            prompts_per_step=r.prompts_per_step,
            group_size=r.group_size,
            sampling=SamplingParams(
                max_new_tokens=r.max_new_tokens,
                temperature=r.temperature,
                top_p=r.top_p,
                top_k=r.top_k,
                stop_strings=cfg.prompt.stop,
            ),
            reload_every=cfg.staleness.reload_every,
            max_staleness=cfg.staleness.max_staleness,
            dynamic_sampling=obj.dynamic_sampling,
            overlong_cache_len=(
                obj.overlong_cache_len(r.max_new_tokens) if obj.overlong_shaping else None
            ),
            overlong_factor=obj.overlong_factor,
            max_outstanding_groups=cfg.max_outstanding_groups,
            groups_per_worker=cfg.groups_per_worker,
            worker_timeout_s=cfg.workers.timeout_s,
            seed=cfg.seed,
            max_prompt_tokens=cfg.workers.max_len - r.max_new_tokens,
            scoring_threads=1,
        )


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
        self._unscored: list[tuple[Prompt, GroupResult]] = []  # not handed to the scorer yet
        self._scoring: list[tuple[list[tuple[Prompt, GroupResult]], Future]] = []  # in order
        self._scorer_threads = (
            ThreadPoolExecutor(settings.scoring_threads, thread_name_prefix="rlax-score")
            if settings.scoring_threads
            else None
        )
        self._encoded: dict[str, tuple[int, ...]] = {}  # prompt id -> tokens, until submitted
        self._skipped_in_a_row = 0
        self._steps_since_snapshot: list[dict[str, Any]] = []
        self._last_progress: dict[str, float] = {}
        self._down_until: dict[str, float] = {}
        self._failures: collections.Counter[str] = collections.Counter()  # in a row, per worker
        self.counters: collections.Counter[str] = collections.Counter()
        # seconds per phase in this process, over the whole run and since the last step was sent
        self.phase_totals: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self._phases: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self._cycle_start: float | None = None  # clock when the last step was sent
        self._idle_since: float | None = None  # clock when the last iterate() ended
        self._started = False

    # ------------------------------------------------------------------ lifecycle
    def start(self, initial_version: int = 0) -> bool:
        """Restores the newest committed snapshot (True) or starts fresh at ``initial_version``
        (False); resets every worker and re-issues the snapshot's in-flight prompts.

        The trainer must be at the snapshot's version (restored from its checkpoint).
        """
        self._cycle_start = self.clock()  # the first step's cycle includes the start-up
        try:
            return self._restore(initial_version)
        finally:
            self._idle_since = self.clock()

    def _restore(self, initial_version: int) -> bool:
        snap = self.store.load_latest()
        live = self._live_workers()
        for w in live:
            self._reset_worker(w)
        if snap is None:
            self.step, self.version = 0, initial_version
            self._started = True
            log.info("controller starts fresh at version %d", self.version)
            return False
        if snap.seed != self.settings.seed:
            raise ValueError(
                f"snapshot of step {snap.step} is for seed {snap.seed}, the run has seed "
                f"{self.settings.seed}: resume with the run's own configuration"
            )
        self.step, self.version = snap.step, snap.version
        self.mixture.load_state_dict(snap.mixture)
        self.buffer.load_state_dict(snap.buffer)
        self.counters = collections.Counter(snap.counters)
        self._restore_lineage(snap)
        later = self._committed_after(snap)  # steps trained after an older snapshot's
        trained = {pid for r in later for pid in r["prompt_ids"]}
        self._queue = collections.deque(
            self.mixture.prompt(q["prompt_id"], q["seq"])
            for q in snap.queued
            if q["prompt_id"] not in trained
        )
        by_worker: dict[str, list[Prompt]] = collections.defaultdict(list)
        orphans: list[Prompt] = []
        for item in snap.in_flight:
            if item["prompt_id"] in trained:
                continue
            prompt = self.mixture.prompt(item["prompt_id"], item["seq"])
            (by_worker[item["worker"]] if item["worker"] in live else orphans).append(prompt)
        self._queue.extendleft(reversed(orphans))
        for w in live:
            if by_worker.get(w):
                self._submit(w, by_worker[w])
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
            batch = self.buffer.take(self.version + 1)
            if batch is None or batch.prompt_ids != snap.pending:
                raise RuntimeError(
                    f"snapshot of step {snap.step} records a pending batch {snap.pending[:3]}... "
                    "that its buffer does not reproduce: the snapshot is inconsistent"
                )
            log.info("replaying the pending training step %d", self.step + 1)
            self._train(batch, sent_before=True)
        return True

    def _restore_lineage(self, snap: Snapshot) -> None:
        """Puts back the lineage lines of steps the snapshot counts as trained that
        lineage.jsonl lacks (a line cut short or lost), from ``rollouts/`` or the snapshot."""
        missing = [k for k in range(1, snap.step + 1) if not self.lineage.has(k)]
        if not missing:
            return
        listed = {s["step"]: s["prompt_ids"] for s in snap.steps}
        records = [recovered_record(self.run_dir, k, listed.get(k)) for k in missing]
        restored = self.lineage.restore([r for r in records if r is not None])
        lost = [k for k, r in zip(missing, records, strict=True) if r is None]
        if lost:
            log.warning(
                "lineage.jsonl has no line for trained steps %s and neither rollouts/ nor the "
                "snapshot records them: left out", _steps_text(lost),
            )  # fmt: skip
        if restored:
            notices.post(
                self.run_dir,
                "fallback",
                f"lineage.jsonl had no complete line for step(s) {_steps_text(restored)}, which "
                f"the snapshot of step {snap.step} counts as trained: restored from rollouts/ "
                '(or the snapshot), marked "restored"',
                source="controller",
            )

    def _committed_after(self, snap: Snapshot) -> list[dict[str, Any]]:
        """The lineage records of steps trained after ``snap`` that its pending replay does not
        cover: non-empty only when ``snap`` is older than the newest state (a damaged newer
        snapshot was set aside)."""
        later = sorted(
            (r for r in self.lineage.records if r["step"] > snap.step), key=lambda r: r["step"]
        )
        steps = [r["step"] for r in later]
        if steps != list(range(snap.step + 1, snap.step + 1 + len(steps))):
            raise RuntimeError(
                f"{self.lineage.path} records steps {_steps_text(steps)} after the snapshot's "
                f"step {snap.step}, with gaps: remove the lines after the first gap to resume"
            )
        if snap.pending is not None and steps == [snap.step + 1]:
            return []  # the pending step itself: replayed as usual
        return later

    def _roll_forward(self, snap: Snapshot, later: list[dict[str, Any]], trained: set[str]) -> None:
        """Brings a restored older snapshot up to the steps trained since (``later``, from
        lineage.jsonl): their prompts leave the buffer and the queue, the prompts drawn after
        the snapshot are drawn again (the trained ones passed over, the others queued in draw
        order) and the step and version move to the last of them. The trainer holds those
        steps, or is given them again from ``rollouts/`` (``TrainerBehindError``)."""
        state = self.buffer.state_dict()
        known = {g["prompt_id"] for g in state["groups"]}
        known |= {q["prompt_id"] for q in snap.queued} | set(snap.in_flight_ids)
        # the drops and skips before the first of these steps are in its lineage line already
        self.buffer.load_state_dict(
            {
                **state,
                "groups": [g for g in state["groups"] if g["prompt_id"] not in trained],
                "dropped": [],
                "skipped": [],
            }
        )
        ahead = trained - known  # drawn after the snapshot, trained since
        budget = max(self.settings.max_outstanding_groups, self.settings.prompts_per_step)
        limit = len(ahead) + max(64, 4 * budget) * (len(later) + 1)
        draws = 0
        while ahead and draws < limit:
            prompt = self.mixture.next()
            draws += 1
            if prompt.id in ahead:
                ahead.discard(prompt.id)
            elif self._unusable(prompt) is None:  # (an unusable one was skipped back then)
                self._queue.append(prompt)
        self.counters["drawn"] += draws
        if ahead:
            log.warning(
                "%d prompts trained after the snapshot of step %d were not drawn again within "
                "%d draws; they may be drawn again later", len(ahead), snap.step, draws,
            )  # fmt: skip
        last = later[-1]
        self.step, self.version = int(last["step"]), int(last["version"])
        self.counters["trained_groups"] += sum(len(r["prompt_ids"]) for r in later)
        self._steps_since_snapshot += [
            {"step": r["step"], "prompt_ids": r["prompt_ids"]} for r in later
        ]
        log.warning(
            "the snapshot of step %d is older than lineage.jsonl: steps %s were trained after "
            "it; continuing from step %d", snap.step, _steps_text([r["step"] for r in later]),
            self.step,
        )  # fmt: skip

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

        ``last_step``: the run's last step (drivers pass it): the prompts of the next step go
        out as soon as a step is trained, except after that one. Returns whether anything
        happened (a result arrived or a step was trained).
        """
        if not self._started:
            raise RuntimeError("call start() first: it restores a snapshot or starts fresh")
        if self._idle_since is not None:
            self._add_time("wait", self.clock() - self._idle_since)
        try:
            with self._timed("dispatch"):
                self._dispatch()
            with self._timed("collect"):
                got = self._collect()
            with self._timed("score"):
                self._score()
            with self._timed("batch"):
                before = self.buffer.state_dict()
                pending = [p.seq for p in self._queue]
                pending += [e.prompt.seq for e in self._in_flight.values()]
                pending += [p.seq for p, _ in self._not_in_buffer()]
                batch = self.buffer.take(self.version + 1, pending)
            if batch is None:
                return got > 0
            with self._timed("snapshot"):
                self.snapshot(pending=batch, buffer_state=before)
            self._train(batch, dispatch_next=last_step is None or self.step + 1 < last_step)
            return True
        finally:
            self._idle_since = self.clock()

    def wait_for_scoring(self, timeout_s: float) -> bool:
        """Waits up to ``timeout_s`` for the oldest scoring job on the scorer's threads to end;
        returns False at once when none runs. A driver idling between ``iterate`` calls waits
        here rather than sleeping a fixed interval: the batch forms as soon as it is scored."""
        if not self._scoring:
            return False
        futures_wait([self._scoring[0][1]], timeout=timeout_s)
        return True

    # ------------------------------------------------------------------ phase timing
    @contextlib.contextmanager
    def _timed(self, phase: str) -> Iterator[None]:
        """Adds the clock time of the ``with`` block to ``phase``."""
        t0 = self.clock()
        try:
            yield
        finally:
            self._add_time(phase, self.clock() - t0)

    def _add_time(self, phase: str, seconds: float) -> None:
        seconds = max(0.0, seconds)
        self._phases[phase] += seconds
        self.phase_totals[phase] += seconds

    def _end_cycle(self) -> dict[str, float]:
        """The seconds per phase since the previous step was sent, as ``time_<phase>_s``
        metrics plus ``time_other_s`` (in no phase) and ``time_cycle_s`` (all); starts the
        next cycle now."""
        now = self.clock()
        cycle = 0.0 if self._cycle_start is None else max(0.0, now - self._cycle_start)
        out = {f"time_{p}_s": s for p, s in self._phases.items()}
        out["time_other_s"] = max(0.0, cycle - sum(self._phases.values()))
        out["time_cycle_s"] = cycle
        self._phases = dict.fromkeys(PHASES, 0.0)
        self._cycle_start = now
        return out

    # ------------------------------------------------------------------ dispatch
    def _live_workers(self) -> list[str]:
        now = self.clock()
        return [w for w in self.pool.worker_ids() if self._down_until.get(w, -np.inf) <= now]

    @property
    def outstanding(self) -> int:
        """Prompts drawn and not yet trained or dropped: queued, in flight, unscored, buffered."""
        unscored = len(self._not_in_buffer())
        return len(self._queue) + len(self._in_flight) + unscored + len(self.buffer)

    def _not_in_buffer(self) -> list[tuple[Prompt, GroupResult]]:
        """Generated groups not scored yet (being scored first, in order)."""
        return [item for items, _ in self._scoring for item in items] + self._unscored

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
        drawn = kept = 0
        outstanding = self.outstanding  # a prompt taken off the queue below stays outstanding
        while live:
            w = min(live, key=lambda x: (load[x], live.index(x)))
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
        self.counters["drawn"] += drawn
        for w in live:
            if plan[w]:
                self._submit(w, plan[w])

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
        return GroupRequest(
            prompt.id,
            tokens,
            self.settings.group_size,
            dataclasses.replace(self.settings.sampling, seed=seed),
            # trains at version + 1 at the earliest: older rollouts would only be dropped
            min_version=0 if k is None else max(0, self.version + 1 - k),
        )

    def _submit(self, worker: str, prompts: list[Prompt]) -> None:
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
            log.log(
                logging.WARNING if self._failures[worker] == 0 else logging.INFO,
                "worker %s refused %d groups: %s",
                worker,
                len(prompts),
                e,
            )
            self._worker_failed(worker, also=prompts)
            return
        now = self.clock()
        self._failures.pop(worker, None)
        if not any(e.worker == worker for e in self._in_flight.values()):
            self._last_progress[worker] = now
        for p in prompts:
            self._in_flight[p.id] = _InFlight(p, worker, now)
        self.counters["issued"] += len(prompts)

    def _worker_failed(self, worker: str, also: Sequence[Prompt] = ()) -> None:
        """Resets a failed worker; its in-flight prompts (and ``also``) go to the queue front."""
        back = [e.prompt for e in self._in_flight.values() if e.worker == worker]
        for p in back:
            del self._in_flight[p.id]
        lost = len(back)  # prompts it held (the refused ones, ``also``, it never had)
        back.extend(also)
        # re-issued first, earliest draw first (whichever worker held them)
        self._queue = collections.deque(sorted([*back, *self._queue], key=lambda p: p.seq))
        self.counters["worker_failures"] += 1
        self.counters["reissued"] += len(back)
        # tried again soon at first (a worker starting up or restarting is back in seconds),
        # then less and less often, up to worker_retry_s
        self._failures[worker] += 1
        delay = min(self.settings.worker_retry_s, 0.25 * 2 ** (self._failures[worker] - 1))
        self._down_until[worker] = self.clock() + delay
        self._last_progress.pop(worker, None)
        self._reset_worker(worker)
        log.log(
            logging.WARNING if lost or self._failures[worker] == 1 else logging.INFO,
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
            now = self.clock()
            if results:
                self._last_progress[w] = now
                self._failures.pop(w, None)
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
                self._unscored.append((entry.prompt, r))
                got += 1
            if not results and any(e.worker == w for e in self._in_flight.values()):
                idle = now - self._last_progress.get(w, now)
                if idle > self.settings.worker_timeout_s:
                    log.warning("worker %s returned nothing for %.0fs", w, idle)
                    self.counters["worker_timeouts"] += 1
                    self._worker_failed(w)
        return got

    def _score(self) -> None:
        """Hands the unscored groups to the scorer (on its threads when there are any) and
        buffers the scores of finished jobs, in the order they were handed over."""
        while self._scoring and self._scoring[0][1].done():
            items, job = self._scoring.pop(0)
            try:
                self._buffer_scored(items, job.result())
            except SCORER_ERRORS as e:
                self._scorer_failed(items, e)
        if not self._unscored:
            return
        items, self._unscored = self._unscored, []
        prompts, results = [p for p, _ in items], [r for _, r in items]
        if self._scorer_threads is None:
            try:
                self._buffer_scored(items, self.scorer.score(prompts, results))
            except SCORER_ERRORS as e:
                self._scorer_failed(items, e)
        elif len(self._scoring) < self.settings.scoring_threads:
            self._scoring.append(
                (items, self._scorer_threads.submit(self.scorer.score, prompts, results))
            )
        else:
            self._unscored = items  # every scoring thread is busy: next round

    def _scorer_failed(self, items: list[tuple[Prompt, GroupResult]], e: Exception) -> None:
        self.counters["scorer_failures"] += 1
        log.warning("scoring %d groups failed (%s); retrying next round", len(items), e)
        self._unscored = items + self._unscored

    def _buffer_scored(self, items: list[tuple[Prompt, GroupResult]], scores: list) -> None:
        if len(scores) != len(items):
            raise RuntimeError(
                f"the scorer returned {len(scores)} score lists for {len(items)} groups"
            )
        for (p, r), s in zip(items, scores, strict=True):
            self.buffer.add(self._scored(p, r, s))

    def close(self) -> None:
        """Stops the scoring threads (a scoring job under way finishes first)."""
        if self._scorer_threads is not None:
            self._scorer_threads.shutdown(wait=True, cancel_futures=True)

    def _scored(self, prompt: Prompt, result: GroupResult, raw: Sequence[Any]) -> ScoredGroup:
        s = self.settings
        comps = result.completions
        if len(raw) != len(comps):
            raise RuntimeError(f"{prompt.id}: {len(raw)} scores for {len(comps)} completions")
        scores, verdicts = zip(*(reward_and_verdict(x) for x in raw), strict=True)
        rewards = np.asarray(scores, dtype=np.float64)
        if s.overlong_cache_len is not None:
            lengths = np.array([len(c.tokens) for c in comps])
            rewards = rewards + overlong_penalty(
                lengths, s.sampling.max_new_tokens, s.overlong_cache_len, s.overlong_factor
            )
        return ScoredGroup(
            prompt_id=prompt.id,
            seq=prompt.seq,
            version=result.version,
            prompt_tokens=tuple(result.prompt_tokens),
            completions=tuple(tuple(int(t) for t in c.tokens) for c in comps),
            # (a null log-prob arrives as NaN: the trainer stops on a non-finite loss, naming it)
            logprobs=tuple(tuple(_float(x) for x in c.logprobs) for c in comps),
            finish_reasons=tuple(c.finish_reason for c in comps),
            scores=tuple(scores),
            rewards=tuple(float(x) for x in rewards),
            verdicts=tuple(verdicts) if any(verdicts) else (),
        )

    # ------------------------------------------------------------------ train, record, snapshot
    def _train(self, batch: Batch, sent_before: bool = False, dispatch_next: bool = False) -> None:
        """Trains the next step on ``batch`` (``sent_before``: the pending step of the restored
        snapshot, which the trainer may have applied before this controller heard back;
        ``dispatch_next``: hands out the next prompts before the step's records are written)."""
        batch = dataclasses.replace(batch, timings=self._end_cycle())
        step = self.step + 1
        sent_before = sent_before or self.lineage.has(step)
        with self._timed("train"):
            try:
                new_version = self._send_step(batch, step, sent_before)
            except TrainerBehindError as e:
                self._replay_trainer(e.trainer_step)
                new_version = self._send_step(batch, step, sent_before)
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
            # and the snapshot records them in flight (a lockstep run otherwise left the
            # sampler idle for those ~10 ms of a tiny-preset step)
            try:
                with self._timed("dispatch"):
                    self._dispatch()
            except ValueError as e:  # every prompt drawn was unusable: raised once recorded
                unusable = e
        with self._timed("lineage"):
            self.lineage.append(lineage_record(self.step, batch))
        with self._timed("rollouts"):
            write_rollouts(self.run_dir, self.step, batch, self._verifiers)
        self._steps_since_snapshot.append({"step": self.step, "prompt_ids": batch.prompt_ids})
        if self.version % self.settings.reload_every == 0:
            with self._timed("snapshot"):
                self.snapshot()
        if unusable is not None:
            raise unusable

    def _replay_trainer(self, trainer_step: int) -> None:
        """Gives a trainer restored at ``trainer_step`` the steps after it, up to ours, again.

        Each is rebuilt from ``rollouts/step-<k>.parquet`` (the exact arrays it trained on), so
        it applies once more onto the restored state and produces the same version.
        """
        if not 0 <= trainer_step < self.step:
            raise RuntimeError(
                f"the trainer reports step {trainer_step}, the controller is at step {self.step}"
            )
        log.warning(
            "the trainer restarted from its checkpoint of step %d: replaying steps %d-%d from %s",
            trainer_step,
            trainer_step + 1,
            self.step,
            rollouts_dir(self.run_dir),
        )
        for k in range(trainer_step + 1, self.step + 1):
            version = self._send_step(read_step_batch(self.run_dir, k), k, sent_before=True)
            if version != k:
                raise RuntimeError(f"replayed step {k} produced version {version}, not {k}")
        self.counters["replayed_steps"] += self.step - trainer_step

    def _send_step(self, batch: Batch, step: int, sent_before: bool) -> int:
        """``train_step(batch)``: the version it produced. A replay answer (the trainer had
        applied the step already) stands only for a step this controller sent before; for any
        other, someone else trained the policy on their own batch, and the run stops here."""
        try:
            return self.train_step(batch)
        except StepReplayedError as e:
            if sent_before:
                log.info("the trainer had applied step %d already: replayed, not applied", step)
                return e.version
            log.error(
                "the trainer answered step %d as already applied, but this controller never "
                "sent it (not the pending step of its snapshot, not in lineage.jsonl): someone "
                "else trained the policy; stopping",
                step,
            )
            raise RuntimeError(
                f"the trainer had already applied step {step}, which this controller never "
                "sent: the policy was trained on a batch from elsewhere. Stop the run, check "
                "who holds the run's token, and resume from a checkpoint before that step"
            ) from e

    def snapshot(
        self, pending: Batch | None = None, buffer_state: dict[str, Any] | None = None
    ) -> Snapshot:
        """Writes and commits a snapshot of the current state (also called every j versions).

        With ``pending`` it is the write-ahead record of a training step about to happen:
        ``buffer_state`` is the buffer before that batch was taken.
        """
        queued = [p for p, _ in self._not_in_buffer()] + list(self._queue)  # regenerate
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
            "scoring": len(self._not_in_buffer()),
        }


def _float(value: Any) -> float:
    """``float(value)``, NaN for a null (robust parsing of a worker's answer)."""
    return float("nan") if value is None else float(value)


def _steps_text(steps: Sequence[int]) -> str:
    """A short list of step numbers for messages."""
    steps = list(steps)
    if len(steps) > 6:
        return f"{', '.join(map(str, steps[:3]))}, ..., {steps[-1]} ({len(steps)} steps)"
    return ", ".join(map(str, steps))
