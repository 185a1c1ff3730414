"""Rollout generation: the KV-cache sampler with continuous batching, and the inference worker."""

from rlax_tasks.rollout.requests import (
    Completion,
    Request,
    SamplingParams,
    per_prompt_params,
    prompt_seeds,
)
from rlax_tasks.rollout.sampler import Sampler

__all__ = [
    "Completion",
    "Request",
    "Sampler",
    "SamplingParams",
    "per_prompt_params",
    "prompt_seeds",
]
