"""The prompt mixture: weighted draws over several datasets with reproducible, saveable state.
A file's rows come from ``rlax_tasks.data.prompt_source``; this module only samples them.

The dataset of each draw comes from one PCG64 stream; within a dataset a cursor walks a
per-epoch permutation of (seed, dataset, epoch). Prompt ids are ``<dataset>/<epoch>/<index>``;
``state_dict()`` is plain JSON, and after ``load_state_dict`` the draws continue exactly."""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rlax_tasks.config import DatasetSpec, SyntheticSource
from rlax_tasks.data.compact import compact_answer, compact_prompt
from rlax_tasks.data.prompt_source import FilePrompts, PromptSource, episode_row
from rlax_tasks.rewards.tasks import make_task

STATE_FORMAT = 1


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One drawn prompt: stable ``id``, draw number ``seq``, ``content`` (the problem: text, or
    chat messages) and what scores a response (``reference``: an answer, or a code test suite
    as JSON)."""

    id: str
    seq: int
    dataset: str
    index: int
    epoch: int
    content: str | list[dict[str, str]]
    reference: str
    verifier: str  # "task" (the synthetic task's scorer), "math" or "code"
    # the dataset's environment (``EnvironmentSpec.to_dict``): the prompt is an episode's
    environment: Mapping[str, Any] | None = None

    def episode_row(self) -> dict[str, Any]:
        """The row an episode resets from: the prompt and what scores it (an answer, or a
        code test suite as JSON under "tests")."""
        return episode_row(self.content, self.reference, self.verifier)


class SyntheticPrompts:
    """The first ``size`` problems of a synthetic task's stream (generated once, on first use)."""

    def __init__(self, spec: SyntheticSource) -> None:
        self.spec = spec
        self.task = make_task(spec.task, **dict(spec.knobs))
        self._problems: list | None = None

    def _load(self) -> list:
        if self._problems is None:
            problems = self.task.generate(self.spec.size, seed=self.spec.seed)
            if self.spec.exclude_seed is not None and self.spec.exclude_size:
                held = self.task.generate(self.spec.exclude_size, seed=self.spec.exclude_seed)
                seen = {(p.prompt, p.reference) for p in held}
                problems = [p for p in problems if (p.prompt, p.reference) not in seen]
                if not problems:
                    raise ValueError(
                        f"synthetic task {self.spec.task}: every problem is excluded by "
                        f"exclude_seed={self.spec.exclude_seed}"
                    )
            self._problems = problems
        return self._problems

    def __len__(self) -> int:
        return len(self._load())

    def get(self, index: int) -> tuple[str, str]:
        p = self._load()[index]
        if self.spec.prompt_format == "compact":
            return compact_prompt(p), compact_answer(p)
        return p.prompt, p.reference


def make_source(spec: DatasetSpec) -> PromptSource:
    """The prompt source of a dataset spec: a synthetic task's stream, or a file's rows read by
    ``rlax_tasks.data`` (docs/design.md §11)."""
    if isinstance(spec.source, SyntheticSource):
        return SyntheticPrompts(spec.source)
    return FilePrompts(spec.source)


@dataclasses.dataclass(frozen=True)
class MixtureComponent:
    """A named prompt source with its mixture weight and verifier kind."""

    name: str
    weight: float
    source: PromptSource
    verifier: str = "task"
    environment: Mapping[str, Any] | None = None  # its prompts are episodes (docs/design.md §15)


@dataclasses.dataclass
class _Cursor:
    epoch: int = 0
    position: int = 0


class PromptMixture:
    """Draws prompts from weighted datasets; ``state_dict``/``load_state_dict`` round-trip."""

    def __init__(self, components: Sequence[MixtureComponent], seed: int = 0) -> None:
        if not components:
            raise ValueError("a prompt mixture needs at least one dataset")
        names = [c.name for c in components]
        if len(set(names)) != len(names):
            raise ValueError(f"dataset names must be unique, got {names}")
        for c in components:
            if not c.weight > 0:
                raise ValueError(f"dataset {c.name!r}: weight must be > 0, got {c.weight}")
            if len(c.source) == 0:
                raise ValueError(f"dataset {c.name!r} has no prompts")
        self.components = list(components)
        self.seed = int(seed)
        weights = np.array([c.weight for c in components], dtype=np.float64)
        self._cdf = np.cumsum(weights / weights.sum())
        self._by_name = {c.name: i for i, c in enumerate(components)}
        self._rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, 0])))
        self._cursors = [_Cursor() for _ in components]
        self._perm_cache: dict[int, tuple[int, np.ndarray]] = {}
        self.draws = 0

    @classmethod
    def from_specs(cls, specs: Sequence[DatasetSpec], seed: int = 0) -> PromptMixture:
        """The mixture of a run configuration's ``datasets``."""
        return cls(
            [
                MixtureComponent(
                    s.name,
                    s.weight,
                    make_source(s),
                    s.verifier,
                    None if s.environment is None else s.environment.to_dict(),
                )  # fmt: skip
                for s in specs
            ],
            seed,
        )

    # ------------------------------------------------------------------ drawing
    def _permutation(self, i: int, epoch: int) -> np.ndarray:
        cached = self._perm_cache.get(i)
        if cached is not None and cached[0] == epoch:
            return cached[1]
        name_key = zlib.crc32(self.components[i].name.encode())
        rng = np.random.Generator(
            np.random.PCG64(np.random.SeedSequence([self.seed, 1, name_key, epoch]))
        )
        perm = rng.permutation(len(self.components[i].source))
        self._perm_cache[i] = (epoch, perm)
        return perm

    def next(self) -> Prompt:
        """The next prompt of the stream."""
        i = int(np.searchsorted(self._cdf, self._rng.random(), side="right"))
        i = min(i, len(self.components) - 1)
        cursor = self._cursors[i]
        index = int(self._permutation(i, cursor.epoch)[cursor.position])
        prompt = self._make(i, index, cursor.epoch, self.draws)
        cursor.position += 1
        if cursor.position == len(self.components[i].source):
            cursor.epoch, cursor.position = cursor.epoch + 1, 0
        self.draws += 1
        return prompt

    def take(self, n: int) -> list[Prompt]:
        return [self.next() for _ in range(n)]

    def _make(self, i: int, index: int, epoch: int, seq: int) -> Prompt:
        c = self.components[i]
        text, reference = c.source.get(index)
        return Prompt(
            f"{c.name}/{epoch}/{index}",
            seq,
            c.name,
            index,
            epoch,
            text,
            reference,
            c.verifier,
            c.environment,
        )

    def prompt(self, prompt_id: str, seq: int) -> Prompt:
        """Re-materializes a drawn prompt from its id (to re-issue it after a restart)."""
        try:
            name, epoch, index = prompt_id.rsplit("/", 2)
            i, epoch_n, index_n = self._by_name[name], int(epoch), int(index)
        except (KeyError, ValueError):
            raise ValueError(
                f"prompt id {prompt_id!r} does not belong to this mixture "
                f"(datasets: {', '.join(self._by_name)})"
            ) from None
        if not 0 <= index_n < len(self.components[i].source):
            raise ValueError(f"prompt id {prompt_id!r}: index out of range for dataset {name!r}")
        return self._make(i, index_n, epoch_n, seq)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Plain-JSON state: RNG stream, per-dataset cursors, number of draws."""
        bg = self._rng.bit_generator.state
        return {
            "format": STATE_FORMAT,
            "seed": self.seed,
            "draws": self.draws,
            "rng": {
                "bit_generator": bg["bit_generator"],
                "state": hex(bg["state"]["state"]),
                "inc": hex(bg["state"]["inc"]),
                "has_uint32": int(bg["has_uint32"]),
                "uinteger": int(bg["uinteger"]),
            },
            "datasets": [
                {"name": c.name, "size": len(c.source), "epoch": k.epoch, "position": k.position}
                for c, k in zip(self.components, self._cursors, strict=True)
            ],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores ``state_dict()`` output; a different dataset list is an error naming it."""
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"mixture state format {state.get('format')!r} is not {STATE_FORMAT}")
        if state["seed"] != self.seed:
            raise ValueError(
                f"mixture state is for seed {state['seed']}, this mixture has {self.seed}"
            )
        saved = [(d["name"], d["size"]) for d in state["datasets"]]
        mine = [(c.name, len(c.source)) for c in self.components]
        if saved != mine:
            raise ValueError(
                f"mixture state is for datasets {saved} (name, size), this mixture has {mine}: "
                f"resume with the run's own configuration"
            )
        rng = state["rng"]
        self._rng.bit_generator.state = {
            "bit_generator": rng["bit_generator"],
            "state": {"state": int(rng["state"], 16), "inc": int(rng["inc"], 16)},
            "has_uint32": rng["has_uint32"],
            "uinteger": rng["uinteger"],
        }
        self._cursors = [_Cursor(d["epoch"], d["position"]) for d in state["datasets"]]
        self.draws = int(state["draws"])
