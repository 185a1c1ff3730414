"""Mixture-of-experts benchmark on CPU: ``Trainer.step`` seconds and the sampler's greedy decode
tokens/s of a Qwen3-MoE (E experts, k per token, grouped products over the tokens sorted by
expert), against the dense Qwen3 with the same active parameters (MLP width k·f_e) and against
the same MoE computed densely (every token through every expert, the simplest alternative).
Each side runs in a fresh process (the grouped product is chosen when a program is traced),
the sides in alternating order over ``--rounds``; the ratios are printed with the load.
``.venv/bin/python benchmarks/moe.py [--experts 16 --top-k 2 --rounds 2]``"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _timing  # noqa: E402  (the benchmarks' shared helper module, next to this file)

log = logging.getLogger("benchmarks.moe")
SIDES = ("moe", "moe-dense-experts", "dense")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--expert-width", type=int, default=256, help="each expert's f_e")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--batch", type=int, default=8, help="train step sequences")
    p.add_argument("--seq-len", type=int, default=256, help="train step tokens per sequence")
    p.add_argument("--slots", type=int, default=32, help="decode slots")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="timed calls per side; median")
    _timing.add_rounds_option(p)
    p.add_argument("--json-out", default=None)
    return p.parse_args(argv)


def model_config(side: str, args: argparse.Namespace) -> Any:
    """The side's ``ModelConfig``: the MoE (both MoE sides), or the dense model of the same
    active parameters."""
    from rlax_tasks.models import ModelConfig

    common = dict(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=args.hidden // 4,
                  qk_norm=True, tie_word_embeddings=True, max_position_embeddings=4096)  # fmt: skip
    if side == "dense":
        return ModelConfig(model_type="qwen3", intermediate_size=args.top_k * args.expert_width,
                           **common)  # fmt: skip
    return ModelConfig(model_type="qwen3_moe", intermediate_size=args.expert_width,
                       num_experts=args.experts, num_experts_per_tok=args.top_k,
                       moe_intermediate_size=args.expert_width, norm_topk_prob=True,
                       **common)  # fmt: skip


def measure(side: str, args: argparse.Namespace, launched: float | None = None) -> dict:
    """One side in this (fresh) process: train step seconds, decode tokens/s."""
    if side == "moe-dense-experts":
        os.environ["RLAX_GROUPED_MATMUL"] = "dense"
    _timing.setup_logging()
    from train_step import random_batch  # the train benchmark's batch

    from rlax_tasks.algorithms import make_objective
    from rlax_tasks.models import Policy
    from rlax_tasks.rollout import Sampler
    from rlax_tasks.trainer import Trainer, TrainerConfig

    config = model_config(side, args)
    policy = Policy.init(config, seed=0)
    batch = random_batch(np.random.default_rng(0), args.batch, args.seq_len, args.vocab)
    with tempfile.TemporaryDirectory(prefix="rlax_bench_moe_") as run_dir:
        config_t = TrainerConfig(learning_rate=1e-5, mesh_shape=(1, 1, 1))
        trainer = Trainer(policy, make_objective("dapo"), config_t, run_dir)
        train = _timing.median_time(lambda: trainer.step(batch), repeats=args.repeats, warmup=1)
        trainer.close()
    rng = np.random.default_rng(1)
    prompts = [list(rng.integers(3, args.vocab, args.prompt_len)) for _ in range(args.slots)]
    sampler = Sampler(policy, max_slots=args.slots, max_len=args.prompt_len + args.new_tokens,
                      precompile=False)  # fmt: skip
    decode = _timing.median_time(
        lambda: sampler.generate(prompts, max_new_tokens=args.new_tokens, temperature=0.0,
                                 ignore_eos=True),  # fmt: skip
        repeats=args.repeats, warmup=1, sync=lambda _: None,
    )
    return {
        "side": side,
        "parameters": config.num_parameters(),
        "active_parameters": config.num_active_parameters(),
        "train_step_s": train.median_s,
        "train_tokens_per_s": args.batch * args.seq_len / train.median_s,
        "decode_tokens_per_s": args.slots * args.new_tokens / decode.median_s,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    _timing.setup_logging()
    start = time.perf_counter()
    load_before = _timing.machine_load(log)
    runs: dict[str, list[dict]] = {s: [] for s in SIDES}
    for order in _timing.round_orders(list(SIDES), args.rounds):
        for side in order:
            log.info("measuring %s", side)
            runs[side].append(_timing.run_in_fresh_process(measure, side, args))
    load_after = _timing.machine_load(log, when="after")
    med = {s: {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "side"}
           for s, rows in runs.items()}  # fmt: skip
    moe = med["moe"]
    lines = [
        f"MoE: {args.experts} experts, top-{args.top_k}, width {args.expert_width}, hidden "
        f"{args.hidden}, {args.layers} layers: {moe['parameters'] / 1e6:.1f}M parameters, "
        f"{moe['active_parameters'] / 1e6:.1f}M active (dense: "
        f"{med['dense']['parameters'] / 1e6:.1f}M)",
    ]
    for s in SIDES:
        m = med[s]
        lines.append(f"  {s:<18} train step {m['train_step_s'] * 1e3:8.1f} ms  "
                     f"({m['train_tokens_per_s']:8.0f} tokens/s)   decode "
                     f"{m['decode_tokens_per_s']:8.1f} tokens/s")  # fmt: skip
    for other in ("moe-dense-experts", "dense"):
        o = med[other]
        lines.append(f"moe vs {other}: train step {o['train_step_s'] / moe['train_step_s']:.2f}x "
                     f"faster, decode {moe['decode_tokens_per_s'] / o['decode_tokens_per_s']:.2f}x"
                     )  # fmt: skip
    mark = _timing.contended_mark(load_before)
    lines.append(f"load before: {_timing.describe_load(load_before)}; after: "
                 f"{_timing.describe_load(load_after)}{mark}")  # fmt: skip
    results = {"benchmark": "moe", "args": vars(args), "runs": runs, "median": med,
               "machine_load_before": load_before, "machine_load_after": load_after,
               "wall_s": time.perf_counter() - start,
               "peak_rss_bytes": _timing.peak_rss_bytes()}  # fmt: skip
    _timing.print_report(lines, results)
    _timing.write_json(args.json_out, results, log)
    return results


if __name__ == "__main__":
    main()
