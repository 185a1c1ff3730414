"""Deterministic in-process fakes of the controller's collaborators: workers, scorer, trainer.

Every output is a pure function of (prompt id, weight version, sample index), and the fake
workers follow the docs/design.md §3 reload rule (``should_reload``) each time they are polled, so a
run is reproducible from the controller's calls alone.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import zlib

from rlax_tasks.controller import (
    Controller,
    ControllerSettings,
    MixtureComponent,
    PromptMixture,
    TrainerBehindError,
)
from rlax_tasks.rewards.scoring import SampleScore
from rlax_tasks.rollout.requests import Completion, GroupResult, Request, SamplingParams
from rlax_tasks.rollout.staleness import should_reload

UNENCODABLE = "<unencodable>"  # ``encode`` refuses a prompt containing this


def _h(*parts: object) -> int:
    return zlib.crc32(":".join(map(str, parts)).encode())


class ListSource:
    """A prompt source of ``n`` synthetic prompts; ``contents`` replaces some by index."""

    def __init__(self, name: str, n: int, contents: dict[int, object] | None = None) -> None:
        self.name, self.n, self.contents = name, n, contents or {}

    def __len__(self) -> int:
        return self.n

    def get(self, index: int) -> tuple[object, str]:
        return self.contents.get(index, f"{self.name} prompt {index}"), str(index)


def mixture(
    seed: int = 0,
    sizes: dict[str, tuple[int, float]] | None = None,
    contents: dict[str, dict[int, object]] | None = None,
) -> PromptMixture:
    """Datasets name -> (size, weight); ``contents``: name -> {index: prompt} overrides."""
    sizes = sizes or {"a": (13, 2.0), "b": (7, 1.0)}
    contents = contents or {}
    return PromptMixture(
        [
            MixtureComponent(n, w, ListSource(n, size, contents.get(n)))
            for n, (size, w) in sizes.items()
        ],
        seed,
    )


def encode(content) -> list[int]:
    """One token per character (chat messages: of their contents); ValueError on UNENCODABLE."""
    text = content if isinstance(content, str) else "".join(m["content"] for m in content)
    if UNENCODABLE in text:
        raise ValueError("the chat template cannot render this prompt")
    return [1] + [3 + (ord(c) % 60) for c in text]


class FakeTrainer:
    """step(batch) -> version: counts versions and remembers what it trained on."""

    def __init__(self, version: int = 0) -> None:
        self.version = version
        self.batches: list = []
        self.replays = 0
        self.crash_after_next = False  # apply the next step, then die before answering

    def __call__(self, batch) -> int:
        if batch.version <= self.version:  # the trainer service's contract: a replay is a no-op
            self.replays += 1
            return batch.version
        if batch.version > self.version + 1:  # restarted from an older checkpoint
            raise TrainerBehindError(self.version)
        self.batches.append(batch)
        self.version += 1
        if self.crash_after_next:
            self.crash_after_next = False
            raise KeyboardInterrupt("trainer applied the step and died before answering")
        return self.version


@dataclasses.dataclass
class FakeWorker:
    held: int | None = None
    queue: list = dataclasses.field(default_factory=list)


class FakePool:
    """Workers that finish their ``rate`` oldest groups per poll, with the version they hold."""

    def __init__(self, trainer: FakeTrainer, ids=("w0", "w1"), reload_every: int = 1, rate=2):
        self.trainer, self.reload_every, self.rate = trainer, reload_every, rate
        self.workers = {w: FakeWorker() for w in ids}
        self.fail_next: set[str] = set()  # results() of these raises once
        self.refuse_next: set[str] = set()  # submit() to these raises once
        self.down: set[str] = set()  # submit() to these raises until they are removed
        self.refused: list[str] = []  # every refused submit, by worker
        self.hung: set[str] = set()  # these accept work and never return any
        # prompt id -> why: a submit holding one of these is refused whole with ValueError
        # (HTTP 400), as a real worker validates every group before queuing any
        self.invalid: dict[str, str] = {}
        self.rejected: list[tuple[str, list[str]]] = []  # submits refused with ValueError
        self.submits: list[tuple[str, list[str]]] = []
        self.resets: list[str] = []
        self.lost: list[str] = []  # what the last failed worker held
        self.lost_by_worker: dict[str, list[str]] = {}
        # completions continued across a reload: the first half of each sampled with the
        # version before the one held (when the group allows it), as an interrupting worker
        # reports per-token versions
        self.mid_sequence_reloads = False

    def worker_ids(self) -> list[str]:
        return list(self.workers)

    def submit(self, worker_id, groups) -> None:
        if worker_id in self.refuse_next or worker_id in self.down:
            self.refuse_next.discard(worker_id)
            self.refused.append(worker_id)
            raise ConnectionError(f"{worker_id} is not up yet")
        bad = [self.invalid[g.prompt_id] for g in groups if g.prompt_id in self.invalid]
        if bad:
            self.rejected.append((worker_id, [g.prompt_id for g in groups]))
            raise ValueError(bad[0])
        self.submits.append((worker_id, [g.prompt_id for g in groups]))
        self.workers[worker_id].queue.extend(groups)

    def reset(self, worker_id) -> None:
        self.resets.append(worker_id)
        self.workers[worker_id].queue.clear()

    def progress(self, worker_id):
        """Nothing in flight holds tokens: a fake group is generated whole when it is polled."""
        if worker_id in self.down:
            raise ConnectionError(f"{worker_id} is down")
        return {}

    def results(self, worker_id):
        if worker_id in self.fail_next:
            self.fail_next.discard(worker_id)
            self.lost = [g.prompt_id for g in self.workers[worker_id].queue]
            self.lost_by_worker[worker_id] = self.lost
            raise ConnectionError(f"{worker_id} is gone")
        w = self.workers[worker_id]
        if should_reload(w.held, self.trainer.version, self.reload_every):
            w.held = self.trainer.version
        if worker_id in self.hung:
            return []
        done, w.queue = w.queue[: self.rate], w.queue[self.rate :]
        return [self._result(g, w.held, self.mid_sequence_reloads) for g in done]

    @staticmethod
    def _result(g, version: int, mid_sequence: bool = False) -> GroupResult:
        comps = []
        for i in range(g.group_size):
            n = 1 + _h(g.prompt_id, version, i, g.params.seed) % 6
            tokens = [3 + _h(g.prompt_id, version, i, t) % 50 for t in range(n)]
            logprobs = [-((_h(g.prompt_id, version, i, t, "lp") % 1000) / 997.0) for t in range(n)]
            req = Request(g.prompt_tokens, g.params, i, (g.prompt_id, i))
            support = None
            if g.params.filtering:  # the ids a top-k kept: the token and others; some too many
                support = [
                    [] if _h(g.prompt_id, i, t, "wide") % 5 == 0 else [tok, 60 + t % 3]
                    for t, tok in enumerate(tokens)
                ]
            versions = None
            if mid_sequence:
                # started on the version before, if that one was new enough for the group
                started = max(version - 1, g.min_version, 0)
                versions = [started] * (n // 2) + [version] * (n - n // 2)
            comps.append(Completion(req, tokens, logprobs, "eos", support, versions))
        oldest = min(min(c.versions) for c in comps) if mid_sequence else version
        return GroupResult(g.prompt_id, oldest, g.prompt_tokens, comps, None, 0.0)


class FakeScorer:
    """Score 1 for about a third of the completions, by hash; counts failures to inject.

    ``verdicts``: scores are ``SampleScore``s ("correct", "wrong_answer", and some of the
    zeros "verifier_error"). ``gate``: each call waits until the event is set; ``delay_s``: each
    call takes that long. Every call records the thread it ran on and the prompt ids it scored.
    """

    def __init__(
        self, verdicts: bool = False, gate: threading.Event | None = None, delay_s: float = 0.0
    ) -> None:
        self.fail_next = 0
        self.calls = 0
        self.verdicts, self.gate, self.delay_s = verdicts, gate, delay_s
        self.threads: list[str] = []
        self.scored: list[list[str]] = []  # prompt ids of each call, failed ones too

    def score(self, prompts, results):
        self.calls += 1
        self.threads.append(threading.current_thread().name)
        self.scored.append([p.id for p in prompts])
        if self.gate is not None and not self.gate.wait(timeout=30):
            raise RuntimeError("the test never released the scorer")
        time.sleep(self.delay_s)
        if self.fail_next:
            self.fail_next -= 1
            raise ConnectionError("verifier down")
        return [
            [self._score(p.id, r.version, i) for i in range(len(r.completions))]
            for p, r in zip(prompts, results, strict=True)
        ]

    def _score(self, prompt_id: str, version: int, i: int):
        reward = 1.0 if _h(prompt_id, version, i) % 3 == 0 else 0.0
        if not self.verdicts:
            return reward
        if reward == 0.0 and _h(prompt_id, version, i, "broken") % 7 == 0:
            return SampleScore(0.0, "verifier_error", None, "checker crashed")
        return SampleScore(reward, "correct" if reward else "wrong_answer")


class World:
    """The fakes wired together: trainer, workers, scorer."""

    def __init__(self, reload_every: int = 2, rate: int = 3, version: int = 0, scorer=None) -> None:
        self.trainer = FakeTrainer(version)
        self.pool = FakePool(self.trainer, reload_every=reload_every, rate=rate)
        self.scorer = scorer if scorer is not None else FakeScorer()


def settings(**overrides) -> ControllerSettings:
    base = dict(
        prompts_per_step=4,
        group_size=4,
        sampling=SamplingParams(max_new_tokens=6, temperature=1.0),
        reload_every=2,
        max_staleness=2,
        dynamic_sampling=True,
        max_outstanding_groups=24,
        groups_per_worker=4,
        seed=7,
    )
    base.update(overrides)
    return ControllerSettings(**base)


def controller(run_dir: str, world: World, mix: PromptMixture | None = None, **kwargs):
    """A Controller on ``world``'s fakes; ``kwargs`` are settings() overrides, plus the
    Controller's ``encode`` (default: ``encode``), ``clock`` and ``idle_sleep_s`` (default 0)."""
    encoder = kwargs.pop("encode", encode)
    extra = {"idle_sleep_s": kwargs.pop("idle_sleep_s", 0.0)}
    if "clock" in kwargs:
        extra["clock"] = kwargs.pop("clock")
    return Controller(
        settings(**kwargs),
        mix if mix is not None else mixture(seed=3),
        world.pool,
        world.scorer,
        world.trainer,
        encoder,
        run_dir,
        **extra,
    )


def trained(tmp_path, world: World, steps: int, **kwargs) -> tuple[str, Controller]:
    """A started ``controller`` on ``world`` in ``tmp_path/run`` after ``steps`` steps."""
    run_dir = str(tmp_path / "run")
    c = controller(run_dir, world, **kwargs)
    c.start()
    c.run(steps, max_iterations=500)
    return run_dir, c
