"""Rollout benchmark on the ~30M-parameter model: the Sampler vs transformers ``generate`` (greedy,
then nucleus sampling) beside two floors (``_matmul_floor``: the products alone, and with the
KV-cache attention), in alternating rounds; continuous vs static batching on a long-tailed mix;
weight swap time, the bfloat16 sampler-vs-forward log-prob |delta| p95 and peak RSS.
``.venv/bin/python benchmarks/rollout.py [--repeats N]``"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import tempfile
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _timing  # noqa: E402
import forward as forward_bench  # noqa: E402  (the same model shape and checkpoint builder)
from _matmul_floor import make_floor  # noqa: E402

log = logging.getLogger("benchmarks.rollout")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=16, help="prompts in the vs-transformers part")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--decode-chunk", type=int, default=8)
    p.add_argument("--slots", type=int, default=16, help="slots in the batching comparison")
    p.add_argument("--mix-requests", type=int, default=64)
    p.add_argument("--short", type=int, default=32, help="new tokens of a short completion")
    p.add_argument("--sample-temperature", type=float, default=0.6)
    p.add_argument("--sample-top-p", type=float, default=0.95)
    p.add_argument("--skip-bf16", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None)
    return p.parse_args(argv)


def timed_side_by_side(fns: list[Any], repeats: int) -> list[tuple[float, Any]]:
    """(median seconds, last result) of each of ``fns``: one warm-up call each, then ``repeats``
    rounds calling each once in turn, so every side sees the same machine (a cloud VM's speed
    drifts by a third over minutes: timed one side after the other, a drift lands on one side).
    """
    results = [fn() for fn in fns]
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            results[i] = fn()
            times[i].append(time.perf_counter() - t0)
    return [(float(np.median(t)), r) for t, r in zip(times, results, strict=True)]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    _timing.setup_logging()
    import jax
    import torch
    from transformers import Qwen2ForCausalLM

    from rlax_tasks.models import Policy, load_pretrained
    from rlax_tasks.rollout import Sampler, SamplingParams
    from rlax_tasks.rollout.logprob_gaps import forward_logprob_gaps

    load_before = _timing.machine_load(log)
    out: dict[str, Any] = {"args": vars(args)}
    figures: list[str] = []  # printed together at the end, marked when the machine was contended

    def report(line: str) -> None:
        log.info("%s", line)
        figures.append(line)

    max_len = args.prompt_len + max(args.new_tokens, 8 * args.short)
    with tempfile.TemporaryDirectory(prefix="rlax_bench_rollout_") as tmp:
        _, n_params = forward_bench.build_hf_checkpoint(tmp, args.seed, max_len)
        policy = load_pretrained(tmp)
        model = Qwen2ForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    out["parameters"] = n_params
    rng = np.random.default_rng(args.seed)
    prompts = [
        [int(t) for t in rng.integers(3, policy.config.vocab_size, args.prompt_len)]
        for _ in range(args.batch)
    ]

    # ------------------------------------------------------------ 1. ours vs transformers
    sampler = Sampler(policy, max_slots=args.batch, max_len=max_len, decode_chunk=args.decode_chunk)

    def ours(new_tokens: int, **sampling: Any) -> list:
        """Every prompt to exactly ``new_tokens`` tokens; greedy unless ``sampling`` says
        (temperature, top_p, seed)."""
        return sampler.generate(prompts, max_new_tokens=new_tokens, ignore_eos=True, **sampling)

    ids = torch.tensor(prompts, dtype=torch.long)

    def theirs(new_tokens: int, **sampling: Any) -> Any:
        """The same with transformers; greedy unless ``sampling`` says (temperature, top_p)."""
        with torch.inference_mode():
            return model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=bool(sampling),
                **({"top_k": 0, **sampling} if sampling else {}),
                use_cache=True,
                pad_token_id=0,
            )

    log.info(
        "ours and transformers generate, in turn: %d prompts x %d new tokens (warm-up compiles)",
        args.batch,
        args.new_tokens,
    )
    floor = make_floor(policy, args.batch, args.prompt_len, args.new_tokens)
    floor_attention = make_floor(
        policy, args.batch, args.prompt_len, args.new_tokens, attention=True
    )
    sides = [lambda: ours(args.new_tokens), lambda: theirs(args.new_tokens), floor, floor_attention]
    timings = timed_side_by_side(sides, args.repeats)
    (ours_s, ours_out), (theirs_s, theirs_out), (floor_s, _), (attention_s, _) = timings
    tokens = args.batch * args.new_tokens
    agree = np.mean(
        [o.tokens == theirs_out[i, args.prompt_len :].tolist() for i, o in enumerate(ours_out)]
    )
    out["vs_transformers"] = {
        "ours_tokens_per_s": tokens / ours_s,
        "transformers_tokens_per_s": tokens / theirs_s,
        "ratio": theirs_s / ours_s,
        "greedy_rows_identical": float(agree),
        "target": ">= 2x",
    }
    report(
        f"[generate] ours {tokens / ours_s:,.0f} tok/s vs transformers {tokens / theirs_s:,.0f} "
        f"tok/s: {theirs_s / ours_s:.2f}x (target >= 2x); identical greedy rows {agree:.0%}"
    )
    for key, seconds, what, loop in [
        ("matmul_floor", floor_s, "the model's matrix products alone (no attention, norms or "
         "sampling)", "no decode loop"),
        ("matmul_and_cache_floor", attention_s, "with attention's products over the KV cache "
         "(no softmax, norms, cache writes or sampling)", "no decode loop reading the cache"),
    ]:  # fmt: skip
        out[key] = {
            "seconds": seconds,
            "ours_over_floor": ours_s / seconds,
            "transformers_over_floor": theirs_s / seconds,
        }
        report(
            f"[floor] {what}: {seconds:.2f} s; ours takes {ours_s / seconds:.2f}x that, "
            f"transformers {theirs_s / seconds:.2f}x: {loop} at these products' speed could "
            f"beat transformers by more than {theirs_s / seconds:.2f}x"
        )

    # ------------------------------------------------------------ 1b. nucleus sampling
    # Qwen's recommended evaluation settings; seeds differ, so only the throughput is compared
    temperature, top_p = args.sample_temperature, args.sample_top_p
    sample_tokens_n = args.new_tokens // 2
    nucleus = {"temperature": temperature, "top_p": top_p}

    log.info("nucleus sampling: T=%s top_p=%s, ours and transformers in turn", temperature, top_p)
    (ours_sampled_s, _), (theirs_sampled_s, _) = timed_side_by_side(
        [
            lambda: ours(sample_tokens_n, **nucleus, seed=args.seed),
            lambda: theirs(sample_tokens_n, **nucleus),
        ],
        args.repeats,
    )
    sampled = args.batch * sample_tokens_n
    out["nucleus_sampling"] = {
        "temperature": temperature,
        "top_p": top_p,
        "new_tokens": sample_tokens_n,
        "ours_tokens_per_s": sampled / ours_sampled_s,
        "transformers_tokens_per_s": sampled / theirs_sampled_s,
        "ratio": theirs_sampled_s / ours_sampled_s,
    }
    report(
        f"[sampling] T={temperature} top_p={top_p}, {args.batch} x {sample_tokens_n} tokens: ours "
        f"{sampled / ours_sampled_s:,.0f} tok/s vs transformers {sampled / theirs_sampled_s:,.0f} "
        f"tok/s: {theirs_sampled_s / ours_sampled_s:.2f}x"
    )

    # ------------------------------------------------------------ 1c. recording kept ids
    # sampling-mask replay: what recording each token's top-k kept ids for the trainer costs,
    # against the same sampling without (top-k 20, Qwen3's recommended setting)
    top_k = {"temperature": temperature, "top_k": 20, "seed": args.seed}
    recording = Sampler(
        policy, max_slots=args.batch, max_len=max_len, decode_chunk=args.decode_chunk,
        support_capacity=20,  # what rollout.support_size gives for top_k 20
    )  # fmt: skip
    log.info("top-k sampling with and without recording the kept ids, in turn")
    (plain_s, _), (recorded_s, recorded) = timed_side_by_side(
        [
            lambda: ours(sample_tokens_n, **top_k),
            lambda: recording.generate(
                prompts, max_new_tokens=sample_tokens_n, ignore_eos=True, **top_k
            ),
        ],
        args.repeats,
    )
    kept = [len(ids) for o in recorded for ids in o.support]
    out["support_recording"] = {
        "top_k": 20,
        "plain_tokens_per_s": sampled / plain_s,
        "recording_tokens_per_s": sampled / recorded_s,
        "recording_over_plain": recorded_s / plain_s,
        "mean_kept_ids": float(np.mean(kept)),
    }
    report(
        f"[support] top-k 20, {args.batch} x {sample_tokens_n} tokens: recording the kept ids "
        f"{sampled / recorded_s:,.0f} tok/s vs without {sampled / plain_s:,.0f} tok/s: "
        f"{recorded_s / plain_s:.2f}x the time ({np.mean(kept):.0f} ids per token)"
    )

    # ------------------------------------------------------------ 2. continuous vs static
    long = 8 * args.short
    lengths = [long if i % 8 == 3 else args.short for i in range(args.mix_requests)]
    mix = [
        [int(t) for t in rng.integers(3, policy.config.vocab_size, args.prompt_len)]
        for _ in lengths
    ]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in lengths]
    modes = ("static", "continuous")
    samplers = [
        Sampler(
            policy,
            max_slots=args.slots,
            max_len=max_len,
            decode_chunk=args.decode_chunk,
            batching=mode,
        )
        for mode in modes
    ]
    timings = timed_side_by_side(
        [lambda s=s: s.generate(mix, params=params) for s in samplers], args.repeats
    )
    results = {}
    for mode, s, (seconds, outs) in zip(modes, samplers, timings, strict=True):
        assert [len(o.tokens) for o in outs] == lengths
        results[mode] = {
            "seconds": seconds,
            "tokens_per_s": sum(lengths) / seconds,
            "decode_calls_per_run": s.stats.decode_calls // (args.repeats + 1),
        }
    ratio = results["static"]["seconds"] / results["continuous"]["seconds"]
    out["batching"] = {
        **results,
        "ratio": ratio,
        "target": ">= 1.5x",
        "lengths": {
            "short": args.short,
            "long": long,
            "requests": args.mix_requests,
            "slots": args.slots,
        },
    }
    report(
        f"[batching] {args.mix_requests} requests (7/8 x {args.short}, 1/8 x {long} tokens), "
        f"{args.slots} slots: continuous {results['continuous']['tokens_per_s']:,.0f} tok/s vs "
        f"static {results['static']['tokens_per_s']:,.0f} tok/s: {ratio:.2f}x (target >= 1.5x)"
    )

    # ------------------------------------------------------------ 3. swap, bf16, memory
    other = Policy.init(policy.config, seed=1)
    swaps = [sampler.set_params(p) for p in (other.params, policy.params, other.params)]
    out["weight_swap_s"] = float(np.median(swaps))
    report(
        f"[swap] set_params of {n_params / 1e6:.1f}M parameters: {np.median(swaps) * 1e3:.1f} ms"
    )

    if not args.skip_bf16:
        bf16 = dataclasses.replace(
            policy,
            params=jax.tree.map(lambda a: a.astype("bfloat16"), policy.params),
            dtype="bfloat16",
        )
        outs = Sampler(bf16, max_slots=8, max_len=max_len).generate(
            prompts[:8], max_new_tokens=64, temperature=1.0, seed=0
        )
        p95 = float(np.percentile(forward_logprob_gaps(bf16, prompts, outs), 95))
        out["bf16_logprob_abs_delta_p95"] = p95
        report(f"[bf16] sampler vs forward log-prob |delta|: p95 {p95:.4f}")

    out["peak_rss_bytes"] = _timing.peak_rss_bytes()
    report(f"[memory] peak RSS {out['peak_rss_bytes'] / 2**30:.2f} GiB")
    load_after = _timing.machine_load(log, when="after")
    out["machine_load"] = {"before": load_before, "after": load_after}
    print_figures(figures, load_before, load_after)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(out, f, indent=2)
    return out


def print_figures(figures: list[str], load_before: dict, load_after: dict) -> None:
    """The machine's load before and after, then each figure line, marked CONTENDED when
    other work shared the CPU (``_timing.contended_mark``)."""
    mark = _timing.contended_mark(load_before, load_after)
    print(f"rollout benchmark, machine load before: {_timing.describe_load(load_before)}; after: "
          f"{_timing.describe_load(load_after)}")  # fmt: skip
    for line in figures:
        print(line + mark)


if __name__ == "__main__":
    main()
