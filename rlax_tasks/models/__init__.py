"""Policy model: a Flax transformer for the Llama / Qwen2 / Qwen3 families with HF load/save."""

from rlax_tasks.models.config import ModelConfig, ModelConfigError
from rlax_tasks.models.hf_io import CheckpointError
from rlax_tasks.models.policy import Policy, load_pretrained
from rlax_tasks.models.sharding import make_mesh

__all__ = [
    "CheckpointError",
    "ModelConfig",
    "ModelConfigError",
    "Policy",
    "load_pretrained",
    "make_mesh",
]
