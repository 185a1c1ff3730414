"""Rollout generation: the KV-cache sampler with continuous batching, and the inference worker."""

from __future__ import annotations

from rlax_tasks.utils.lazy_exports import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "Completion": ".requests",
        "GroupRequest": ".requests",
        "GroupResult": ".requests",
        "Request": ".requests",
        "Sampler": ".sampler",
        "SamplingParams": ".requests",
        "per_prompt_params": ".requests",
        "prompt_seeds": ".requests",
    },
)
