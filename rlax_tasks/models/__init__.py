"""Policy model: a Flax transformer for the Llama / Qwen2 / Qwen3 families with HF load/save."""

from __future__ import annotations

from rlax_tasks.utils.lazy_exports import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "CheckpointError": ".hf_io",
        "LogProbOptions": ".logprob_options",
        "ModelConfig": ".config",
        "ModelConfigError": ".config",
        "Policy": ".policy",
        "load_pretrained": ".policy",
        "make_mesh": ".sharding",
    },
)
