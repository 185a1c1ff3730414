"""Multi-turn episodes over a Sampler (docs/design.md §15): each turn is a sampler request that
ends on the chat template's end-of-turn id; the environment's ``step`` runs on a thread of its
own (the slot leaves the batch meanwhile); its observation is rendered through the same
template and the next turn continues behind the kept KV cache, prefilling only the new tokens.

An episode is one token sequence after its prompt: model tokens with their log-probs and
versions (mask 1), observation tokens with mask 0 and log-prob 0. ``record`` is what a
snapshot holds of an unfinished episode; ``start(..., resume=record)`` goes on from it without
generating a token again or running a turn's step twice (a step that was in flight at the kill
becomes an observation saying its result was lost)."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rlax_tasks.environments import EnvironmentSpec, StepResult, make_environment
from rlax_tasks.environments.render import ChatRenderer, truncate_observation
from rlax_tasks.rollout.requests import (
    Completion,
    Partial,
    Request,
    SampleProgress,
    SamplingParams,
)

log = logging.getLogger(__name__)

TURN = "turn"  # request ids of episode turns: (TURN, key, turn index)
STAT_KEYS = ("tool_calls", "valid_calls", "tool_errors", "tool_seconds", "step_timeouts")
LOST_STEP = "The result of this call was lost when the run was interrupted; it was not run again."


@dataclasses.dataclass
class _Step:
    """An environment step running on its own thread."""

    started: float
    thread: threading.Thread
    result: StepResult | None = None
    error: str | None = None


@dataclasses.dataclass
class Episode:
    """One episode in flight: what it holds so far and what it waits on."""

    key: Any
    spec: EnvironmentSpec
    env: Any
    renderer: ChatRenderer
    params: SamplingParams
    history: list[dict]
    prompt: tuple[int, ...]
    tokens: list[int] = dataclasses.field(default_factory=list)
    mask: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    turns: int = 0  # complete turns (model turn and its observation)
    turn_start: int = 0  # where the current turn's model tokens begin in ``tokens``
    turn_text: str | None = None  # the model's last turn, its step in flight or lost
    step: _Step | None = None
    last_request: Any = None
    reward: float = 0.0
    finish_reason: str | None = None
    resumed: int = 0  # tokens handed back from a record (not generated again)
    stats: dict[str, float] = dataclasses.field(default_factory=lambda: dict.fromkeys(STAT_KEYS, 0))

    def record(self) -> SampleProgress:
        """What a snapshot holds: every token so far and the state to resume from."""
        return SampleProgress(
            self.key[1] if isinstance(self.key, tuple) else 0,
            tuple(self.tokens),
            tuple(self.logprobs),
            tuple(self.versions),
            None,
            None,
            mask=tuple(self.mask),
            episode=self.state(),
        )

    def state(self) -> dict[str, Any]:
        return {
            "turns": self.turns,
            "turn_start": self.turn_start,
            "awaiting": self.turn_text is not None,
            "history": self.history,
            "reward": self.reward,
            "stats": dict(self.stats),
        }

    def completion(self, request: Request) -> Completion:
        """The finished episode as a completion (its tokens after the prompt)."""
        assert self.finish_reason is not None
        masked = len(self.mask) - sum(self.mask)
        return Completion(
            request,
            list(self.tokens),
            list(self.logprobs),
            self.finish_reason,  # type: ignore[arg-type]
            None,
            list(self.versions),
            resumed=self.resumed,
            mask=list(self.mask),
            reward=float(self.reward),
            episode={**self.state(), "masked_tokens": masked},
        )


class EpisodeDriver:
    """Runs episodes on ``sampler``: ``start`` one, hand it the sampler's finished turns
    (``on_turn``), ``poll`` between steps; finished episodes come back from ``poll``.
    ``wake``: called from a step's thread when it ends (the worker stops waiting)."""

    def __init__(self, sampler: Any, wake: Callable[[], None] | None = None) -> None:
        self.sampler = sampler
        self.tokenizer = sampler.policy.tokenizer
        if self.tokenizer is None:
            raise ValueError("episodes render through a tokenizer; the policy has none")
        self.wake = wake or (lambda: None)
        self.episodes: dict[Any, Episode] = {}
        self._renderers: dict[str, ChatRenderer] = {}
        self.generated = 0  # model tokens sampled by the turns (not those handed back)
        self._handed: dict[Any, int] = {}  # a resumed turn's tokens, handed to the sampler

    # ------------------------------------------------------------------ episodes
    def initial_prompt(self, spec: EnvironmentSpec, row: Mapping[str, Any]) -> tuple[int, ...]:
        """The tokens an episode of ``spec`` on ``row`` starts from (its first messages)."""
        env = make_environment(spec)
        return tuple(self._renderer(spec, env).initial_tokens(env.reset(dict(row))))

    def start(
        self,
        key: Any,
        spec: EnvironmentSpec,
        row: Mapping[str, Any],
        params: SamplingParams,
        resume: SampleProgress | None = None,
    ) -> None:
        """Starts an episode (``resume``: from a record of it)."""
        env = make_environment(spec)
        history = env.reset(dict(row))
        renderer = self._renderer(spec, env)
        prompt = tuple(renderer.initial_tokens(history))
        ep = Episode(key, spec, env, renderer, params, list(history), prompt)
        self.episodes[key] = ep
        if resume is not None and resume.tokens:
            self._restore(ep, resume)
            if ep.finish_reason is not None or ep.step is not None:
                return
            if ep.turn_text is not None:  # its step was in flight: never run again
                ep.turn_text, text = None, ep.turn_text
                lost = [{"role": "tool", "name": "error", "content": LOST_STEP}]
                self._observe(ep, text, StepResult(tuple(lost), False, 0.0, {}))
                return
            partial = len(ep.tokens) - ep.turn_start
            if partial:  # a turn cut mid-way: it goes on from its tokens
                self._continue_turn(ep)
                return
        self._next_turn(ep)

    def _restore(self, ep: Episode, record: SampleProgress) -> None:
        state = dict(record.episode or {})
        ep.tokens, ep.logprobs = list(record.tokens), list(record.logprobs)
        ep.resumed = len(record.tokens)
        ep.versions = list(record.versions or [0] * len(record.tokens))
        ep.mask = list(record.mask or [1] * len(record.tokens))
        ep.turns = int(state.get("turns", 0))
        ep.turn_start = int(state.get("turn_start", len(ep.tokens)))
        ep.history = list(state.get("history") or ep.history)
        ep.reward = float(state.get("reward") or 0.0)
        ep.stats.update({k: float(v) for k, v in (state.get("stats") or {}).items()})
        if record.finish_reason is not None:
            ep.finish_reason = record.finish_reason
        elif state.get("awaiting"):
            ep.turn_text = self._turn_text(ep)

    def drop(self, key: Any) -> None:
        """Forgets an episode (its group was reset); a step in flight ends unheard."""
        ep = self.episodes.pop(key, None)
        if ep is not None and ep.last_request is not None:
            self.sampler.release(ep.last_request)

    def records(self, in_progress: Sequence[Partial] = ()) -> dict[Any, SampleProgress]:
        """Each unfinished episode's record (``Episode.record``), with the tokens of a turn
        still generating (``in_progress``: the sampler's) as far as they go."""
        turns = {p.request.request_id[1]: p for p in in_progress if _is_turn(p.request)}
        out = {}
        for key, ep in self.episodes.items():
            record, p = ep.record(), turns.get(key)
            if p is not None and p.tokens:
                record = dataclasses.replace(
                    record,
                    tokens=record.tokens + tuple(p.tokens),
                    logprobs=record.logprobs + tuple(p.logprobs),
                    versions=record.versions + tuple(p.versions or [0] * len(p.tokens)),
                    mask=record.mask + (1,) * len(p.tokens),
                )
            out[key] = record
        return out

    @property
    def waiting_on_steps(self) -> int:
        return sum(ep.step is not None for ep in self.episodes.values())

    # ------------------------------------------------------------------ turns
    def owns(self, item: Completion | Partial) -> bool:
        """Whether ``item`` (a sampler's completion or partial) is one of this driver's turns."""
        return _is_turn(item.request)

    def on_turn(self, c: Completion) -> None:
        """A finished model turn: its tokens join the episode and its step starts."""
        ep = self.episodes.get(c.request.request_id[1])
        if ep is None:  # dropped while in flight
            self.sampler.release(c.request.request_id)
            return
        # (a turn continued from a record or an interrupt: the completion holds it all)
        self.generated += len(c.tokens) - self._handed.pop(ep.key, 0)
        ep.tokens += c.tokens
        ep.logprobs += c.logprobs
        ep.versions += c.versions or [self.sampler.version or 0] * len(c.tokens)
        ep.mask += [1] * len(c.tokens)
        ep.last_request = c.request.request_id
        if c.finish_reason == "length" or c.tokens[-1] not in ep.renderer.end_of_turn_ids():
            self._finish(ep, "length")  # the model never ended its turn: no answer to score
            return
        ep.turn_text = self._turn_text(ep)
        self._start_step(ep)

    def _turn_text(self, ep: Episode) -> str:
        return self.tokenizer.decode(ep.tokens[ep.turn_start :], skip_special_tokens=True)

    def _start_step(self, ep: Episode) -> None:
        text = ep.turn_text
        assert text is not None
        step = _Step(time.monotonic(), None)  # type: ignore[arg-type]

        def run() -> None:
            try:
                step.result = ep.env.step(text)
            except Exception as e:  # noqa: BLE001 - a user's environment: an observation
                step.error = f"{type(e).__name__}: {e}"
            self.wake()

        step.thread = threading.Thread(target=run, name="rlax-env-step", daemon=True)
        ep.step = step
        step.thread.start()

    def poll(self) -> list[Episode]:
        """Handles the steps that ended (or ran out of time); returns the episodes that
        finished (``Episode.completion`` makes each one's completion)."""
        finished = []
        now = time.monotonic()
        for ep in list(self.episodes.values()):
            step = ep.step
            if step is None:
                if ep.finish_reason is not None:
                    finished.append(ep)
                continue
            timed_out = now - step.started > ep.spec.tool_timeout_s
            if step.thread.is_alive() and not timed_out:
                continue
            ep.step = None
            ep.stats["tool_seconds"] += min(now - step.started, ep.spec.tool_timeout_s)
            text, ep.turn_text = ep.turn_text or "", None
            if step.result is not None:
                result = step.result
            else:
                if timed_out and step.thread.is_alive():
                    ep.stats["step_timeouts"] += 1
                    why = f"the tool call did not finish in {ep.spec.tool_timeout_s:g}s"
                else:
                    why = f"the tool call failed: {step.error}"
                ep.stats["tool_errors"] += 1
                msg = {"role": "tool", "name": "error", "content": why}
                result = StepResult((msg,), False, 0.0, {})
            self._observe(ep, text, result)
            if ep.finish_reason is not None:
                finished.append(ep)
        for ep in finished:
            del self.episodes[ep.key]
            if ep.last_request is not None:
                self.sampler.release(ep.last_request)
        return finished

    def _observe(self, ep: Episode, turn_text: str, result: StepResult) -> None:
        """A step's result: the episode ends, or its observation joins it and the next turn
        is queued."""
        for k in STAT_KEYS:
            if k in result.info and k != "tool_seconds":
                ep.stats[k] += float(result.info[k])
        ep.reward = float(result.reward)
        ep.turns += 1
        if result.done or ep.turns >= ep.spec.max_turns:
            self._finish(ep, "stop")
            return
        messages = [_capped(m, ep.spec.max_observation_tokens) for m in result.messages]
        obs = ep.renderer.observation_tokens(ep.history, turn_text, messages)
        obs = truncate_observation(obs, ep.spec.max_observation_tokens, self.tokenizer)
        ep.history += [{"role": "assistant", "content": turn_text}, *messages]
        if len(ep.prompt) + len(ep.tokens) + len(obs) + 1 > self._budget(ep):
            self._finish(ep, "length")  # no room left for another turn
            return
        ep.tokens += obs
        ep.logprobs += [0.0] * len(obs)
        ep.mask += [0] * len(obs)
        ep.versions += [ep.versions[-1] if ep.versions else 0] * len(obs)
        ep.turn_start = len(ep.tokens)
        self._next_turn(ep)

    def _budget(self, ep: Episode) -> int:
        """The most tokens (prompt included) the episode may reach."""
        top = self.sampler.max_len
        if ep.spec.max_tokens is not None:
            top = min(top, len(ep.prompt) + ep.spec.max_tokens)
        return top

    def _finish(self, ep: Episode, reason: str) -> None:
        ep.finish_reason = reason

    def _turn_params(self, ep: Episode, generated: int = 0) -> SamplingParams:
        room = self._budget(ep) - len(ep.prompt) - ep.turn_start
        stops = tuple(dict.fromkeys((*ep.params.stop_token_ids, *ep.renderer.end_of_turn_ids())))
        seed = zlib.crc32(f"{ep.params.seed}:{ep.turns}".encode()) & 0x7FFFFFFF
        return dataclasses.replace(
            ep.params, max_new_tokens=max(1, min(ep.params.max_new_tokens, room)),
            stop_token_ids=stops, seed=seed,
        )  # fmt: skip

    def _request(self, ep: Episode) -> Request:
        sample = ep.key[1] if isinstance(ep.key, tuple) else 0
        return Request(
            ep.prompt + tuple(ep.tokens[: ep.turn_start]),
            self._turn_params(ep),
            sample_index=sample,
            request_id=(TURN, ep.key, ep.turns),
            keep_cache=True,
            continues=ep.last_request,
        )

    def _next_turn(self, ep: Episode) -> None:
        if self._budget(ep) - len(ep.prompt) - len(ep.tokens) < 2:
            self._finish(ep, "length")
            return
        self.sampler.add_request(self._request(ep))

    def _continue_turn(self, ep: Episode) -> None:
        """A turn resumed mid-way: its tokens so far are prefilled and it draws on."""
        request = self._request(ep)
        n = ep.turn_start
        self.sampler.add_partial(
            Partial(request, ep.tokens[n:], ep.logprobs[n:], None, ep.versions[n:])
        )
        # the turn's tokens are the sampler's again until it ends (handed back by on_turn)
        self._handed[ep.key] = len(ep.tokens) - n
        del ep.tokens[n:], ep.logprobs[n:], ep.versions[n:], ep.mask[n:]

    def _renderer(self, spec: EnvironmentSpec, env: Any) -> ChatRenderer:
        key = repr(env.tools)
        if key not in self._renderers:
            self._renderers[key] = ChatRenderer(self.tokenizer, list(env.tools) or None)
        return self._renderers[key]


def episode_prompt(
    tokenizer: Any, spec: EnvironmentSpec, row: Mapping[str, Any]
) -> tuple[int, ...]:
    """The tokens an episode of ``spec`` on ``row`` starts from: its environment's first
    messages (and tools) through ``tokenizer``'s chat template."""
    env = make_environment(spec)
    renderer = ChatRenderer(tokenizer, list(env.tools) or None)
    return tuple(renderer.initial_tokens(env.reset(dict(row))))


def _is_turn(request: Request) -> bool:
    rid = request.request_id
    return isinstance(rid, tuple) and len(rid) == 3 and rid[0] == TURN


# characters per token an observation keeps before it is tokenized and cut to its token limit
# (a tool that prints megabytes costs no more than this to render)
CHARS_PER_TOKEN = 16


def _capped(message: Mapping[str, Any], max_tokens: int) -> dict[str, Any]:
    """``message`` with content longer than ``max_tokens`` × CHARS_PER_TOKEN characters cut
    (the exact cut, in tokens, is ``truncate_observation``'s)."""
    out = dict(message)
    content, limit = out.get("content"), max_tokens * CHARS_PER_TOKEN
    if isinstance(content, str) and len(content) > limit:
        out["content"] = content[:limit] + f"\n[... {len(content) - limit} characters cut ...]"
    return out


def run_episodes(
    sampler: Any,
    spec: EnvironmentSpec,
    rows: Sequence[Mapping[str, Any]],
    n: int,
    params: Sequence[SamplingParams],
    on_done: Callable[[Completion], None] | None = None,
) -> list[list[Completion]]:
    """``n`` episodes of every row to their end on ``sampler`` (an evaluation's: the same
    environment and renderer as training), row-major; ``params``: one per row (its seed)."""
    if len(params) != len(rows):
        raise ValueError(f"got {len(params)} SamplingParams for {len(rows)} rows")
    driver = EpisodeDriver(sampler)
    for i, row in enumerate(rows):
        for j in range(n):
            driver.start((i, j), spec, row, params[i])
    done: dict[Any, Completion] = {}
    while driver.episodes:
        for c in sampler.step() if sampler.has_unfinished else []:
            driver.on_turn(c)
        for ep in driver.poll():
            i, j = ep.key
            request = Request(ep.prompt, params[i], sample_index=j, request_id=ep.key)
            done[ep.key] = ep.completion(request)
            if on_done is not None:
                on_done(done[ep.key])
        if driver.episodes and not sampler.has_unfinished:
            time.sleep(0.001)  # every episode waits on its step
    return [[done[(i, j)] for j in range(n)] for i in range(len(rows))]
