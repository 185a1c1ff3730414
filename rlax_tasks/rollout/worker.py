"""The inference worker: generates groups of G completions per prompt, tagged with a weight version.

Passive (docs/design.md §2): the controller submits prompt groups and collects results; weights come
from a ``WeightSource`` (the PS client or fixed HF weights). It reloads only when the source is
``reload_every`` versions ahead; the sequences in flight then continue on the new weights, each
token recording its version (``interrupt``), or are generated again from scratch."""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import jax

from rlax_tasks.process.garbage_collection import collect_if_due
from rlax_tasks.rollout.episodes import EpisodeDriver
from rlax_tasks.rollout.requests import (  # GroupRequest/GroupResult re-exported
    Completion,
    GroupRequest,
    GroupResult,
    Request,
    SampleProgress,
)
from rlax_tasks.rollout.sampler import Sampler
from rlax_tasks.rollout.staleness import should_reload
from rlax_tasks.rollout.weight_source import WeightSource
from rlax_tasks.utils.validation import check_int, field_error

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Pending:
    group: GroupRequest
    started: float
    done: dict[int, Completion] = dataclasses.field(default_factory=dict)
    resumed: dict[int, int] = dataclasses.field(default_factory=dict)  # sample -> tokens handed
    prompt: tuple[int, ...] | None = None  # an episode group's: rendered by its environment


@dataclasses.dataclass
class _ProgressCall:
    """A ``progress()`` call waiting for the generation thread to answer between steps."""

    answered: threading.Event = dataclasses.field(default_factory=threading.Event)
    groups: dict[str, list[SampleProgress]] | None = None


@dataclasses.dataclass
class WorkerStats:
    """Counters for the status endpoint and progress lines."""

    groups_done: int = 0
    completions_done: int = 0
    tokens_generated: int = 0
    reloads: int = 0
    groups_discarded: int = 0
    last_reload_s: float | None = None
    pulled_bytes: int = 0  # received by the reloads (deltas where the source sent them) ...
    pulled_full_bytes: int = 0  # ... and what whole versions would have taken
    resumed_tokens: int = 0  # handed back in resume records: not generated again
    episodes_done: int = 0
    started: float = dataclasses.field(default_factory=time.monotonic)


class InferenceWorker:
    """Runs a Sampler over submitted groups in a background thread; version-tags every result.

    ``submit`` queues groups; ``results`` hands back finished ones (waiting up to ``wait_s``);
    ``reset`` drops everything (a restarted controller re-issues its in-flight prompts).
    """

    def __init__(
        self,
        sampler: Sampler,
        source: WeightSource,
        reload_every: int = 1,
        poll_interval_s: float = 0.5,
        status_every_s: float = 30.0,
        interrupt: bool = True,
    ) -> None:
        """``interrupt``: at a reload the sequences in flight keep their tokens and continue on
        the new weights; False: they are dropped and their groups generated again."""
        check_int("reload_every", reload_every, field_error(ValueError), minimum=1)
        self.sampler, self.source = sampler, source
        self.interrupt = interrupt
        self.reload_every, self.poll_interval_s = reload_every, poll_interval_s
        self.status_every_s = status_every_s
        self.version: int | None = None
        self.stats = WorkerStats()
        self._queue: collections.deque[GroupRequest] = collections.deque()
        self._pending: dict[str, _Pending] = {}
        self._results: collections.deque[GroupResult] = collections.deque()
        self._lock = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.failed = threading.Event()  # set when the generation thread died (see _error)
        self._last_poll = 0.0
        self._reset_sampler = False
        self._unacked: int | None = None  # a loaded version the source has not heard of yet
        self._progress_calls: list[_ProgressCall] = []
        self._driver: EpisodeDriver | None = None  # episode groups' (docs/design.md §15)

    # ------------------------------------------------------------------ controller side
    def submit(self, groups: Sequence[GroupRequest]) -> None:
        """Queues groups (validated first: nothing is queued if one is invalid); a group's
        ``resume`` records go on from their tokens."""
        for g in groups:
            if g.environment is not None:
                self._check_episodes(g)
                continue
            for i in range(g.group_size):
                self.sampler.validate(self._request(g, i))
            for r in g.resume:
                self.sampler.check_token_ids(
                    r.tokens, f"{g.prompt_id!r} resume sample {r.sample}: token"
                )
        with self._lock:
            known = set(self._pending) | {g.prompt_id for g in self._queue}
            for g in groups:
                if g.prompt_id in known:
                    raise ValueError(f"prompt_id {g.prompt_id!r} is already in flight")
                known.add(g.prompt_id)
            self._queue.extend(groups)
            self._lock.notify_all()

    def _check_episodes(self, g: GroupRequest) -> None:
        """ValueError naming what an episode group gets wrong (its environment, its settings)."""
        from rlax_tasks.environments import EnvironmentSpec

        try:
            EnvironmentSpec.from_dict(dict(g.environment or {}))
        except ValueError as e:
            raise ValueError(f"{g.prompt_id!r}: environment: {e}") from None
        g.params.validate(self.sampler.policy.config.vocab_size)
        if self.sampler.policy.tokenizer is None:
            raise ValueError(f"{g.prompt_id!r}: episodes need the model's tokenizer; it has none")

    def episodes(self) -> EpisodeDriver:
        """The driver of this worker's episodes (made on first use)."""
        if self._driver is None:
            self._driver = EpisodeDriver(self.sampler, wake=self._wake)
        return self._driver

    def _wake(self) -> None:
        with self._lock:
            self._lock.notify_all()

    def results(self, wait_s: float = 0.0, max_groups: int | None = None) -> list[GroupResult]:
        """Finished groups (removed from the worker), waiting up to ``wait_s`` for the first."""
        deadline = time.monotonic() + wait_s
        with self._lock:
            while not self._results and self._error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._lock.wait(left)
            self._raise_if_failed()
            n = len(self._results) if max_groups is None else min(max_groups, len(self._results))
            return [self._results.popleft() for _ in range(n)]

    def wait_for_results(self, timeout_s: float) -> bool:
        """Waits up to ``timeout_s`` until a finished group is ready to collect (or the
        generation thread failed); returns whether one is. Nothing is removed: an in-process
        driver sleeps here instead of polling ``results``."""
        with self._lock:
            return self._lock.wait_for(
                lambda: bool(self._results) or self._error is not None, timeout_s
            )

    def progress(self, timeout_s: float = 10.0) -> dict[str, list[SampleProgress]]:
        """What each unfinished group holds so far, per prompt id: its finished samples and the
        tokens of those in flight (read by the generation thread between two steps, so a
        token is in exactly one of them). TimeoutError when that thread does not answer in
        ``timeout_s`` (a long compile); RuntimeError when it stopped."""
        call = _ProgressCall()
        with self._lock:
            self._raise_if_failed()
            if self._thread is None or not self._thread.is_alive():
                raise RuntimeError("the inference worker is not running")
            self._progress_calls.append(call)
            self._lock.notify_all()
        if not call.answered.wait(timeout_s):
            with self._lock:
                if call in self._progress_calls:
                    self._progress_calls.remove(call)
            raise TimeoutError(f"the generation thread did not report in {timeout_s:.0f}s")
        with self._lock:
            self._raise_if_failed()
        assert call.groups is not None
        return call.groups

    def _answer_progress(self) -> None:
        """Answers waiting ``progress()`` calls (generation thread, between steps)."""
        with self._lock:
            if not self._progress_calls:
                return
            partials: dict[str, dict[int, SampleProgress]] = collections.defaultdict(dict)
            in_progress = self.sampler.in_progress()
            for p in in_progress:
                if self._driver is not None and self._driver.owns(p):
                    continue  # an episode's turn: its record is the driver's
                prompt_id, sample = p.request.request_id
                if p.tokens and prompt_id in self._pending:
                    partials[prompt_id][sample] = SampleProgress.of(sample, p)
            groups: dict[str, list[SampleProgress]] = {}
            for prompt_id, pending in self._pending.items():
                held = {i: SampleProgress.of(i, c) for i, c in pending.done.items()}
                held.update(partials.get(prompt_id, {}))
                if held:
                    groups[prompt_id] = [held[i] for i in sorted(held)]
            if self._driver is not None and self._driver.episodes:
                for (prompt_id, sample), r in self._driver.records(in_progress).items():
                    if prompt_id in self._pending:
                        held = {x.sample: x for x in groups.get(prompt_id, [])}
                        held[sample] = r
                        groups[prompt_id] = [held[i] for i in sorted(held)]
            for g in self._queue:  # handed back records not admitted yet: still held
                if g.resume:
                    groups[g.prompt_id] = list(g.resume)
            for call in self._progress_calls:
                call.groups = groups
                call.answered.set()
            self._progress_calls.clear()

    def reset(self) -> int:
        """Drops queued, in-flight and uncollected work; returns the number of groups dropped."""
        with self._lock:
            dropped = len(self._queue) + len(self._pending) + len(self._results)
            self._queue.clear()
            self._pending.clear()
            self._results.clear()
            if self._driver is not None:
                for key in list(self._driver.episodes):
                    self._driver.drop(key)
            self._reset_sampler = True
            self._lock.notify_all()
            return dropped

    def status(self) -> dict[str, Any]:
        with self._lock:
            elapsed = time.monotonic() - self.stats.started
            return {
                "version": self.version,
                "queued": len(self._queue),
                "in_flight": len(self._pending),
                "ready": len(self._results),
                "tokens_per_s": self.stats.tokens_generated / max(elapsed, 1e-9),
                **dataclasses.asdict(self.stats),
                "error": repr(self._error) if self._error else None,
            }

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> InferenceWorker:
        """Loads the first weights (waiting for the source to have any) and starts generating."""
        while True:
            try:
                self._reload(min_version=None)
                break
            except (TimeoutError, ConnectionError) as e:
                if self._stop.is_set():
                    raise
                log.info("waiting for a first weight version (%s)", e)
                time.sleep(self.poll_interval_s)
        self._thread = threading.Thread(target=self._run, name="inference-worker", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self.sampler.stop_precompiling()  # the process may be about to exit
        with self._lock:
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def __enter__(self) -> InferenceWorker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ generation thread
    def _request(self, g: GroupRequest, sample: int) -> Request:
        return Request(
            g.prompt_tokens, g.params, sample_index=sample, request_id=(g.prompt_id, sample)
        )

    def _run(self) -> None:
        last_status = time.monotonic()
        try:
            while not self._stop.is_set():
                self._answer_progress()
                self._maybe_reload()
                self._reload_for_queued()
                self._admit()
                if self.sampler.has_unfinished:
                    self._collect(self.sampler.step())
                    collect_if_due()  # between decode chunks (process.garbage_collection)
                else:
                    with self._lock:
                        if not self._queue and not self._stop.is_set():
                            # (a step ending wakes it: a slot waiting on a tool comes back)
                            self._lock.wait(self.poll_interval_s)
                if self._driver is not None and self._driver.episodes:
                    self._collect([])
                if time.monotonic() - last_status >= self.status_every_s:
                    last_status = time.monotonic()
                    s = self.status()
                    log.info(
                        "worker v%s: %d groups done, %d queued, %d in flight, %.0f tok/s",
                        s["version"],
                        s["groups_done"],
                        s["queued"],
                        s["in_flight"],
                        s["tokens_per_s"],
                    )
        except BaseException as e:  # surfaced to the controller through results()/status()
            log.exception("inference worker failed")
            with self._lock:
                self._error = e
                self._lock.notify_all()
            self.failed.set()

    def _reload_for_queued(self) -> None:
        """Reloads (waiting for the source) when a queued group needs a newer version."""
        with self._lock:
            needed = max((g.min_version for g in self._queue), default=0)
        if self.version is not None and needed > self.version:
            self._reload(min_version=needed)

    def _admit(self) -> None:
        with self._lock:
            if self._reset_sampler:
                self.sampler.abort()
                self._reset_sampler = False
            held = -1 if self.version is None else self.version
            waiting = collections.deque()
            while self._queue:
                g = self._queue.popleft()
                if g.min_version > held:  # needs newer weights: stays queued until a reload
                    waiting.append(g)
                    continue
                pending = self._pending[g.prompt_id] = _Pending(g, time.monotonic())
                records = {r.sample: r for r in g.resume}
                if g.environment is not None:
                    self._start_episodes(g, pending, records)
                    continue
                for i in range(g.group_size):
                    request, record = self._request(g, i), records.get(i)
                    if record is None or not record.tokens:
                        self.sampler.add_request(request)
                        continue
                    pending.resumed[i] = len(record.tokens)
                    self.stats.resumed_tokens += len(record.tokens)
                    if record.finish_reason is not None:
                        pending.done[i] = record.completion(request, len(record.tokens))
                    else:
                        self.sampler.add_partial(record.partial(request))
                if len(pending.done) == g.group_size:  # every sample had finished already
                    del self._pending[g.prompt_id]
                    self._results.append(self._result(pending))
                    self.stats.groups_done += 1
                    self._lock.notify_all()
            self._queue = waiting

    def _start_episodes(
        self, g: GroupRequest, pending: _Pending, records: dict[int, SampleProgress]
    ) -> None:
        """Starts a group's episodes, or goes on with them from their records."""
        from rlax_tasks.environments import EnvironmentSpec

        driver = self.episodes()
        spec = EnvironmentSpec.from_dict(dict(g.environment or {}))
        row = dict(g.row or {})
        pending.prompt = driver.initial_prompt(spec, row)
        for i in range(g.group_size):
            record = records.get(i)
            if record is not None and record.tokens:
                pending.resumed[i] = len(record.tokens)
                self.stats.resumed_tokens += len(record.tokens)
            driver.start((g.prompt_id, i), spec, row, g.params, resume=record)

    def _collect(self, finished: list[Completion]) -> None:
        driver = self._driver
        if driver is not None:
            turns = [c for c in finished if driver.owns(c)]
            finished = [c for c in finished if not driver.owns(c)]
            before = driver.generated
            for c in turns:
                driver.on_turn(c)
            self.stats.tokens_generated += driver.generated - before
            for ep in driver.poll():
                prompt_id, sample = ep.key
                pending = self._pending.get(prompt_id)
                if pending is None:
                    continue
                request = Request(ep.prompt, pending.group.params, sample_index=sample,
                                  request_id=ep.key)  # fmt: skip
                finished.append(ep.completion(request))
                self.stats.episodes_done += 1
        with self._lock:
            for c in finished:
                prompt_id, sample = c.request.request_id
                pending = self._pending.get(prompt_id)
                if pending is None:  # dropped by reset() while in flight
                    continue
                c.resumed = pending.resumed.get(sample, 0)
                pending.done[sample] = c
                self.stats.completions_done += 1
                if c.episode is None:  # (an episode's turns counted as they ended)
                    self.stats.tokens_generated += len(c.tokens) - c.resumed
                if len(pending.done) == pending.group.group_size:
                    del self._pending[prompt_id]
                    self._results.append(self._result(pending))
                    self.stats.groups_done += 1
            if finished:
                self._lock.notify_all()

    def _result(self, p: _Pending) -> GroupResult:
        completions = [p.done[i] for i in range(p.group.group_size)]
        tok = self.sampler.policy.tokenizer
        texts = None
        if tok is not None:
            texts = [tok.decode(c.tokens, skip_special_tokens=True) for c in completions]
        assert self.version is not None
        # the oldest weights any of its tokens was sampled with: what staleness is judged by
        oldest = min(min(c.versions or [self.version]) for c in completions)
        return GroupResult(
            p.group.prompt_id,
            oldest,
            p.group.prompt_tokens if p.prompt is None else p.prompt,
            completions,
            texts,
            time.monotonic() - p.started,
        )

    def _maybe_reload(self) -> None:
        now = time.monotonic()
        if now - self._last_poll < self.poll_interval_s:
            return
        self._last_poll = now
        if self._unacked is not None:
            self._ack(self._unacked)
        try:
            latest = self.source.latest_version()
        except (TimeoutError, ConnectionError) as e:  # the PS may be restarting: keep going
            log.warning("cannot reach the weight source (%s); generating with v%s", e, self.version)
            return
        if self.version is None or not should_reload(self.version, latest, self.reload_every):
            return  # (start() loads the first version)
        self._reload(min_version=self.version + self.reload_every)

    def _reload(self, min_version: int | None) -> None:
        """Pulls newer weights; the requests in flight continue on them (``interrupt``), or
        their groups are discarded and queued again, first."""
        t0 = time.monotonic()
        try:
            # to host memory (shapes and structure of the sampler's weights, not their
            # placement): set_params then swaps them in place, never two copies on the device
            like = jax.tree.map(
                lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), self.sampler.params
            )
            version, params = self.source.pull(min_version, like=like)
        except (TimeoutError, ConnectionError) as e:
            if self.version is None:
                raise
            log.warning("reload failed (%s); generating with v%s", e, self.version)
            return
        with self._lock:
            if self.interrupt:
                again, continued = [], self.sampler.interrupt()
            else:
                self.sampler.abort()
                again, continued = [p.group for p in self._pending.values()], 0
                self.stats.groups_discarded += len(again)
                for key in list(self._driver.episodes if self._driver else ()):
                    self._driver.drop(key)
                self._pending.clear()
                self._queue.extendleft(reversed(again))
        donate = getattr(self.source, "fresh_arrays", False)
        self.sampler.set_params(params, donate=donate, version=version)
        self.version = version
        self._ack(version)
        self.stats.reloads += 1
        self.stats.last_reload_s = time.monotonic() - t0
        pulled = getattr(self.source, "last_pull", None)  # the PS client's PullStats
        how = ""
        if pulled is not None and pulled.version == version:
            self.stats.pulled_bytes += pulled.nbytes
            self.stats.pulled_full_bytes += pulled.full_nbytes
            if pulled.base is not None:
                how = f", a delta from v{pulled.base}: {pulled.nbytes / pulled.full_nbytes:.1%}"
        log.info(
            "worker loaded weights v%d in %.2fs%s (%d requests continue on it, %d groups "
            "regenerate)", version, self.stats.last_reload_s, how, continued, len(again),
        )  # fmt: skip

    def _ack(self, version: int) -> None:
        """Tells the source ``version`` is loaded; when it cannot be reached (a PS restarting
        elsewhere after a preemption) the worker keeps generating and acks again at its next
        poll: a missed ack only delays garbage collection, it must not stop the worker."""
        try:
            self.source.ack(version)
        except (TimeoutError, ConnectionError) as e:
            if self._unacked != version:  # once per version: a retry at every poll is routine
                log.warning("cannot ack v%d to the weight source (%s); retrying", version, e)
            self._unacked = version
        else:
            if self._unacked is not None:
                log.info("acked v%d to the weight source", version)
            self._unacked = None

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"the inference worker stopped: {self._error!r}") from self._error
