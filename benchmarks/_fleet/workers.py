"""Simulated inference workers: each one an HTTP endpoint speaking the worker API the controller
calls (rlax_tasks/rollout/service.py: /healthz, /v1/status, POST /v1/groups, GET /v1/results,
/v1/progress, POST /v1/reset) and a thread pulling weight versions from its parameter-server
replica with the real client. No model: a group takes a drawn time (lognormal, seeded; slow
workers longer) and comes back with random tokens, log-probs and each token's version.

A host process (``host_main``) runs a few hundred of them on one asyncio loop and counts, outside
the controller, what became of every group it generated (handed over, dropped by a reset, lost
with a preempted worker, still held at the end)."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import resource
import threading
import time
from typing import Any

import numpy as np

from benchmarks._fleet.sim_http import Endpoint
from rlax_tasks.rollout.requests import (
    Completion,
    GroupRequest,
    GroupResult,
    Request,
    SampleProgress,
)
from rlax_tasks.rollout.service import MAX_GROUPS, check_groups
from rlax_tasks.services.http import AuthError, check_bearer, check_wait_s

log = logging.getLogger(__name__)

VOCAB = 32_000
PULL_WAIT_S = 30.0  # one long poll for a newer version (the PS holds it at most max_wait_s)
RETRY_S = 1.0  # after a failed pull


@dataclasses.dataclass(frozen=True)
class WorkerSettings:
    """How the simulated workers behave (the same for every host of a run)."""

    token: str
    ps_urls: tuple[str, ...]
    reload_every: int = 1
    gen_median_s: float = 2.0  # a group's generation time: lognormal with this median ...
    gen_sigma: float = 0.5  # ... and this sigma of its log
    slow_factor: float = 5.0  # a slow worker's groups take this many times longer
    tokens_min: int = 64  # a completion's length: uniform in [tokens_min, tokens_max]
    tokens_max: int = 448
    seed: int = 0


@dataclasses.dataclass
class Counts:
    """What became of the groups of one worker (or a host: summed)."""

    submitted: int = 0  # groups accepted by POST /v1/groups
    generated: int = 0  # groups finished
    popped: int = 0  # taken by GET /v1/results ...
    delivered: int = 0  # ... and written out whole, or ...
    lost_in_transit: int = 0  # ... not: the connection failed first
    reset_results: int = 0  # finished, dropped by POST /v1/reset before they were collected
    reset_unfinished: int = 0  # unfinished, dropped by a reset (its prompt is issued again)
    preempted_results: int = 0  # finished, lost with the worker when it was preempted
    preempted_unfinished: int = 0  # unfinished when the worker was preempted
    requests: int = 0  # HTTP requests answered
    pulls: int = 0  # versions pulled
    pull_errors: int = 0

    def add(self, other: Counts) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


def make_ps_client(
    urls: tuple[str, ...], order: tuple[int, ...], token: str, worker_id: str
) -> Any:
    """The weight client of a worker that tries replicas ``order`` (its home first, then where
    it fails over, as `rlax run` passes ``--ps-url`` and ``--ps-failover``). Shared memory and
    delta pulls are off: every byte goes over TCP, through the replica's egress limit, and each
    version's bytes are new (the fake trainer's are random)."""
    from rlax_tasks.paramserver.replicas import ReplicaClient

    return ReplicaClient(
        [urls[r] for r in order], 0, token, worker_id, shared_memory=False, delta=False,
        timeout_s=60.0,
    )  # fmt: skip


class _Group:
    """A group on a worker: waiting for its version, then generating until ``ends``."""

    def __init__(self, request: GroupRequest) -> None:
        self.request = request
        self.task: asyncio.Task | None = None
        self.started: float | None = None
        self.ends = 0.0
        self.lengths: list[int] = []
        self.tokens: list[np.ndarray] = []
        self.logprobs: list[np.ndarray] = []
        self.prefix: dict[int, SampleProgress] = {}  # resumed samples' records
        self.most = 0  # the most tokens a sample generates here


class SimWorker:
    """One simulated inference worker (see the module docstring)."""

    def __init__(
        self,
        host: WorkerHost,
        worker_id: str,
        order: tuple[int, ...],
        slow: bool,
        joined: float,
    ) -> None:
        self.host, self.worker_id, self.slow = host, worker_id, slow
        self.order, self.home = order, order[0]  # the replicas it tries, home first
        self.settings = host.settings
        self.rng = np.random.default_rng(
            [self.settings.seed, int.from_bytes(worker_id.encode()[-8:].rjust(8, b"\0"), "big")]
        )
        self.held: int | None = None
        self.arrivals: list[tuple[int, float]] = []  # (version, when it was held)
        self._change_t: list[float] = []  # when each held version arrived (for token tags)
        self._change_v: list[int] = []
        self._changed = asyncio.Event()
        self._ready = asyncio.Event()
        self.groups: dict[str, _Group] = {}
        # finished groups (when each finished, its JSON) until the controller takes them
        self.results: collections.deque[tuple[float, dict[str, Any]]] = collections.deque()
        self.waits: list[float] = []  # seconds each handed-over group waited here ...
        self.waits_for_poll: list[float] = []  # ... of them before the controller asked
        self.counts = Counts()
        self.routes: collections.Counter[str] = collections.Counter()  # requests by path
        # a results reply being written: when it was asked for, when its groups finished
        self._taken: dict[int, tuple[float, list[float]]] = {}
        self.history: dict[str, list[tuple[float, str]]] = collections.defaultdict(list)
        self.joined, self.killed = joined, None
        self.endpoint = Endpoint(self._handle, self._sent)
        self._stop = threading.Event()
        self._puller = threading.Thread(target=self._pull_loop, name=f"pull-{worker_id}",
                                        daemon=True)  # fmt: skip

    async def start(self, pull: bool = True) -> str:
        """Listens (and with ``pull``, starts pulling weights); its URL."""
        url = await self.endpoint.start()
        if pull:
            self.start_pulling()
        return url

    def start_pulling(self) -> None:
        if not self._puller.is_alive() and self.killed is None:
            self._puller.start()

    def kill(self) -> None:
        """Preempted: stops answering at once; what it held is lost (counted)."""
        self.killed = time.monotonic()
        self.endpoint.close()
        self._stop.set()
        self.counts.preempted_results += len(self.results)
        self.counts.preempted_unfinished += len(self.groups)
        self._note("lost: preempted")
        self._drop_all()

    def _note(self, event: str) -> None:
        """Records ``event`` for every group this worker holds."""
        now = time.monotonic()
        for pid in [*self.groups, *(r["prompt_id"] for _, r in self.results)]:
            self.history[pid].append((now, event))

    def _drop_all(self) -> None:
        for g in self.groups.values():
            if g.task is not None:
                g.task.cancel()
        self.groups.clear()
        self.results.clear()

    # ------------------------------------------------------------------ weights
    def _pull_loop(self) -> None:
        """Pulls each newer version (reload rule j: held + j) with the real client, acks it."""
        s = self.settings
        client = make_ps_client(s.ps_urls, self.order, s.token, self.worker_id)
        held: int | None = None
        try:
            client.register()
        except (OSError, RuntimeError) as e:
            log.info("worker %s: register failed (%s)", self.worker_id, e)
        while not self._stop.is_set():
            want = None if held is None else held + s.reload_every
            try:
                version, params = client.pull(min_version=want, timeout_s=PULL_WAIT_S)
            except TimeoutError:
                continue
            except Exception as e:  # ServerUnavailableError on every replica, a refusal, a bug
                self.counts.pull_errors += 1
                level = logging.INFO if isinstance(e, OSError | RuntimeError) else logging.ERROR
                log.log(level, "worker %s: pull failed (%r)", self.worker_id, e)
                self._stop.wait(RETRY_S)
                continue
            when = time.monotonic()
            del params
            if self._stop.is_set():  # preempted while pulling: never held
                break
            held = version
            self.counts.pulls += 1
            self.host.loop.call_soon_threadsafe(self._hold, version, when)
            try:
                client.ack(version)
            except (OSError, RuntimeError) as e:
                log.debug("worker %s: ack failed (%s)", self.worker_id, e)
        client.close()

    def _hold(self, version: int, when: float) -> None:
        if self.killed is not None:
            return
        self.held = version
        self.arrivals.append((version, when))
        self._change_t.append(when)
        self._change_v.append(version)
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def _versions_at(self, times: np.ndarray) -> list[int]:
        idx = np.searchsorted(np.asarray(self._change_t), times, side="right") - 1
        return np.asarray(self._change_v)[np.maximum(idx, 0)].tolist()

    # ------------------------------------------------------------------ generation
    async def _generate(self, g: _Group) -> None:
        s, req = self.settings, g.request
        while self.held is None or self.held < req.min_version:  # reloads first (docs/design.md §3)
            await self._changed.wait()
        drawn = self.rng.integers(s.tokens_min, s.tokens_max + 1, req.group_size)
        g.lengths = [int(min(x, req.params.max_new_tokens)) for x in drawn]
        g.prefix = {r.sample: r for r in req.resume}
        for i, r in g.prefix.items():  # a resumed sample goes on from its tokens
            n = len(r.tokens)
            g.lengths[i] = n if r.finish_reason else max(g.lengths[i], n + 1)
        g.tokens = [self.rng.integers(3, VOCAB, m, dtype=np.int32) for m in g.lengths]
        g.logprobs = [-np.abs(self.rng.standard_normal(m, dtype=np.float32)) for m in g.lengths]
        g.most = max(self._new_tokens(g, i) for i in range(req.group_size))
        scale = s.gen_median_s * (s.slow_factor if self.slow else 1.0)
        seconds = float(scale * np.exp(s.gen_sigma * self.rng.standard_normal()))
        seconds *= max(g.most, 1) / max(g.lengths)  # resumed tokens are not generated again
        g.started = time.monotonic()
        g.ends = g.started + seconds
        await asyncio.sleep(seconds)
        del self.groups[req.prompt_id]
        self.results.append((time.monotonic(), self._result(g).to_dict()))
        self.counts.generated += 1
        self._ready.set()

    @staticmethod
    def _new_tokens(g: _Group, i: int) -> int:
        """Tokens sample ``i`` generates here (its length less a resumed record's)."""
        record = g.prefix.get(i)
        return g.lengths[i] - (0 if record is None else len(record.tokens))

    def _sample(self, g: _Group, i: int, now: float | None) -> tuple[list, list, list, int]:
        """(tokens, log-probs, versions, resumed count) of sample ``i`` at ``now`` (None: the
        whole sample). Every sample gains a token per decode step (continuous batching), so
        the longest ends with the group; each token carries the version held when it came."""
        record = g.prefix.get(i)
        done = 0 if record is None else len(record.tokens)
        count = self._new_tokens(g, i)
        assert g.started is not None
        rate = max(g.most, 1) / max(g.ends - g.started, 1e-9)  # tokens per second per sample
        upto = count if now is None else min(count, int((now - g.started) * rate))
        times = g.started + (np.arange(upto) + 1) / rate
        versions = self._versions_at(times) if upto else []
        tokens = g.tokens[i][done : done + upto].tolist()
        logprobs = g.logprobs[i][done : done + upto].tolist()
        if record is not None:
            first = versions[0] if versions else self.held or 0
            versions = list(record.versions or [first] * done) + versions
            tokens, logprobs = list(record.tokens) + tokens, list(record.logprobs) + logprobs
        return tokens, logprobs, versions, done

    def _result(self, g: _Group) -> GroupResult:
        req = g.request
        completions = []
        for i in range(req.group_size):
            tokens, logprobs, versions, resumed = self._sample(g, i, None)
            record = g.prefix.get(i)
            reason = "length" if len(tokens) >= req.params.max_new_tokens else "eos"
            if record is not None and record.finish_reason:
                reason = record.finish_reason
            request = Request(req.prompt_tokens, req.params, i, (req.prompt_id, i))
            completions.append(
                Completion(request, tokens, logprobs, reason, None, versions, resumed)
            )
        oldest = min(min(c.versions) for c in completions)
        seconds = g.ends - (g.started or g.ends)
        return GroupResult(req.prompt_id, oldest, req.prompt_tokens, completions, None, seconds)

    # ------------------------------------------------------------------ the worker API
    async def _handle(
        self, method: str, path: str, query: dict[str, str], headers: dict[str, str], body: bytes
    ) -> tuple[int, Any]:
        self.counts.requests += 1
        self.routes[path] += 1
        try:
            check_bearer(headers.get("authorization"), self.settings.token)
        except AuthError as e:
            return e.status, {"detail": e.message}
        if method == "GET" and path == "/v1/results":
            return await self._results(query)
        if method == "POST" and path == "/v1/groups":
            return self._submit(body)
        if method == "GET" and path == "/v1/progress":
            return 200, {"groups": self._progress()}
        if method == "POST" and path == "/v1/reset":
            dropped = len(self.groups) + len(self.results)
            self.counts.reset_results += len(self.results)
            self.counts.reset_unfinished += len(self.groups)
            self._note("dropped: reset")
            self._drop_all()
            return 200, {"dropped": dropped}
        if method == "GET" and path in ("/healthz", "/v1/status"):
            return 200, {"status": "ok", "version": self.held, "in_flight": len(self.groups),
                         "ready": len(self.results)}  # fmt: skip
        return 404, {"detail": f"no route {method} {path}"}

    def _submit(self, body: bytes) -> tuple[int, Any]:
        import json

        try:
            groups = check_groups(json.loads(body).get("groups"))
            for g in groups:
                if g.prompt_id in self.groups:
                    raise ValueError(f"prompt_id {g.prompt_id!r} is already in flight")
        except (ValueError, TypeError, AttributeError) as e:
            return 400, {"detail": str(e)}
        for request in groups:
            self.history[request.prompt_id].append((time.monotonic(), "submitted"))
            g = self.groups[request.prompt_id] = _Group(request)
            g.task = asyncio.ensure_future(self._generate(g))
        self.counts.submitted += len(groups)
        return 200, {"accepted": len(groups)}

    async def _results(self, query: dict[str, str]) -> tuple[int, Any]:
        try:
            wait_s = check_wait_s(query.get("wait_s", "0"))
            most = int(query.get("max_groups", MAX_GROUPS))
        except ValueError as e:
            return 422, {"detail": str(e)}
        asked = time.monotonic()
        deadline = asked + wait_s
        while not self.results and time.monotonic() < deadline and not self.host.released:
            self._ready.clear()
            try:
                await asyncio.wait_for(self._ready.wait(), deadline - time.monotonic())
            except TimeoutError:
                break
        taken = [self.results.popleft() for _ in range(min(most, len(self.results)))]
        for _, r in taken:
            self.history[r["prompt_id"]].append((time.monotonic(), "handed over"))
        self.counts.popped += len(taken)
        reply = {"results": [r for _, r in taken]}
        self._taken[id(reply)] = (asked, [t for t, _ in taken])
        return 200, reply

    def _sent(self, reply: Any, written: bool) -> None:
        taken = self._taken.pop(id(reply), None)
        if taken is None:
            return
        asked, finished = taken
        if not written:  # the controller's poll went away first: these groups are lost
            self.counts.lost_in_transit += len(finished)
            return
        now = time.monotonic()
        self.counts.delivered += len(finished)
        self.waits.extend(now - t for t in finished)
        self.waits_for_poll.extend(max(0.0, asked - t) for t in finished)

    def _progress(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        out = []
        for prompt_id, g in self.groups.items():
            if g.started is None:
                continue
            samples = []
            for i in range(g.request.group_size):
                tokens, logprobs, versions, _ = self._sample(g, i, now)
                if tokens:
                    samples.append(
                        SampleProgress(i, tuple(tokens), tuple(logprobs), tuple(versions)).to_dict()
                    )
            out.append({"prompt_id": prompt_id, "samples": samples})
        return out


class WorkerHost:
    """The simulated workers of one process, on its asyncio loop."""

    def __init__(self, settings: WorkerSettings, loop: asyncio.AbstractEventLoop) -> None:
        self.settings, self.loop = settings, loop
        self.workers: dict[str, SimWorker] = {}
        self.released = False  # long polls answered at once (the controller is stopping)

    def release(self) -> None:
        """Answers every open long poll now, and every later one at once."""
        self.released = True
        for w in self.workers.values():
            w._ready.set()

    async def spawn(
        self, specs: list[tuple[str, tuple[int, ...], bool]], pull: bool = True
    ) -> dict[str, str]:
        """Starts workers (id, the replicas it tries with its home first, slow), pulling
        weights unless not ``pull`` (then ``pull_all`` starts them together); returns their
        URLs."""
        now = time.monotonic()
        out = {}
        for worker_id, order, slow in specs:
            w = self.workers[worker_id] = SimWorker(self, worker_id, order, slow, now)
            out[worker_id] = await w.start(pull)
        return out

    def pull_all(self) -> int:
        """Every worker pulls weights from now on (the first version, all at once)."""
        for w in self.workers.values():
            w.start_pulling()
        return len(self.workers)

    def kill(self, worker_ids: list[str]) -> int:
        n = 0
        for worker_id in worker_ids:
            w = self.workers.get(worker_id)
            if w is not None and w.killed is None:
                w.kill()
                n += 1
        return n

    def stats(self) -> dict[str, Any]:
        """Live workers, the versions they hold, the summed counts."""
        live = [w for w in self.workers.values() if w.killed is None]
        held = collections.Counter(w.held for w in live)
        total = Counts()
        for w in self.workers.values():
            total.add(w.counts)
        return {
            "live": len(live),
            "held": {str(k): v for k, v in held.items()},
            "counts": dataclasses.asdict(total),
            "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        }

    def find(self, prompt_ids: list[str]) -> dict[str, Any]:
        """Where each prompt is on this host's workers (generating, waiting for a version,
        finished and not taken) and how those workers are."""
        out: dict[str, Any] = {}
        for w in self.workers.values():
            for pid in prompt_ids:
                if pid in w.history:
                    out.setdefault(f"{pid} history", []).append(
                        {"worker": w.worker_id, "events": w.history[pid]}
                    )
                state = None
                if pid in w.groups:
                    state = "generating" if w.groups[pid].started else "waiting for a version"
                elif any(r.get("prompt_id") == pid for _, r in w.results):
                    state = "finished, not taken"
                if state:
                    out[pid] = {"worker": w.worker_id, "state": state, "held": w.held,
                                "killed": w.killed is not None, "slow": w.slow}  # fmt: skip
        return out

    def report(self) -> dict[str, Any]:
        """``stats`` plus each worker's arrivals and lifetime, and the groups still held."""
        out = self.stats()
        out["undelivered"] = sum(len(w.results) for w in self.workers.values() if not w.killed)
        out["unfinished"] = sum(len(w.groups) for w in self.workers.values() if not w.killed)
        routes: collections.Counter[str] = collections.Counter()
        for w in self.workers.values():
            routes.update(w.routes)
        out["requests"] = dict(routes)  # requests the workers answered, by path
        out["waits"] = [x for w in self.workers.values() for x in w.waits]
        out["waits_for_poll"] = [x for w in self.workers.values() for x in w.waits_for_poll]
        out["workers"] = {
            w.worker_id: {
                "joined": w.joined,
                "killed": w.killed,
                "home": w.home,
                "slow": w.slow,
                "arrivals": w.arrivals,
            }
            for w in self.workers.values()
        }
        return out


def host_main(conn: Any, settings: WorkerSettings) -> None:
    """A worker host process: answers the simulation's commands on ``conn`` (spawn, pull,
    kill, release, stats, report, stop) while its workers run."""
    threading.stack_size(512 * 1024)  # a few hundred pull threads
    # the client (it loads JAX) before "ready", not in the first pull's thread
    import rlax_tasks.paramserver.replicas  # noqa: F401

    try:
        import uvloop

        loop = uvloop.new_event_loop()
    except ImportError:
        loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    host = WorkerHost(settings, loop)

    def stop() -> Any:
        reply = host.report()
        for w in host.workers.values():
            if w.killed is None:
                w.endpoint.close()
                w._stop.set()
        loop.call_soon(loop.stop)
        return reply

    commands = {
        "find": host.find, "release": host.release, "pull": host.pull_all, "kill": host.kill,
        "stats": host.stats, "report": host.report, "stop": stop,
    }  # fmt: skip

    async def answer(command: str, args: tuple) -> None:
        if command == "spawn":
            reply: Any = await host.spawn(*args)
        elif command in commands:
            reply = commands[command](*args)
        else:
            reply = ValueError(f"unknown command {command!r}")
        conn.send(reply)

    def on_command() -> None:
        try:
            command, args = conn.recv()
        except EOFError:  # the simulation went away
            loop.stop()
            return
        asyncio.ensure_future(answer(command, args))

    loop.add_reader(conn.fileno(), on_command)
    conn.send("ready")
    loop.run_forever()
