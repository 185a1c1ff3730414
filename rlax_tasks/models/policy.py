"""The policy: model config + parameters (+ tokenizer), loaded from and saved to HF format.

The one object trainer, sampler and evaluation share: thin jitted wrappers around
``rlax_tasks.models.forward``, with parameters an ``nnx.State`` pytree (optax, Orbax and the
parameter server handle it directly)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from rlax_tasks.models import forward, hf_io
from rlax_tasks.models.config import ModelConfig
from rlax_tasks.models.logprob_options import DEFAULT_LOGPROBS, LogProbOptions
from rlax_tasks.models.model_cache import local_model_dir
from rlax_tasks.models.sharding import BATCH, fit_spec, param_shardings, param_spec, rlax_mesh
from rlax_tasks.models.tokenizer_loading import load_tokenizer
from rlax_tasks.models.transformer import Transformer, resolve_dtype

log = logging.getLogger(__name__)


@functools.cache
def abstract_model(
    config: ModelConfig, dtype: str, param_dtype: str | None = None
) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, abstract params) of a model computing in ``dtype`` with parameters stored in
    ``param_dtype`` (default: ``dtype``), without allocating any weights."""
    model = nnx.eval_shape(lambda: Transformer(config, dtype, nnx.Rngs(0), param_dtype))
    return nnx.split(model, nnx.Param)


@functools.partial(jax.jit, static_argnums=0)
def _logits(graphdef, params, input_ids, attention_mask):  # noqa: ANN001, ANN202
    return forward.logits(graphdef, params, input_ids, attention_mask)


@functools.partial(jax.jit, static_argnums=(0, 4))
def _token_logprobs(graphdef, params, input_ids, attention_mask, options):  # noqa: ANN001, ANN202
    return forward.token_logprobs(graphdef, params, input_ids, attention_mask, options)


@dataclasses.dataclass
class Policy:
    """A decoder-only LM: ``config``, ``params`` (nnx.State), ``tokenizer``, optional ``mesh``.

    ``dtype`` is the compute dtype; ``param_dtype`` the dtype the parameters are stored in (a
    trainer's float32 master weights under bfloat16 compute; a worker holds ``dtype`` only).
    """

    config: ModelConfig
    graphdef: nnx.GraphDef
    params: nnx.State
    dtype: str = "float32"
    tokenizer: Any = None
    mesh: Mesh | None = None
    # keys of the source config.json we do not model (kept on save)
    extra_hf_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    # the source generation_config.json (kept on save); its eos_token_id also ends generation
    generation_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    # None: the same as dtype
    param_dtype: str | None = None

    def __post_init__(self) -> None:
        if self.param_dtype is None:
            self.param_dtype = self.dtype

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Token ids that end a completion: config.json's and generation_config.json's EOS
        (instruct checkpoints list their end-of-turn token only in the latter)."""
        extra = hf_io.token_ids(self.generation_config.get("eos_token_id"), hf_io.GENERATION_CONFIG)
        return tuple(dict.fromkeys((*self.config.eos_token_ids, *extra)))

    @classmethod
    def init(
        cls,
        config: ModelConfig,
        dtype: str = "float32",
        seed: int = 0,
        tokenizer: Any = None,
        param_dtype: str | None = None,
    ) -> Policy:
        """A randomly initialized policy (normal(0.02) weights), for tests and warm-up runs.

        Args:
            config: the architecture.
            dtype: the compute dtype, "float32" or "bfloat16".
            seed: the weights' random seed.
            tokenizer: kept on the policy (None: none).
            param_dtype: the dtype the weights are stored in (None: ``dtype``).

        Returns:
            A policy on the default device, without a mesh.
        """
        resolve_dtype(dtype)
        model = Transformer(config, dtype, nnx.Rngs(seed), param_dtype)
        graphdef, params = nnx.split(model, nnx.Param)
        return cls(
            config, graphdef, params, dtype=dtype, tokenizer=tokenizer, param_dtype=param_dtype
        )

    # ----------------------------------------------------------------------- computation
    def _scope(self) -> contextlib.AbstractContextManager:
        return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    def _batch(self, x: Any, dtype: Any = jnp.int32) -> jax.Array:
        x = jnp.asarray(x, dtype)
        if x.ndim != 2:
            raise ValueError(f"expected a [batch, time] array, got shape {x.shape}")
        if self.mesh is None:
            return x
        spec = fit_spec(x.shape, (BATCH, None), dict(self.mesh.shape))
        return jax.device_put(x, NamedSharding(self.mesh, spec))

    def _inputs(self, input_ids: Any, attention_mask: Any) -> tuple[jax.Array, jax.Array]:
        """Validated ids and mask (all ones when None), placed on the mesh when there is one."""
        ids = np.asarray(input_ids)
        if ids.size and (ids.min() < 0 or ids.max() >= self.config.vocab_size):
            raise ValueError(
                f"input_ids must lie in [0, {self.config.vocab_size}); "
                f"got values in [{ids.min()}, {ids.max()}]"
            )
        batch = self._batch(ids)
        mask = self._batch(np.ones(batch.shape) if attention_mask is None else attention_mask)
        return batch, mask

    def logits(self, input_ids: Any, attention_mask: Any = None) -> jax.Array:
        """The model's float32 logits, jitted (on the policy's mesh when it has one).

        Args:
            input_ids: int token ids [B, T], each in [0, vocab_size).
            attention_mask: [B, T], 1 on real tokens (None: all real); left padding works.

        Returns:
            Logits [B, T, V]; rows at padding positions are meaningless.
        """
        ids, mask = self._inputs(input_ids, attention_mask)
        with self._scope():
            return _logits(self.graphdef, self.params, ids, mask)

    def token_logprobs(
        self,
        input_ids: Any,
        attention_mask: Any = None,
        options: LogProbOptions = DEFAULT_LOGPROBS,
    ) -> jax.Array:
        """log p(ids[t] | ids[<t]) per token, jitted, chunk by chunk over positions
        (``forward.token_logprobs``).

        Args:
            input_ids: int token ids [B, T], each in [0, vocab_size).
            attention_mask: [B, T], 1 on real tokens (None: all real).
            options: the pass's static settings (e.g. ``LogProbOptions(chunk_size=4)``).

        Returns:
            Log-probs [B, T], 0 at t=0.
        """
        ids, mask = self._inputs(input_ids, attention_mask)
        with self._scope():
            return _token_logprobs(self.graphdef, self.params, ids, mask, options)

    # ----------------------------------------------------------------------- placement
    def shard(self, mesh: Mesh) -> Policy:
        """The same policy with its parameters laid out over a mesh.

        Args:
            mesh: a mesh over RLAX's axes (data, fsdp, expert, tensor; see ``make_mesh``).

        Returns:
            A new policy holding the sharded parameters and the mesh (this one is unchanged).
        """
        mesh = rlax_mesh(mesh)
        params = jax.device_put(self.params, param_shardings(self.params, mesh))
        return dataclasses.replace(self, params=params, mesh=mesh)

    def with_params(self, params: nnx.State) -> Policy:
        """The same policy with other weights (no recompilation).

        Args:
            params: weights of the same tree, shapes and dtypes as ``self.params``.

        Returns:
            A new policy holding ``params``.
        """
        return dataclasses.replace(self, params=params)

    def as_dtype(self, param_dtype: str) -> Policy:
        """The same policy with its parameters stored in another dtype: e.g. the bfloat16
        weights a worker holds, from a trainer's float32 master weights.

        Args:
            param_dtype: "float32" or "bfloat16".

        Returns:
            This policy when it already stores ``param_dtype``, else a cast copy.
        """
        if param_dtype == self.param_dtype:
            return self
        graphdef, _ = abstract_model(self.config, self.dtype, param_dtype)
        params = cast_params(self.params, param_dtype)
        return dataclasses.replace(self, graphdef=graphdef, params=params, param_dtype=param_dtype)

    def named_params(self) -> Iterator[tuple[str, jax.Array]]:
        """The parameters with stable dotted names, for transport and logs.

        Returns:
            An iterator of ("layers.self_attn.q_proj.kernel", array) pairs.
        """
        for path, value in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(self.params)):
            yield ".".join(str(getattr(k, "key", k)) for k in path), value

    # ----------------------------------------------------------------------- HF format
    def save_pretrained(
        self, path: str, max_shard_bytes: int = 2 * 1024**3, dtype: str | None = None
    ) -> None:
        """Writes an HF directory (config.json, safetensors, tokenizer) transformers can load.

        Args:
            path: the directory (created; its model files are replaced).
            max_shard_bytes: the largest safetensors file; more weights go to several files
                and an index.
            dtype: the tensors' dtype on disk (None: the dtype the parameters are stored in).
        """
        dtype = dtype or self.param_dtype
        resolve_dtype(dtype)
        hf_io.write_hf(path, self.config, self.params, dtype, self.extra_hf_config, max_shard_bytes)
        if self.generation_config:
            with open(os.path.join(path, hf_io.GENERATION_CONFIG), "w", encoding="utf-8") as f:
                json.dump(self.generation_config, f, indent=2, sort_keys=True)
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(path)
        log.info("saved %s policy (%s) to %s", self.config.model_type, dtype, path)


def cast_params(params: nnx.State, dtype: str) -> nnx.State:
    """``params`` with every floating-point array cast to ``dtype`` (same shardings)."""
    dt = resolve_dtype(dtype)
    return jax.tree.map(
        lambda a: a.astype(dt) if jnp.issubdtype(a.dtype, jnp.floating) else a, params
    )


def load_pretrained(
    path: str,
    dtype: str = "float32",
    mesh: Mesh | None = None,
    param_dtype: str | None = None,
) -> Policy:
    """Loads a policy from a Hugging Face model directory.

    Args:
        path: a directory holding config.json, safetensors (one file or a sharded index) and
            optionally tokenizer files; a gs:// path goes through the local model cache.
        dtype: the compute dtype, "float32" or "bfloat16".
        mesh: where to place the weights: each parameter goes straight to its sharding, never
            whole on one device (None: the default device).
        param_dtype: the dtype the weights are stored in (None: ``dtype``; a trainer passes
            "float32" master weights).

    Returns:
        The policy, with its tokenizer (None, with a warning, when the directory has none) and
        the source's unmodelled config keys and generation config, kept for ``save_pretrained``.

    Raises:
        CheckpointError: a missing, unreadable or mismatched checkpoint file.
        ModelConfigError: a config.json of an architecture or setting RLAX does not model.
        ValueError: an unsupported dtype.
    """
    resolve_dtype(dtype)
    param_dtype = param_dtype or dtype
    resolve_dtype(param_dtype)
    if path.startswith("gs://"):
        path = local_model_dir(path)
    raw = hf_io.read_hf_config(path)
    config = ModelConfig.from_hf_dict(raw)
    graphdef, abstract = abstract_model(config, dtype, param_dtype)
    place = None
    if mesh is not None:
        mesh = rlax_mesh(mesh)
        mesh_shape = dict(mesh.shape)

        def place(leaf_path: tuple[str, ...], value: np.ndarray) -> jax.Array:
            spec = fit_spec(value.shape, param_spec(leaf_path, value.shape), mesh_shape)
            # each device gets its slice only (each process only its own devices' slices)
            return jax.make_array_from_callback(
                value.shape, NamedSharding(mesh, spec), lambda index: value[index]
            )

    params = hf_io.read_params(path, jax.tree.map(lambda x: x, abstract), param_dtype, place)
    tokenizer = None
    if hf_io.has_tokenizer(path):
        tokenizer = load_tokenizer(path)
    else:
        log.warning("%s has no tokenizer files; policy.tokenizer is None", path)
    known = set(config.to_hf_dict())
    extra = {k: v for k, v in raw.items() if k not in known and k != "transformers_version"}
    generation = hf_io.read_generation_config(path)
    hf_io.token_ids(generation.get("eos_token_id"), os.path.join(path, hf_io.GENERATION_CONFIG))
    log.info(
        "loaded %s (%.1fM params, %s compute, %s weights) from %s",
        config.model_type,
        config.num_parameters() / 1e6,
        dtype,
        param_dtype,
        path,
    )
    return Policy(config, graphdef, params, dtype, tokenizer, mesh, extra, generation, param_dtype)
