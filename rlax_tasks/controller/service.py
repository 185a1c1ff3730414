"""The Controller wired to real components over HTTP (the command, `rlax controller`: cli.py).

Workers come from a JSON file (or slices' service files) the launcher rewrites as they come and
go; the trainer is a ``TrainerClient``; rewards come from the task's scorer, the math verifier
or the code judge. Every call carries the run's token (``RLAX_PS_TOKEN``); none: exit 2."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import threading
from collections.abc import Sequence
from typing import Any

from rlax_tasks.controller.controller import Controller
from rlax_tasks.controller.mixture import Prompt, PromptMixture, SyntheticPrompts
from rlax_tasks.controller.ports import WORKER_ERRORS, ScorerError, WorkerError
from rlax_tasks.controller.result_feeds import ResultFeeds
from rlax_tasks.controller.settings import ControllerSettings
from rlax_tasks.data.prompts import PromptRenderer
from rlax_tasks.models.model_cache import local_model_dir
from rlax_tasks.rewards.sandbox import SandboxError
from rlax_tasks.rewards.scoring import score_completions
from rlax_tasks.rewards.tasks import Problem
from rlax_tasks.rollout.requests import GroupRequest, GroupResult, SampleProgress
from rlax_tasks.rollout.service import MAX_GROUP_SIZE, PROGRESS_PATH, WorkerClient
from rlax_tasks.rundir import storage


class HttpWorkerPool:
    """The ``WorkerPool`` over the ``rlax worker`` services of a JSON file (re-read on change);
    every worker's results come back through a long poll kept open at it (``ResultFeeds``), so
    a round of the controller asks no worker anything."""

    def __init__(
        self, workers_file: str, timeout_s: float = 10.0, token: str | None = None
    ) -> None:
        # token None: RLAX_PS_TOKEN (WorkerClient reads it)
        self.workers_file, self.timeout_s, self.token = workers_file, timeout_s, token
        self._generation: int | None = None
        self._clients: dict[str, WorkerClient] = {}
        self._addresses: dict[str, str] = {}  # as the file gives them
        self._feeds: ResultFeeds | None = None  # started with the first worker
        self._lock = threading.Lock()

    def _refresh(self) -> None:
        with self._lock:  # (a snapshot asks workers from threads: one of them refreshes)
            self._refresh_locked()

    def _refresh_locked(self) -> None:
        info = storage.stat(self.workers_file)  # local or gs://
        if info is None:
            self._set_clients({}, {})
            self._generation = None
            return
        if info.generation == self._generation:
            return
        # {worker id: URL, or the service file the worker publishes its address to}
        addresses = json.loads(storage.read_bytes(self.workers_file))
        # a worker whose address is as it was keeps its client (compared as written: a file
        # rewritten at every join and leave of a large fleet must not cost a client apiece)
        clients = {
            w: self._clients[w]
            if w in self._clients and self._addresses.get(w) == a
            else WorkerClient(a, self.token, timeout_s=self.timeout_s)
            for w, a in sorted(addresses.items())
        }
        self._set_clients(clients, dict(addresses))
        self._generation = info.generation

    def _set_clients(self, clients: dict[str, WorkerClient], addresses: dict[str, str]) -> None:
        """The fleet is now ``clients``: their results polled, those of the others no more."""
        if self._feeds is None and clients:
            self._feeds = ResultFeeds()
        for w, client in self._clients.items():
            if clients.get(w) is not client and self._feeds is not None:
                self._feeds.remove(w)
        for w, client in clients.items():
            if self._clients.get(w) is not client:
                self._feeds.add(w, client)
        self._clients, self._addresses = clients, addresses

    def worker_ids(self) -> list[str]:
        self._refresh()
        return list(self._clients)

    def _client(self, worker_id: str) -> WorkerClient:
        self._refresh()
        if worker_id not in self._clients:
            raise WorkerError(f"worker {worker_id} left the fleet")
        return self._clients[worker_id]

    def submit(self, worker_id: str, groups: Sequence[GroupRequest]) -> None:
        self._client(worker_id).submit([g.to_dict() for g in groups])
        self._feeds.answered(worker_id)

    def results(self, worker_id: str) -> list[GroupResult]:
        """What the worker's long poll brought back since the last call (no request sent)."""
        self._client(worker_id)
        taken = self._feeds.take(worker_id)
        try:
            return [GroupResult.from_dict(r) for r in taken]
        except (KeyError, TypeError, ValueError) as e:  # a malformed answer: the worker failed
            raise WorkerError(f"worker {worker_id}: malformed result refused ({e})") from e

    def reset(self, worker_id: str) -> None:
        try:
            self._client(worker_id).reset()
        finally:  # what came back from it goes with the worker's work, answered or not
            if self._feeds is not None:
                self._feeds.reset(worker_id)

    @property
    def dropped_results(self) -> int:
        """Results that came back from a worker, then went with its reset or departure."""
        return 0 if self._feeds is None else self._feeds.dropped

    def close(self, wait_s: float = 0.0) -> int:
        """Stops polling the workers, waiting up to ``wait_s`` for the polls under way to end;
        returns the results that came back and were never taken."""
        return 0 if self._feeds is None else self._feeds.close(wait_s)

    def progress(self, worker_id: str) -> dict[str, list[SampleProgress]]:
        client = self._client(worker_id)
        return _progress_report(worker_id, client.progress())

    def progress_many(
        self, worker_ids: Sequence[str], deadline_s: float | None = None
    ) -> dict[str, dict[str, list[SampleProgress]] | Exception]:
        """``progress`` of every worker in ``worker_ids``, asked at once on the result feeds'
        event loop: per worker, its report or the ``WORKER_ERRORS`` error it met (``LateAnswer``
        past ``deadline_s``)."""
        self._refresh()
        calls = {
            w: (self._clients[w], PROGRESS_PATH, self._clients[w].progress_timeout_s)
            for w in worker_ids
            if w in self._clients
        }
        out: dict[str, dict[str, list[SampleProgress]] | Exception] = {
            w: WorkerError(f"worker {w} left the fleet") for w in worker_ids if w not in calls
        }
        if calls:
            answers = self._feeds.get_many(calls, deadline_s=deadline_s)
            for w, answer in answers.items():
                try:
                    if isinstance(answer, Exception):
                        raise answer
                    out[w] = _progress_report(w, self._clients[w].progress_answer(*answer))
                except WORKER_ERRORS as e:
                    out[w] = e
        return out


def _progress_report(worker_id: str, groups: Any) -> dict[str, list[SampleProgress]]:
    """A worker's progress answer ([{"prompt_id", "samples"}]) as records per prompt id;
    WorkerError when it cannot be read."""
    try:
        return {
            str(g["prompt_id"]): [
                SampleProgress.from_dict(r, MAX_GROUP_SIZE, sys.maxsize) for r in g["samples"]
            ]
            for g in groups
        }
    except (KeyError, TypeError, ValueError) as e:  # another version's worker?
        raise WorkerError(f"worker {worker_id}: unreadable progress report ({e})") from e


class RewardScorer:
    """The ``Scorer``: synthetic tasks score themselves; math answers and code test suites go to
    the verifiers (math-verify in worker processes, the bubblewrap judge with each problem's
    limits, at most ``max_parallel`` sandboxes at a time). A verifier that fails on a row scores
    it 0 with its verdict; a broken sandbox is a ``ScorerError`` (retried, never scored)."""

    # math-verify's own failure verdicts, named as verifier failures in rollouts and metrics
    MATH_FAILURES = {"error": "verifier_error", "timeout": "verifier_timeout"}

    def __init__(self, mixture: PromptMixture, max_parallel: int | None = None) -> None:
        self.tasks = {
            c.name: c.source.task
            for c in mixture.components
            if isinstance(c.source, SyntheticPrompts)
        }
        self.max_parallel = max_parallel

    def score(self, prompts: Sequence[Prompt], results: Sequence[GroupResult]) -> list[list[Any]]:
        out: list[list[Any] | None] = [None] * len(prompts)
        verify_rows = []
        for i, (p, r) in enumerate(zip(prompts, results, strict=True)):
            texts = r.texts or [""] * len(r.completions)
            if p.verifier == "task":
                task = self.tasks[p.dataset]
                problem = Problem(task.name, p.id, p.content, p.reference)
                out[i] = [float(task.score(problem, t)) for t in texts]
            else:
                verify_rows.append((i, p, texts))
        if verify_rows:
            answers = [p.reference if p.verifier == "math" else None for _, p, _ in verify_rows]
            tests = [p.reference if p.verifier == "code" else None for _, p, _ in verify_rows]
            try:
                scores = score_completions(
                    answers,
                    tests,
                    [t for _, _, t in verify_rows],
                    max_parallel=self.max_parallel,
                )
            except SandboxError as e:
                raise ScorerError(f"the code sandbox is broken: {e}") from e
            for (i, p, _), row in zip(verify_rows, scores, strict=True):
                # (the judge's "timeout" is a program over its time limit: the model's failure)
                renamed = self.MATH_FAILURES if p.verifier == "math" else {}
                out[i] = [
                    dataclasses.replace(s, verdict=renamed.get(s.verdict, s.verdict)) for s in row
                ]
        return [x if x is not None else [] for x in out]


def build_controller(
    cfg: Any, trainer_url: str, workers_file: str, token: str | None = None
) -> Controller:
    """A Controller for run config ``cfg`` wired to the trainer and the worker fleet over HTTP,
    calling them with ``token`` (None: ``RLAX_PS_TOKEN``)."""
    from rlax_tasks.trainer.service import TrainerClient  # (loads JAX: not in a colocated run)

    pool = HttpWorkerPool(workers_file, token=token)
    return make_controller(cfg, pool, TrainerClient(trainer_url, token))


def make_controller(cfg: Any, pool: Any, train_step: Any) -> Controller:
    """A Controller for run config ``cfg`` with its workers and trainer (a ``WorkerPool`` and a
    ``TrainStep``: over HTTP, or in this process in a colocated run); prompts render through
    ``cfg.prompt`` with the model's tokenizer (docs/design.md §11), rewards from
    ``RewardScorer``."""
    mixture = PromptMixture.from_specs(cfg.datasets, seed=cfg.seed)
    # the controller only tokenizes: a gs:// model.path is fetched without its weights
    model_dir = local_model_dir(cfg.model.path, weights=False)
    if not os.path.isdir(model_dir):  # else transformers would look for a hub repo id
        raise FileNotFoundError(
            f"model.path: {cfg.model.path!r} is not a directory (expected an HF model directory)"
        )
    try:
        renderer = PromptRenderer.for_model(cfg.prompt, model_dir)
    except ValueError as e:
        raise ValueError(f"model.path / prompt: {e}") from None
    return Controller(
        ControllerSettings.from_run_config(cfg),
        mixture,
        pool,
        RewardScorer(mixture),
        train_step,
        renderer.encode,
        cfg.run_dir,
    )
