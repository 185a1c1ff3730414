"""The controller's decision parameters, derived from a ``RunConfig``."""

from __future__ import annotations

import dataclasses

from rlax_tasks.config import RunConfig
from rlax_tasks.rollout.requests import SamplingParams


@dataclasses.dataclass(frozen=True)
class ControllerSettings:
    """The decision parameters of the controller."""

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
