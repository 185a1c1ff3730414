"""What a caller asks the sampler for (a prompt and its sampling settings) and what comes back,
and the group messages between the controller and an inference worker with their JSON encoding
(importable without JAX: the controller and its service use them)."""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, get_args

from rlax_tasks.rollout.routes import RoutedExperts, array_of, record_of

if TYPE_CHECKING:
    import numpy as np

FinishReason = Literal["eos", "stop", "length"]


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request generation settings; ``validate`` names the bad field.

    temperature 0 means greedy; ``top_k`` 0 and ``top_p`` 1.0 switch those filters off. The stop set
    is the model's EOS ids (unless ``ignore_eos``) plus ``stop_token_ids``; the first stop token or
    stop string ends the completion and is kept in it."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False

    def validate(self, vocab_size: int) -> None:
        """Raises ValueError naming the first invalid field."""
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {self.max_new_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or not 0 <= t < vocab_size:
                raise ValueError(f"stop_token_ids: {t!r} is not a token id in [0, {vocab_size})")
        for s in self.stop_strings:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop_strings: {s!r} must be a non-empty string")

    @property
    def filtering(self) -> bool:
        """Whether top-k/top-p change anything (greedy ignores them)."""
        return self.temperature > 0 and (self.top_k > 0 or self.top_p < 1.0)


@dataclasses.dataclass(frozen=True)
class Request:
    """One completion to generate: ``sample_index`` separates the n samples of one prompt.
    ``keep_cache``: when it ends on a stop id its slot keeps the KV cache for a next turn (an
    episode's, docs/design.md §15); ``continues``: the id of such a turn, whose cached prefix
    this request's prompt extends (only the rest is prefilled while that cache is kept)."""

    prompt: tuple[int, ...]
    params: SamplingParams = SamplingParams()
    sample_index: int = 0
    request_id: Any = None
    keep_cache: bool = False
    continues: Any = None

    @classmethod
    def make(
        cls,
        prompt: Sequence[int],
        params: SamplingParams | None = None,
        sample_index: int = 0,
        request_id: Any = None,
    ) -> Request:
        tokens = tuple(int(t) for t in prompt)
        return cls(tokens, params or SamplingParams(), sample_index, request_id)


@dataclasses.dataclass
class Completion:
    """A finished request: generated ``tokens`` (prompt excluded), the log-prob of each under the
    distribution it was sampled from, and why it ended. ``support``: for a request whose top-k/
    top-p filtered (and a sampler recording them), each token's kept ids, in id order
    (empty where more were kept than the sampler's capacity); None otherwise. ``versions``: the
    weight version each token was sampled with (None: the sampler's weights carry none).
    ``resumed``: how many of its first tokens came from a ``SampleProgress`` record.
    ``routed_experts``: a mixture-of-experts sampler's experts each token was routed to when
    it was fed back, [len(tokens), L, k] int16, -1 where it never was (the last token, or one
    handed back from a record); None for a dense model."""

    request: Request
    tokens: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    support: list[list[int]] | None = None
    versions: list[int] | None = None
    resumed: int = 0  # its first tokens, handed back from a record (not sampled again)
    routed_experts: np.ndarray | None = None
    prefilled: int = 0  # tokens its admission prefilled (a continued turn: only the new ones)
    # an episode (docs/design.md §15): 1 for the model's tokens, 0 for observations (no
    # log-prob, never trained on); its environment's reward; its turns and tool counters
    mask: list[int] | None = None
    reward: float | None = None
    episode: dict[str, Any] | None = None

    @property
    def prompt(self) -> tuple[int, ...]:
        return self.request.prompt


@dataclasses.dataclass
class Partial:
    """A request interrupted mid-generation (``Sampler.interrupt``): what it generated so far,
    as a Completion holds it; admitted again, it continues from there."""

    request: Request
    tokens: list[int]
    logprobs: list[float]
    support: list[list[int]] | None
    versions: list[int] | None
    routed_experts: np.ndarray | None = None


def prompt_seeds(seed: int, count: int) -> list[int]:
    """One seed per prompt, derived from ``seed`` and the prompt's index.

    A seed is per request, so prompts given one shared seed would share their random streams: an
    evaluation over many prompts needs a seed per prompt for its samples to be independent."""
    return [zlib.crc32(f"{int(seed)}:{i}".encode()) & 0x7FFFFFFF for i in range(count)]


def per_prompt_params(seed: int, count: int, **settings: Any) -> list[SamplingParams]:
    """``count`` SamplingParams with ``settings``, each with its own seed (``prompt_seeds``):
    what a caller passes as ``Sampler.generate(params=...)`` for independent samples."""
    return [SamplingParams(seed=s, **settings) for s in prompt_seeds(seed, count)]


# --------------------------------------------------------------------------- worker messages
FINISH_REASONS: tuple[str, ...] = get_args(FinishReason)


@dataclasses.dataclass(frozen=True)
class SampleProgress:
    """What one sample of an in-flight group holds so far (a worker's report, a snapshot's
    record): its tokens with their log-probs, versions and kept ids, and ``finish_reason`` once
    it ended (None: unfinished). Handed back in ``GroupRequest.resume``, generation goes on from
    there instead of sampling these tokens again."""

    sample: int
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[int, ...] | None = None
    support: tuple[tuple[int, ...], ...] | None = None
    finish_reason: FinishReason | None = None
    routed_experts: RoutedExperts | None = None
    # an episode's: the loss mask of its tokens and its state (``rollout.episodes``)
    mask: tuple[int, ...] | None = None
    episode: Mapping[str, Any] | None = None

    @classmethod
    def of(cls, sample: int, c: Completion | Partial) -> SampleProgress:
        """The record of a finished completion or an unfinished ``Partial``."""
        return cls(
            sample,
            tuple(c.tokens),
            tuple(c.logprobs),
            None if c.versions is None else tuple(c.versions),
            None if c.support is None else tuple(tuple(k) for k in c.support),
            c.finish_reason if isinstance(c, Completion) else None,
            record_of(c.routed_experts),
        )

    def completion(self, request: Request, resumed: int) -> Completion:
        """The finished completion this record holds (``finish_reason`` set)."""
        assert self.finish_reason is not None
        support = None if self.support is None else [list(k) for k in self.support]
        versions = None if self.versions is None else list(self.versions)
        tokens, logprobs = list(self.tokens), list(self.logprobs)
        return Completion(
            request,
            tokens,
            logprobs,
            self.finish_reason,
            support,
            versions,
            resumed=resumed,
            routed_experts=array_of(self.routed_experts),
        )

    def partial(self, request: Request) -> Partial:
        """The unfinished request this record holds, to be admitted again."""
        support = None if self.support is None else [list(k) for k in self.support]
        versions = None if self.versions is None else list(self.versions)
        return Partial(request, list(self.tokens), list(self.logprobs), support, versions,
                       array_of(self.routed_experts))  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        return {
            "sample": self.sample,
            "tokens": list(self.tokens),
            "logprobs": list(self.logprobs),
            "versions": None if self.versions is None else list(self.versions),
            "support": None if self.support is None else [list(k) for k in self.support],
            "finish_reason": self.finish_reason,
            **(
                {}
                if self.routed_experts is None
                else {"routed_experts": self.routed_experts.to_json()}
            ),  # fmt: skip
            **({} if self.mask is None else {"mask": list(self.mask)}),
            **({} if self.episode is None else {"episode": dict(self.episode)}),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any], group_size: int, max_new_tokens: int) -> SampleProgress:
        """From JSON (``to_dict``), checked against the group it resumes: ValueError naming
        the sample and the field."""
        if not isinstance(d, dict):
            raise ValueError(f"resume: each entry must be an object, got {d!r}")
        known = {"sample", "tokens", "logprobs", "versions", "support", "finish_reason",
                 "routed_experts", "mask", "episode"}  # fmt: skip
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"resume: unknown field(s) {sorted(unknown)}")
        sample = d.get("sample")
        if not isinstance(sample, int) or not 0 <= sample < group_size:
            raise ValueError(f"resume: sample must be an int in [0, {group_size}), got {sample!r}")
        where = f"resume sample {sample}"
        tokens, logprobs = d.get("tokens"), d.get("logprobs")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise ValueError(f"{where}: tokens must be a list of token ids")
        if not isinstance(logprobs, list) or len(logprobs) != len(tokens):
            raise ValueError(f"{where}: logprobs must be a list as long as tokens")
        if not all(isinstance(x, int | float) and math.isfinite(x) for x in logprobs):
            raise ValueError(f"{where}: logprobs must be finite numbers")
        versions, support = d.get("versions"), d.get("support")
        if versions is not None and (
            not isinstance(versions, list)
            or len(versions) != len(tokens)
            or not all(isinstance(v, int) and v >= 0 for v in versions)
        ):
            raise ValueError(f"{where}: versions must be one int >= 0 per token, or null")
        if support is not None and (
            not isinstance(support, list)
            or len(support) != len(tokens)
            or not all(isinstance(k, list) for k in support)
        ):
            raise ValueError(f"{where}: support must be one list of ids per token, or null")
        reason = d.get("finish_reason")
        if reason is not None and reason not in FINISH_REASONS:
            raise ValueError(f"{where}: finish_reason must be one of {FINISH_REASONS} or null")
        mask, episode = d.get("mask"), d.get("episode")
        if mask is not None and (
            not isinstance(mask, list) or len(mask) != len(tokens) or set(mask) - {0, 1}
        ):
            raise ValueError(f"{where}: mask must be one 0 or 1 per token, or null")
        if episode is not None and not isinstance(episode, dict):
            raise ValueError(f"{where}: episode must be an object, or null")
        # (an episode's budget is its environment's, not one turn's)
        if episode is None and reason is None and len(tokens) >= max_new_tokens:
            raise ValueError(
                f"{where}: an unfinished sample holds {len(tokens)} tokens, the group's "
                f"max_new_tokens is {max_new_tokens}"
            )
        if episode is None and reason is not None and not 0 < len(tokens) <= max_new_tokens:
            raise ValueError(f"{where}: a finished sample holds 1 to max_new_tokens tokens")
        routes = d.get("routed_experts")
        return cls(
            sample,
            tuple(tokens),
            tuple(float(x) for x in logprobs),
            None if versions is None else tuple(versions),
            None if support is None else tuple(tuple(int(i) for i in k) for k in support),
            reason,
            None if routes is None else RoutedExperts.from_json(routes, len(tokens), where),
            None if mask is None else tuple(mask),
            episode,
        )


@dataclasses.dataclass(frozen=True)
class GroupRequest:
    """G completions of one prompt, wanted by the controller under ``prompt_id``."""

    prompt_id: str
    prompt_tokens: tuple[int, ...]
    group_size: int
    params: SamplingParams = SamplingParams()
    # the oldest weight version allowed to generate it: the controller's staleness bound made
    # concrete (v_next − k), so a worker behind it reloads first instead of producing waste
    min_version: int = 0
    # what the group's samples held when they were last recorded (a snapshot, a failed worker's
    # last report): the worker goes on from there instead of generating those tokens again
    resume: tuple[SampleProgress, ...] = ()
    # an episode group (docs/design.md §15): its environment (``EnvironmentSpec.to_dict``) and
    # the dataset row it resets from; the worker renders the prompt from them
    environment: Mapping[str, Any] | None = None
    row: Mapping[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON the controller sends to ``POST /v1/groups`` (``from_dict`` reads it back)."""
        return {
            "prompt_id": self.prompt_id,
            "prompt_tokens": list(self.prompt_tokens),
            "group_size": self.group_size,
            "min_version": self.min_version,
            "params": {
                k: list(v) if isinstance(v, tuple) else v for k, v in vars(self.params).items()
            },
            **({"resume": [s.to_dict() for s in self.resume]} if self.resume else {}),
            **({} if self.environment is None
               else {"environment": dict(self.environment), "row": dict(self.row or {})}),
        }  # fmt: skip

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GroupRequest:
        """From JSON: prompt_id, prompt_tokens, group_size, params (SamplingParams fields)."""
        known = {"prompt_id", "prompt_tokens", "group_size", "params", "min_version", "resume",
                 "environment", "row"}  # fmt: skip
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown group request field(s): {sorted(unknown)}")
        for key in ("prompt_id", "prompt_tokens", "group_size"):
            if key not in d:
                raise ValueError(f"group request is missing {key!r}")
        raw = dict(d.get("params") or {})
        fields = {f.name for f in dataclasses.fields(SamplingParams)}
        if set(raw) - fields:
            raise ValueError(f"unknown sampling parameter(s): {sorted(set(raw) - fields)}")
        for key in ("stop_token_ids", "stop_strings"):
            if key in raw:
                raw[key] = tuple(raw[key])
        group_size = d["group_size"]
        if not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size must be a positive int, got {group_size!r}")
        min_version = d.get("min_version", 0)
        if not isinstance(min_version, int) or min_version < 0:
            raise ValueError(f"min_version must be an int >= 0, got {min_version!r}")
        params = SamplingParams(**raw)
        raw_resume = d.get("resume") or []
        if not isinstance(raw_resume, list):
            raise ValueError("resume must be a list of sample records")
        resume = tuple(
            SampleProgress.from_dict(r, group_size, params.max_new_tokens) for r in raw_resume
        )
        samples = [r.sample for r in resume]
        if len(set(samples)) != len(samples):
            raise ValueError(f"resume: a sample appears twice ({sorted(samples)})")
        environment, row = d.get("environment"), d.get("row")
        if environment is not None and not isinstance(environment, dict):
            raise ValueError("environment must be an object (name, max_turns, ...)")
        if row is not None and not isinstance(row, dict):
            raise ValueError("row must be an object (the dataset row an episode resets from)")
        return cls(
            str(d["prompt_id"]),
            tuple(int(t) for t in d["prompt_tokens"]),
            group_size,
            params,
            min_version,
            resume,
            environment,
            row,
        )


@dataclasses.dataclass
class GroupResult:
    """A finished group; ``version``: the oldest weights any of its tokens was sampled with
    (each completion's ``versions`` holds every token's, when the worker records them)."""

    prompt_id: str
    version: int
    prompt_tokens: tuple[int, ...]
    completions: list[Completion]
    texts: list[str] | None
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        """The JSON a worker answers ``GET /v1/results`` with (``from_dict`` reads it back)."""
        return {
            "prompt_id": self.prompt_id,
            "version": self.version,
            "prompt_tokens": list(self.prompt_tokens),
            "completions": [
                {
                    "tokens": c.tokens,
                    "logprobs": c.logprobs,
                    "finish_reason": c.finish_reason,
                    **({"text": self.texts[i]} if self.texts is not None else {}),
                    **({"support": c.support} if c.support is not None else {}),
                    **({"versions": c.versions} if c.versions is not None else {}),
                    **({"resumed": c.resumed} if c.resumed else {}),
                    **(
                        {}
                        if c.routed_experts is None
                        else {"routed_experts": RoutedExperts.of(c.routed_experts).to_json()}
                    ),
                    **({} if c.mask is None else {"mask": c.mask}),
                    **({} if c.reward is None else {"reward": c.reward}),
                    **({} if c.episode is None else {"episode": c.episode}),
                }  # fmt: skip
                for i, c in enumerate(self.completions)
            ],
            "seconds": self.seconds,
        }

    @classmethod
    def from_dict(cls, r: dict[str, Any]) -> GroupResult:
        """From a worker's JSON: each completion's request is rebuilt from the prompt (default
        sampling settings, ``request_id`` = (prompt_id, sample index)); a missing text is "".

        Raises:
            ValueError: the JSON is not a group result (``check_result_json`` names the field).
        """
        check_result_json(r)
        prompt = tuple(r["prompt_tokens"])
        completions = [
            Completion(
                Request(prompt, SamplingParams(), sample_index=i, request_id=(r["prompt_id"], i)),
                list(c["tokens"]),
                list(c["logprobs"]),
                c["finish_reason"],
                None if c.get("support") is None else [list(ids) for ids in c["support"]],
                None if c.get("versions") is None else [int(v) for v in c["versions"]],
                int(c.get("resumed", 0)),
                _routes_from_json(c, f"{r['prompt_id']} completion {i}"),
                mask=None if c.get("mask") is None else [int(m) for m in c["mask"]],
                reward=None if c.get("reward") is None else float(c["reward"]),
                episode=c.get("episode"),
            )
            for i, c in enumerate(r["completions"])
        ]
        texts = [c.get("text", "") for c in r["completions"]]
        return cls(r["prompt_id"], int(r["version"]), prompt, completions, texts, r["seconds"])


def _int_list(value: Any, low: int = 0) -> bool:
    return isinstance(value, list) and all(
        isinstance(x, int) and not isinstance(x, bool) and x >= low for x in value
    )


def check_result_json(r: Any) -> None:
    """ValueError naming the field when ``r`` is not a group result's JSON (``to_dict``'s
    shape): what a controller checks before it takes a worker's answer."""
    if not isinstance(r, dict):
        raise ValueError(f"a result must be an object, got {type(r).__name__}")
    pid = r.get("prompt_id")
    if not isinstance(pid, str) or not pid:
        raise ValueError(f"prompt_id must be a non-empty string, got {str(pid)[:64]!r}")
    where = f"result {pid[:64]!r}"
    version = r.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise ValueError(f"{where}: version must be an int >= 0, got {str(version)[:32]!r}")
    if not _int_list(r.get("prompt_tokens")):
        raise ValueError(f"{where}: prompt_tokens must be a list of token ids")
    if not isinstance(r.get("seconds"), int | float):
        raise ValueError(f"{where}: seconds must be a number")
    completions = r.get("completions")
    if not isinstance(completions, list) or not completions:
        raise ValueError(f"{where}: completions must be a non-empty list")
    for i, c in enumerate(completions):
        at = f"{where} completion {i}"
        if not isinstance(c, dict):
            raise ValueError(f"{at}: must be an object")
        tokens, logprobs = c.get("tokens"), c.get("logprobs")
        if not _int_list(tokens):
            raise ValueError(f"{at}: tokens must be a list of token ids")
        if not isinstance(logprobs, list) or len(logprobs) != len(tokens):
            raise ValueError(f"{at}: logprobs must be a list as long as tokens")
        if not all(
            isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)
            for x in logprobs
        ):
            raise ValueError(f"{at}: logprobs must be finite numbers")
        if c.get("finish_reason") not in FINISH_REASONS:
            raise ValueError(f"{at}: finish_reason must be one of {FINISH_REASONS}")
        for name in ("versions", "mask"):
            value = c.get(name)
            if value is not None and (not _int_list(value) or len(value) != len(tokens)):
                raise ValueError(f"{at}: {name} must be one int >= 0 per token, or null")


def _routes_from_json(c: dict[str, Any], where: str) -> np.ndarray | None:
    """A wire completion's routed experts as an array (None when it carries none)."""
    routes = c.get("routed_experts")
    if routes is None:
        return None
    return RoutedExperts.from_json(routes, len(c["tokens"]), where).array().copy()
