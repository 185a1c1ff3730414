"""The sampler's and trainer's memory traffic against the ideal, measurable without a device:
compiles the decode step, the prefill and the train step for accelerator shapes (Qwen2.5-1.5B and
7B; 64 and 256 slots; 2k and 8k context) on this CPU and adds up the bytes each operation of the
optimized program moves (``_hlo_traffic``), against what a decode step must move at least: every
weight once, the KV cache filled so far and the logits. Prefill and the train step are
compute-bound: their products' FLOPs against the model's (prefill: 2·N per token and causal
attention; train: 6·N per token, 8·N with the old-policy pass). Decode runs with the cache full
and partly filled (``--partial-fill``, where it reads a window's entries or every entry).

Compiled in float32 throughout: XLA:CPU widens bfloat16 products to float32 (converts of every
weight and of the cache that no accelerator makes), so a bfloat16 program here measures the CPU,
not the program; in one dtype the ratio is the program's own. Nothing is allocated or run.
``.venv/bin/python benchmarks/traffic.py [--models qwen2.5-1.5b] [--json-out FILE]``"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _hlo_traffic  # noqa: E402
import _timing  # noqa: E402

log = logging.getLogger("benchmarks.traffic")
MODELS = {"qwen2.5-1.5b": "qwen2.5-math-1.5b", "qwen2.5-7b": "qwen2.5-7b"}
DTYPE = "float32"  # see the module docstring


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="qwen2.5-1.5b,qwen2.5-7b", help=f"of {sorted(MODELS)}")
    p.add_argument("--slots", default="64,256", help="decode slots (comma-separated)")
    p.add_argument("--contexts", default="2048,8192", help="tokens in the cache (comma-separated)")
    p.add_argument("--programs", default="decode,prefill,train", help="which to compile")
    p.add_argument(
        "--partial-fill",
        type=float,
        default=0.6,
        help="decode also with this fraction of the cache filled (its window's slack)",
    )
    p.add_argument("--train-batch", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--top", type=int, default=8, help="operations listed per program")
    p.add_argument("--json-out", default=None)
    return p.parse_args(argv)


def model_config(name: str) -> Any:
    from rlax_tasks.models import ModelConfig
    from rlax_tasks.plan.model_shapes import KNOWN_MODELS

    if name not in MODELS:
        raise SystemExit(f"--models: {name!r} is not one of {sorted(MODELS)}")
    return ModelConfig.from_hf_dict(
        {**KNOWN_MODELS[MODELS[name]], "max_position_embeddings": 1 << 17}
    )


def _abstract(tree: Any) -> Any:
    import jax

    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), tree)


def kv_bytes_per_token(config: Any, itemsize: int) -> int:
    """Bytes of one token's keys and values over every layer."""
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * itemsize


def decode_program(config: Any, slots: int, context: int, filled: int) -> tuple[Any, int]:
    """(compiled decode chunk of one step, ideal bytes) with ``filled`` of a ``context``-entry
    cache written: the sampler's own program (its window, ``decode_window``) and weights."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from rlax_tasks.models.kv_cache import init_cache
    from rlax_tasks.models.policy import abstract_model
    from rlax_tasks.rollout import kernels
    from rlax_tasks.rollout.held_weights import HeldWeights
    from rlax_tasks.rollout.shapes import decode_window

    graphdef, params = abstract_model(config, DTYPE, DTYPE)
    cache = jax.eval_shape(lambda: init_cache(config, slots, context, jnp.float32))
    state = _abstract(kernels.empty_state(slots, 4))
    # the layers' own copies a sampler holds (rollout/held_weights.py; the tied embedding's
    # transpose only on a CPU)
    layers = jax.eval_shape(lambda p: nnx.merge(graphdef, p).unstack_layers(), params)
    window = decode_window(filled + 1, context)
    compiled = kernels.DECODE.lower(
        graphdef, params, HeldWeights(None, layers), cache, state, 1, False, True, window,
        jnp.bool_(False), 0,
    ).compile()  # fmt: skip
    weights = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(params))
    kv = kv_bytes_per_token(config, 4)
    ideal = weights + slots * filled * kv + slots * config.vocab_size * 4
    return compiled, ideal


def prefill_program(config: Any, rows: int, prompt: int) -> tuple[Any, int]:
    """(compiled prefill of ``rows`` prompts of ``prompt`` tokens into a cache of twice that,
    the model's FLOPs: 2 per layer weight and token, the last tokens' logits, causal attention's
    two products)."""
    import jax
    import jax.numpy as jnp

    from rlax_tasks.models.kv_cache import init_cache
    from rlax_tasks.models.policy import abstract_model
    from rlax_tasks.rollout import kernels
    from rlax_tasks.rollout.held_weights import HeldWeights

    graphdef, params = abstract_model(config, DTYPE, DTYPE)
    cache = jax.eval_shape(lambda: init_cache(config, rows, 2 * prompt, jnp.float32))
    ids, lengths, source, slots, new = kernels.admission_arrays(rows, prompt, None, rows, 4)
    compiled = kernels.PREFILL.lower(
        config,
        graphdef,
        params,
        HeldWeights(None, None),
        cache,
        _abstract(kernels.empty_state(rows, 4)),
        _abstract(ids),
        _abstract(lengths),
        None,
        _abstract(slots),
        _abstract(new),
        False,
        True,
        0,
    ).compile()
    c = config
    embeddings = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
    layer_weights = c.num_parameters() - embeddings - c.hidden_size
    attention = 2 * prompt * prompt * c.num_attention_heads * c.head_dim * c.num_hidden_layers
    flops = rows * (2 * layer_weights * prompt + 2 * c.hidden_size * c.vocab_size + attention)
    return compiled, flops


def train_program(config: Any, batch: int, seq_len: int, micro: int) -> tuple[Any, int]:
    """(compiled ``Trainer``'s step, dapo, full remat, ``micro``-row micro-batches; the model's
    FLOPs: 6·N per token, plus 2·N for the old-policy pass with several micro-batches)."""
    import jax
    import jax.numpy as jnp

    from rlax_tasks.algorithms import make_objective
    from rlax_tasks.models import LogProbOptions
    from rlax_tasks.models.policy import abstract_model
    from rlax_tasks.trainer.config import TrainerConfig
    from rlax_tasks.trainer.optimizer import make_optimizer
    from rlax_tasks.trainer.train_step import StepSettings, make_train_step

    graphdef, params = abstract_model(config, DTYPE, DTYPE)
    optimizer = make_optimizer(TrainerConfig(learning_rate=1e-6, micro_batch_size=micro))
    params = {"model": params}
    opt_state = jax.eval_shape(optimizer.init, params)
    settings = StepSettings(micro, LogProbOptions(remat="full"), one_forward_pass=micro >= batch)
    step = make_train_step(graphdef, make_objective("dapo"), optimizer, settings)
    i32, f32 = jnp.int32, jnp.float32
    shapes = {
        "input_ids": i32,
        "attention_mask": i32,
        "completion_mask": i32,
        "behavior_logprobs": f32,
    }
    data = {k: jax.ShapeDtypeStruct((batch, seq_len), t) for k, t in shapes.items()}
    data["rewards"] = jax.ShapeDtypeStruct((batch,), f32)
    data["group_ids"] = jax.ShapeDtypeStruct((batch,), i32)
    compiled = jax.jit(step).lower(params, opt_state, data).compile()
    passes = 4 if micro < batch else 3
    return compiled, 2 * passes * config.num_parameters() * batch * seq_len


def measure(name: str, compiled: Any, ideal: int, top: int, compute_bound: bool) -> dict:
    """One program's figures: bytes and product FLOPs over its operations, the ratio to the
    ideal (FLOPs for a compute-bound program, else bytes), the top operations by bytes."""
    ops = _hlo_traffic.operations(compiled.as_text())
    moved = sum(o.bytes for o in ops)
    flops = sum(o.flops for o in ops)
    row = {
        "program": name,
        "bytes": moved,
        "flops": flops,
        "ideal_flops" if compute_bound else "ideal_bytes": ideal,
        "ratio": (flops if compute_bound else moved) / ideal,
        "top": _hlo_traffic.table(ops, top),
    }
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    _timing.setup_logging()
    import jax

    load = _timing.machine_load(log)
    results: dict[str, Any] = {
        "benchmark": "traffic",
        "args": vars(args),
        "dtype": DTYPE,
        "machine_load_before": load,
        "programs": [],
    }
    programs = set(args.programs.split(","))
    slots = [int(s) for s in args.slots.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    with jax.default_device(jax.devices("cpu")[0]):
        for model in args.models.split(","):
            config = model_config(model)
            jobs = []
            for context in contexts:
                for s in slots:
                    if "decode" in programs:
                        for filled in (context, int(context * args.partial_fill)):
                            jobs.append((
                                f"decode {s} slots, {filled} of {context} filled", False,
                                lambda s=s, c=context, f=filled, m=config: decode_program(
                                    m, s, c, f),
                            ))  # fmt: skip
                    if "prefill" in programs:
                        jobs.append((f"prefill {s} x {context // 2} tokens", True,
                                     lambda s=s, c=context, m=config: prefill_program(
                                         m, s, c // 2)))  # fmt: skip
                if "train" in programs:
                    jobs.append((f"train [{args.train_batch}, {context}] micro {args.micro_batch}",
                                 True, lambda c=context, m=config: train_program(
                                     m, args.train_batch, c, args.micro_batch)))  # fmt: skip
            for label, compute_bound, build in jobs:
                t0 = time.perf_counter()
                compiled, ideal = build()
                row = measure(label, compiled, ideal, args.top, compute_bound)
                row.update(model=model, compile_s=time.perf_counter() - t0)
                del compiled
                results["programs"].append(row)
                what = "FLOPs" if compute_bound else "bytes"
                print(
                    f"{model:<13} {label:<34} {row['ratio']:5.2f}x the ideal {what}  "
                    f"({row['bytes'] / 1e9:8.2f} GB, {row['flops'] / 1e12:8.2f} TFLOP; "
                    f"compiled in {row['compile_s']:.0f} s)",
                    flush=True,
                )
                for op in row["top"][:3]:
                    print(
                        f"    {op['share']:6.1%}  {op['bytes'] / 1e9:8.2f} GB  {op['kind']:<14}"
                        f" x{op['runs']:<4} {op['op_name'][-70:]}"
                    )
    results["machine_load_after"] = _timing.machine_load(log, when="after")
    print(f"load before: {_timing.describe_load(load)}")
    _timing.write_json(args.json_out, results, log)
    return results


if __name__ == "__main__":
    main()
