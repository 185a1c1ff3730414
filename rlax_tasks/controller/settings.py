"""The controller's decision parameters, derived from a ``RunConfig``.

The run config's schema owns every default they share: each such field's default is read from
the config's section (or the default preset's objective), never written here again."""

from __future__ import annotations

import dataclasses

from rlax_tasks.algorithms.config import preset_config
from rlax_tasks.config import AlgorithmSettings, RunConfig, StalenessSettings, WorkerSettings
from rlax_tasks.rollout.requests import SamplingParams

# the objective a config that names no preset trains with
_DEFAULT_OBJECTIVE = preset_config(AlgorithmSettings.preset)


@dataclasses.dataclass(frozen=True)
class ControllerSettings:
    """The decision parameters of the controller (``from_run_config`` builds them for a run)."""

    prompts_per_step: int
    group_size: int
    sampling: SamplingParams
    # groups kept in flight per worker (the config derives it from the workers' slots)
    groups_per_worker: int
    reload_every: int = StalenessSettings.reload_every
    max_staleness: int | None = StalenessSettings.max_staleness
    dynamic_sampling: bool = _DEFAULT_OBJECTIVE.dynamic_sampling
    overlong_cache_len: int | None = None  # DAPO overlong shaping when set
    overlong_factor: float = _DEFAULT_OBJECTIVE.overlong_factor
    max_outstanding_groups: int = 0  # 0 = prompts_per_step
    worker_timeout_s: float = WorkerSettings.timeout_s
    worker_retry_s: float = 5.0  # longest wait before a failed worker is tried again
    seed: int = RunConfig.seed
    # longest prompt a worker can take (workers.max_len - rollout.max_new_tokens); longer ones
    # are skipped and counted, never sent (None: no limit)
    max_prompt_tokens: int | None = None
    # scoring jobs in flight on threads beside the controller's (0: score in its own thread)
    scoring_threads: int = 0

    @classmethod
    def from_run_config(cls, cfg: RunConfig) -> ControllerSettings:
        """The settings of the run ``cfg`` describes (a run scores on one thread of its own)."""
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
