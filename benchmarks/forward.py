"""Forward-pass (prefill) benchmark: the rlax_tasks JAX policy vs transformers PyTorch on the same
~30M-parameter weights (a parity check first): tokens/s of full-logits prefill on [batch,
seq_len], achieved FLOP/s from an analytic count (attention over the full T x T square, the LM
head; no norms, RoPE or softmax) against the machine's jitted matmul ceiling, and peak RSS.
``.venv/bin/python benchmarks/forward.py [--batch 8 --seq-len 512 --dtype bfloat16]``"""

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

_opt = _timing.fmt_opt  # a figure or "n/a"
log = logging.getLogger("benchmarks.forward")

MODEL_SHAPE = _models.MODEL_SHAPE


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=8, help="sequences per forward pass (default 8)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per sequence (default 512)")
    p.add_argument("--repeats", type=int, default=5, help="timed calls; median reported")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls first (JAX compiles here)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None, help="also write the results as JSON here")
    return p.parse_args(argv)


def build_hf_checkpoint(path: str, seed: int, seq_len: int) -> Any:
    """A randomly initialised Qwen2ForCausalLM saved (float32) to ``path``; returns its config."""
    import torch
    from transformers import Qwen2ForCausalLM

    cfg = _models.hf_config(max(2048, seq_len))
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).eval()
    n = sum(p.numel() for p in model.parameters())  # tied lm_head is the same tensor: once
    model.save_pretrained(path)
    log.info("built and saved Qwen2 model (%d torch parameters) to %s", n, path)
    return cfg, n


def forward_flops(config: Any, batch: int, seq_len: int) -> dict[str, float]:
    """Analytic FLOPs (multiply-add = 2) of one full-logits forward; see the module docstring."""
    d, f, h, kv, hd = (
        config.hidden_size,
        config.intermediate_size,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
    )
    layers, vocab, tokens = config.num_hidden_layers, config.vocab_size, batch * seq_len
    matmul_params = layers * (d * h * hd + 2 * d * kv * hd + h * hd * d + 3 * d * f)
    linear = 2 * matmul_params * tokens
    attention = 2 * 2 * batch * layers * seq_len**2 * h * hd  # QK^T and PV, full T x T square
    lm_head = 2 * tokens * d * vocab
    return {
        "matmul_params": matmul_params,
        "linear": linear,
        "attention_full_square": attention,
        "lm_head": lm_head,
        "total": linear + attention + lm_head,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    _timing.setup_logging()
    t_start = time.perf_counter()
    load_before = _timing.machine_load(log)

    import jax
    import torch
    from transformers import Qwen2ForCausalLM

    from rlax_tasks.models import load_pretrained

    torch_dtype = getattr(torch, args.dtype)
    env = {
        "nproc": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "jax_devices": [str(dv) for dv in jax.devices()],
        "jax_version": jax.__version__,
        "torch_version": torch.__version__,
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
        "dtype": args.dtype,
        "busy_cores_before": load_before["busy_cores"],
    }
    log.info("environment: %s", env)

    with tempfile.TemporaryDirectory(prefix="rlax_bench_fwd_") as tmp:
        # ------------------------------------------------------------------ stage 1: weights
        hf_cfg, torch_params = build_hf_checkpoint(tmp, args.seed, args.seq_len)
        policy = load_pretrained(tmp, dtype=args.dtype)
        config = policy.config
        n_params = config.num_parameters()
        jax_leaves = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(policy.params))
        log.info(
            "loaded into JAX: config.num_parameters()=%d, JAX param leaves=%d, torch=%d",
            n_params,
            jax_leaves,
            torch_params,
        )
        model = Qwen2ForCausalLM.from_pretrained(tmp, dtype=torch_dtype).eval()
        attn_impl = getattr(model.config, "_attn_implementation", None)
        log.info("loaded the same weights into PyTorch (%s, attention=%s)", args.dtype, attn_impl)

    # ---------------------------------------------------------------------- inputs
    rng = np.random.default_rng(args.seed)
    ids_np = rng.integers(0, config.vocab_size, (args.batch, args.seq_len), dtype=np.int32)
    mask_np = np.ones_like(ids_np)
    ids_t = torch.from_numpy(ids_np.astype(np.int64))
    mask_t = torch.from_numpy(mask_np.astype(np.int64))

    def torch_logits(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return model(input_ids=ids, attention_mask=mask, use_cache=False).logits

    # ---------------------------------------------------------------------- parity check
    n_par = min(args.seq_len, 64)
    jl = np.asarray(policy.logits(ids_np[:1, :n_par], mask_np[:1, :n_par]), np.float32)
    tl = torch_logits(ids_t[:1, :n_par], mask_t[:1, :n_par]).float().numpy()
    parity = float(np.max(np.abs(jl - tl)))
    log.info("parity (1 x %d tokens): max |logits_jax - logits_torch| = %.3g", n_par, parity)

    # ---------------------------------------------------------------------- stage 2: matmul peak
    log.info("measuring the jitted float32 matmul ceiling (2048, 4096)")
    peak = _timing.jax_matmul_peak((2048, 4096), "float32")
    log.info(
        "JAX matmul peak: %s (n=%d)",
        _timing.fmt_si(peak["flops_per_s"], "FLOP/s"),
        peak["best_size"],
    )
    dtype_peak = None
    if args.dtype != "float32":  # the same ceiling in the run's dtype (bf16 may use AMX/oneDNN)
        dtype_peak = {
            "jax": _timing.jax_matmul_peak((2048, 4096), args.dtype),
            "torch": _timing.torch_matmul_peak((2048, 4096), args.dtype),
        }
        log.info(
            "%s matmul peak: JAX %s, torch %s",
            args.dtype,
            _timing.fmt_si(dtype_peak["jax"]["flops_per_s"], "FLOP/s"),
            _timing.fmt_si(dtype_peak["torch"]["flops_per_s"], "FLOP/s"),
        )
    torch_peak = _timing.torch_matmul_peak((2048, 4096), "float32")
    log.info(
        "torch matmul peak (reference): %s (n=%d)",
        _timing.fmt_si(torch_peak["flops_per_s"], "FLOP/s"),
        torch_peak["best_size"],
    )

    # ---------------------------------------------------------------------- stage 3: prefill
    tokens = args.batch * args.seq_len
    flops = forward_flops(config, args.batch, args.seq_len)
    log.info(
        "timing JAX policy.logits on [%d, %d] (%d warm-up + %d repeats)",
        args.batch,
        args.seq_len,
        args.warmup,
        args.repeats,
    )
    jax_t = _timing.median_time(
        lambda: policy.logits(ids_np, mask_np), repeats=args.repeats, warmup=args.warmup
    )
    log.info(
        "JAX: median %.3fs (first call incl. compile %.2fs; cores used %.2f, by others %s)",
        jax_t.median_s,
        jax_t.first_call_s or float("nan"),
        jax_t.own_cores,
        _opt(jax_t.other_cores),
    )
    log.info(
        "timing torch model(...).logits on [%d, %d] (%d warm-up + %d repeats, %d threads)",
        args.batch,
        args.seq_len,
        args.warmup,
        args.repeats,
        torch.get_num_threads(),
    )
    torch_t = _timing.median_time(
        lambda: torch_logits(ids_t, mask_t), repeats=args.repeats, warmup=args.warmup
    )
    log.info(
        "torch: median %.3fs (cores used %.2f, by others %s)",
        torch_t.median_s,
        torch_t.own_cores,
        _opt(torch_t.other_cores),
    )
    for name, t in (("JAX", jax_t), ("torch", torch_t)):
        if t.other_cores is not None and t.other_cores > 0.2:
            log.warning(
                "other processes used %.2f CPUs during the %s timing: figures are low",
                t.other_cores,
                name,
            )

    rows = {}
    for name, t in (("jax", jax_t), ("torch", torch_t)):
        achieved = flops["total"] / t.median_s
        rows[name] = {
            "timing": t.as_dict(),
            "tokens_per_s": tokens / t.median_s,
            "achieved_flops_per_s": achieved,
            "fraction_of_jax_matmul_peak": achieved / peak["flops_per_s"],
            "fraction_of_jax_matmul_peak_in_dtype": (
                achieved / dtype_peak["jax"]["flops_per_s"] if dtype_peak else None
            ),
        }
    ratio = rows["jax"]["tokens_per_s"] / rows["torch"]["tokens_per_s"]
    rss = _timing.peak_rss_bytes()
    load_after = _timing.machine_load(log, when="after")
    env["busy_cores_after"] = load_after["busy_cores"]
    wall = time.perf_counter() - t_start

    results = {
        "benchmark": "forward",
        "args": vars(args),
        "environment": env,
        "model": {
            "shape": MODEL_SHAPE,
            "head_dim": config.head_dim,
            "num_parameters": n_params,
            "torch_num_parameters": torch_params,
            "torch_attn_implementation": attn_impl,
        },
        "parity_max_abs_logit_diff": parity,
        "flops_per_forward": flops,
        "tokens_per_forward": tokens,
        "jax_matmul_peak": peak,
        "torch_matmul_peak": torch_peak,
        "matmul_peak_in_dtype": dtype_peak,
        "jax": rows["jax"],
        "torch": rows["torch"],
        "jax_over_torch_tokens_per_s": ratio,
        "peak_rss_bytes": rss,
        "wall_s": wall,
        "machine_load": {"before": load_before, "after": load_after},
    }
    print_table(results)
    _timing.write_json(args.json_out, results, log)
    return results


def print_table(r: dict[str, Any]) -> None:
    a, m, f = r["args"], r["model"], r["flops_per_forward"]
    fmt = _timing.fmt_si
    mark = _timing.contended_mark(r["machine_load"]["before"], r["machine_load"]["after"])
    lines = [
        "",
        f"Forward (prefill, full logits) benchmark -- dtype {a['dtype']}, "
        f"batch {a['batch']} x seq {a['seq_len']} = {r['tokens_per_forward']} tokens, "
        f"median of {a['repeats']} after {a['warmup']} warm-up",
        f"model: Qwen2 {m['shape']['num_hidden_layers']}L d={m['shape']['hidden_size']} "
        f"ff={m['shape']['intermediate_size']} H={m['shape']['num_attention_heads']}/"
        f"KV={m['shape']['num_key_value_heads']} hd={m['head_dim']} V={m['shape']['vocab_size']} "
        f"tied -> {m['num_parameters']:,} params (torch counts {m['torch_num_parameters']:,})",
        f"cpus: nproc={r['environment']['nproc']}, torch threads="
        f"{r['environment']['torch_threads']}, torch attention={m['torch_attn_implementation']}, "
        f"CPUs busy with other work before/after: {_opt(r['environment']['busy_cores_before'])}/"
        f"{_opt(r['environment']['busy_cores_after'])}, 1-min load before "
        f"{_opt(r['machine_load']['before']['load_1m'])}{mark}",
        f"FLOPs/forward: {fmt(f['total'], 'FLOP')} = linear {fmt(f['linear'])} + attention "
        f"(full T^2, not halved for causal) {fmt(f['attention_full_square'])} + LM head "
        f"{fmt(f['lm_head'])}",
        f"matmul ceiling (jax.jit a@b, f32, best of {list(r['jax_matmul_peak']['per_size'])}): "
        f"{fmt(r['jax_matmul_peak']['flops_per_s'], 'FLOP/s')} at n="
        f"{r['jax_matmul_peak']['best_size']}; torch a@b: "
        f"{fmt(r['torch_matmul_peak']['flops_per_s'], 'FLOP/s')}",
    ]
    dp = r["matmul_peak_in_dtype"]
    if dp:
        lines.append(
            f"matmul ceiling in {a['dtype']}: jax.jit a@b {fmt(dp['jax']['flops_per_s'], 'FLOP/s')}"
            f"; torch a@b {fmt(dp['torch']['flops_per_s'], 'FLOP/s')}"
            f" ('% dtype pk' = achieved / the JAX {a['dtype']} figure)"
        )
    lines += [
        f"parity: max |logits_jax - logits_torch| = {r['parity_max_abs_logit_diff']:.3g}",
        "",
        f"{'backend':<8} {'median s':>9} {'min s':>8} {'1st call s':>10} {'tokens/s':>11} "
        f"{'achieved':>14} {'% f32 peak':>10}"
        + (f" {'% dtype pk':>10}" if dp else "")
        + f" {'cores':>5} {'others':>6}",
    ]
    for name in ("jax", "torch"):
        row, t = r[name], r[name]["timing"]
        first = t["first_call_s"]
        lines.append(
            f"{name:<8} {t['median_s']:>9.3f} {t['min_s']:>8.3f} "
            f"{(f'{first:.2f}' if first is not None else '-'):>10} "
            f"{row['tokens_per_s']:>11,.0f} {fmt(row['achieved_flops_per_s'], 'FLOP/s'):>14} "
            f"{100 * row['fraction_of_jax_matmul_peak']:>9.1f}%"
            + (f" {100 * row['fraction_of_jax_matmul_peak_in_dtype']:>9.1f}%" if dp else "")
            + f" {t['own_cores']:>5.2f} {_opt(t['other_cores']):>6}"
            + mark
        )
    lines += [
        "(cores: CPUs' worth of this process's CPU time while timing; others: other processes'",
        " -- above ~0.1 the machine was shared and the figures are low)",
        "",
        f"JAX / torch tokens/s: {r['jax_over_torch_tokens_per_s']:.2f}x{mark}",
    ]
    _timing.print_report(lines, r)


if __name__ == "__main__":
    main()
