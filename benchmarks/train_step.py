"""Train-step benchmark: ``Trainer.step`` (dapo, float32, single device, ``--micro-batch``
accumulation) on the ~30M-parameter model: seconds per step, tokens/s and achieved FLOP/s
(6·N·tokens, plus 2·N·tokens for the old-policy prefill with several micro-batches; a second
figure adds attention) against the machine's jitted float32 matmul FLOP/s.
``.venv/bin/python benchmarks/train_step.py [--batch 8 --seq-len 256 --micro-batch 4]``"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _models  # noqa: E402  (the benchmarks' model shape, next to this file)
import _timing  # noqa: E402  (the benchmarks' shared helper module, next to this file)
import forward as forward_benchmark  # noqa: E402  (the forward FLOP count)

_opt = _timing.fmt_opt  # a figure or "n/a"
log = logging.getLogger("benchmarks.train_step")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=8, help="sequences per train step (default 8)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default 256)")
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per micro-batch")
    p.add_argument("--remat", choices=("none", "full", "dots"), default="none")
    p.add_argument("--objective", default="dapo", help="algorithm preset (default dapo)")
    p.add_argument("--repeats", type=int, default=3, help="timed steps; median reported")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (compiles)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None, help="also write the results as JSON here")
    return p.parse_args(argv)


def random_batch(rng: np.random.Generator, batch: int, seq_len: int, vocab: int) -> dict:
    """Full-length sequences: the first half prompt, the second half completion; groups of 4."""
    ids = rng.integers(3, vocab, (batch, seq_len), dtype=np.int32)
    completion = np.zeros((batch, seq_len), np.int32)
    completion[:, seq_len // 2 :] = 1
    group = min(4, batch)
    return {
        "input_ids": ids,
        "attention_mask": np.ones_like(ids),
        "completion_mask": completion,
        "behavior_logprobs": np.full(ids.shape, -np.log(vocab), np.float32) * completion,
        "rewards": rng.integers(0, 2, batch).astype(np.float32),
        "group_ids": (np.arange(batch) // group).astype(np.int32),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    _timing.setup_logging()
    logging.getLogger("absl").setLevel(logging.WARNING)
    t_start = time.perf_counter()
    load_before = _timing.machine_load(log)

    import jax

    from rlax_tasks.algorithms import make_objective
    from rlax_tasks.models import Policy
    from rlax_tasks.trainer import Trainer, TrainerConfig

    env = {
        "nproc": os.cpu_count(),
        "jax_devices": [str(d) for d in jax.devices()],
        "jax_version": jax.__version__,
        "busy_cores_before": load_before["busy_cores"],
    }
    log.info("environment: %s", env)
    config = _models.rlax_config(max(2048, args.seq_len))
    n_params = config.num_parameters()
    policy = Policy.init(config, seed=args.seed)
    objective = make_objective(args.objective)

    log.info("measuring the jitted float32 matmul ceiling (2048, 4096)")
    peak = _timing.jax_matmul_peak((2048, 4096), "float32")
    log.info("JAX matmul peak: %s", _timing.fmt_si(peak["flops_per_s"], "FLOP/s"))

    rng = np.random.default_rng(args.seed)
    batch = random_batch(rng, args.batch, args.seq_len, config.vocab_size)
    tokens = args.batch * args.seq_len
    with tempfile.TemporaryDirectory(prefix="rlax_bench_train_") as run_dir:
        trainer = Trainer(
            policy,
            objective,
            TrainerConfig(
                learning_rate=1e-5,
                micro_batch_size=args.micro_batch,
                remat=args.remat,
                mesh_shape=(1, 1, 1),
                seed=args.seed,
            ),
            run_dir,
        )
        del policy  # the trainer holds its own copy
        metrics: dict[str, Any] = {}

        def one_step() -> None:
            metrics.update(trainer.step(batch))

        log.info(
            "timing Trainer.step on [%d, %d], micro-batch %d (%d warm-up + %d repeats)",
            args.batch,
            args.seq_len,
            args.micro_batch,
            args.warmup,
            args.repeats,
        )
        timing = _timing.median_time(one_step, repeats=args.repeats, warmup=args.warmup)
        trainer.close()

    load_after = _timing.machine_load(log, when="after")
    passes = 4 if args.micro_batch < args.batch else 3  # forward-equivalents: prefill + 1 + 2
    flops_model = 2 * passes * n_params * tokens
    fwd = forward_benchmark.forward_flops(config, args.batch, args.seq_len)
    flops_with_attention = passes * fwd["total"]
    achieved = flops_model / timing.median_s
    results = {
        "benchmark": "train_step",
        "args": vars(args),
        "environment": env,
        "model": {"shape": _models.MODEL_SHAPE, "num_parameters": n_params},
        "tokens_per_step": tokens,
        "timing": timing.as_dict(),
        "tokens_per_s": tokens / timing.median_s,
        "forward_passes": passes,
        "flops_per_step_model": flops_model,
        "flops_per_step_with_attention": flops_with_attention,
        "achieved_flops_per_s": achieved,
        "achieved_flops_per_s_with_attention": flops_with_attention / timing.median_s,
        "jax_matmul_peak": peak,
        "fraction_of_matmul_peak": achieved / peak["flops_per_s"],
        "fraction_of_matmul_peak_with_attention": (
            flops_with_attention / timing.median_s / peak["flops_per_s"]
        ),
        "last_step_metrics": metrics,
        "peak_rss_bytes": _timing.peak_rss_bytes(),
        "busy_cores_after": load_after["busy_cores"],
        "machine_load": {"before": load_before, "after": load_after},
        "wall_s": time.perf_counter() - t_start,
    }
    print_table(results)
    _timing.write_json(args.json_out, results, log)
    return results


def print_table(r: dict[str, Any]) -> None:
    a, t, fmt = r["args"], r["timing"], _timing.fmt_si
    mark = _timing.contended_mark(r["machine_load"]["before"], r["machine_load"]["after"])
    first = t["first_call_s"]
    lines = [
        "",
        f"Train-step benchmark -- {a['objective']}, float32, batch {a['batch']} x seq "
        f"{a['seq_len']} = {r['tokens_per_step']} tokens/step, micro-batch {a['micro_batch']}, "
        f"remat {a['remat']}, median of {a['repeats']} after {a['warmup']} warm-up",
        f"model: Qwen2 shape of benchmarks/forward.py -> {r['model']['num_parameters']:,} params",
        f"FLOPs/step: {2 * r['forward_passes']}*N*tokens = "
        f"{fmt(r['flops_per_step_model'], 'FLOP')} (6N fwd+bwd"
        f"{' + 2N old-logprob prefill' if r['forward_passes'] == 4 else ''}); with attention "
        f"({r['forward_passes']}x forward count): "
        f"{fmt(r['flops_per_step_with_attention'], 'FLOP')}",
        f"step: median {t['median_s']:.3f}s, min {t['min_s']:.3f}s, first call (compile) "
        f"{(f'{first:.1f}s' if first is not None else '-')}; cores used {t['own_cores']:.2f}, "
        f"by others {_opt(t['other_cores'])} (CPUs busy before/after: "
        f"{_opt(r['environment']['busy_cores_before'])}/{_opt(r['busy_cores_after'])}; 1-min "
        f"load before {_opt(r['machine_load']['before']['load_1m'])}){mark}",
        f"training tokens/s: {r['tokens_per_s']:,.0f}{mark}",
        f"achieved: {fmt(r['achieved_flops_per_s'], 'FLOP/s')} ({2 * r['forward_passes']}N count), "
        f"{fmt(r['achieved_flops_per_s_with_attention'], 'FLOP/s')} (with attention){mark}",
        f"baseline jax.jit(a @ b) f32 peak: {fmt(r['jax_matmul_peak']['flops_per_s'], 'FLOP/s')} "
        f"(n={r['jax_matmul_peak']['best_size']})",
        f"ratio achieved / matmul peak: {r['fraction_of_matmul_peak']:.3f} "
        f"({2 * r['forward_passes']}N count), "
        f"{r['fraction_of_matmul_peak_with_attention']:.3f} (with attention){mark}",
    ]
    _timing.print_report(lines, r)


if __name__ == "__main__":
    main()
