"""Accelerator figures with Qwen2.5-1.5B shapes and random bfloat16 weights: the sampler's decode
tokens/s at 64 and 256 slots against the HBM roofline (every weight and the live KV cache read
once per decode step), and ``Trainer.step``'s model FLOP utilisation against the device's dense
bfloat16 peak. ``--train-sweep`` measures the train step under each setting in turn (remat,
micro-batch, attention kernel; the likeliest fastest first, within ``--train-budget-s``) and keeps
the fastest: the settings to give the trainer for that shape. ``--layers N`` keeps the shape's
layer widths with N layers (Qwen2.5-7B's layers on one device). ``--shape small`` runs the same
code on a small model (the CPU form of scripts/device_check.sh: the code paths, no roofline or
peak to compare with).
``.venv/bin/python benchmarks/accelerator.py [--shape qwen2.5-1.5b] [--json-out FILE]``"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import tempfile
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _timing  # noqa: E402
from train_step import random_batch  # noqa: E402  (the train benchmark's batch)

log = logging.getLogger("benchmarks.accelerator")

# device kind (as JAX names it, matched by prefix) -> (dense bfloat16 FLOP/s, HBM bytes/s), from
# the vendors' data sheets
DEVICE_PEAKS: dict[str, tuple[float, float]] = {
    "NVIDIA H200": (989e12, 4.8e12),
    "NVIDIA H100": (989e12, 3.35e12),
    "NVIDIA A100": (312e12, 2.0e12),
    "TPU v6 lite": (918e12, 1.64e12),
    "TPU v5p": (459e12, 2.765e12),
    "TPU v5 lite": (197e12, 0.819e12),
    "TPU v4": (275e12, 1.2e12),
}
SMALL = dict(
    model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, vocab_size=256, tie_word_embeddings=True,
)  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=tuple(SHAPES), default="qwen2.5-1.5b")
    p.add_argument("--layers", type=int, default=None, help="this many of the shape's layers")
    p.add_argument("--slots", default="64,256", help="decode slot counts (comma-separated)")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--train-batch", type=int, default=8)
    p.add_argument("--train-seq-len", type=int, default=1024)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--train-sweep", action="store_true", help="measure each train setting")
    p.add_argument("--train-budget-s", type=float, default=120.0,
                   help="the sweep starts no setting after this many seconds")  # fmt: skip
    p.add_argument(
        "--only",
        choices=("decode", "train"),
        default=None,
        help="only the decode or only the train figures (a device run's parts)",
    )
    p.add_argument(
        "--settle-s",
        type=float,
        default=150.0,
        help="the most seconds to wait for the load to settle before starting",
    )
    p.add_argument("--json-out", default=None, help="the figures as JSON, rewritten after each")
    return p.parse_args(argv)


# --shape -> the KNOWN_MODELS entry of its public shapes (None: SMALL)
SHAPES = {"qwen2.5-1.5b": "qwen2.5-math-1.5b", "qwen2.5-7b": "qwen2.5-7b", "small": None}


def model_config(shape: str, layers: int | None = None) -> Any:
    """The benchmark's ``ModelConfig``: a public model's shapes (``layers`` of them when given),
    or the small one."""
    from rlax_tasks.models import ModelConfig
    from rlax_tasks.plan.model_shapes import KNOWN_MODELS

    fields = dict(SMALL if SHAPES[shape] is None else KNOWN_MODELS[SHAPES[shape]])
    if layers is not None:
        fields["num_hidden_layers"] = layers
    return ModelConfig.from_hf_dict({**fields, "max_position_embeddings": 4096})


def device_peak(kind: str) -> tuple[float, float] | None:
    """(bfloat16 FLOP/s, HBM bytes/s) of a device kind; None when unknown (the CPU)."""
    return next((v for k, v in DEVICE_PEAKS.items() if kind.startswith(k)), None)


def decode_figures(policy: Any, slots: int, prompt_len: int, new: int, repeats: int) -> dict:
    """Tokens/s of ``slots`` greedy completions of ``new`` tokens after ``prompt_len``."""
    import jax

    from rlax_tasks.rollout import Sampler
    from rlax_tasks.rollout.sampler import SamplerStats

    sampler = Sampler(policy, max_slots=slots, max_len=prompt_len + new, precompile=False)
    rng = np.random.default_rng(0)
    vocab = policy.config.vocab_size
    prompts = [list(rng.integers(3, vocab, prompt_len)) for _ in range(slots)]

    def run() -> Any:
        sampler.stats = SamplerStats()  # the last run's prefill and decode seconds
        return sampler.generate(prompts, max_new_tokens=new, temperature=0.0, ignore_eos=True)

    timing = _timing.median_time(run, repeats=repeats, warmup=1, sync=lambda _: None)
    last = sampler.stats
    tokens_per_s = slots * new / timing.median_s
    weights = sum(a.nbytes for a in jax.tree.leaves(sampler.params))
    c = policy.config
    kv_per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 2  # bf16 K, V
    mean_context = prompt_len + new / 2
    step_bytes = weights + slots * mean_context * kv_per_token
    return {
        "slots": slots,
        "timing": timing.as_dict(),
        "tokens_per_s": tokens_per_s,
        "bytes_per_decode_step": step_bytes,
        "weights_bytes": weights,
        # where a run's time goes (the last run): prefill (which samples the first token), then
        # the decode steps of the other new - 1
        "prefill_s": last.prefill_s,
        "decode_s": last.decode_s,
        "decode_calls": last.decode_calls,
        "decode_step_s": last.decode_s / max(1, new - 1),
    }


@dataclasses.dataclass(frozen=True)
class TrainSetting:
    """How the trainer computes a step: remat policy, sequences per micro-batch, attention kernel
    (None: the platform's default)."""

    remat: str
    micro_batch: int
    attention: str | None = None

    def overrides(self) -> list[str]:
        """The ``--set`` flags (and environment) that give a run this setting."""
        out = [f"trainer.remat={self.remat}", f"trainer.micro_batch_size={self.micro_batch}"]
        return out + ([] if self.attention is None else [f"RLAX_ATTENTION={self.attention}"])


def train_settings(batch: int, micro: int, platform: str, sweep: bool) -> list[TrainSetting]:
    """The settings to measure, the likeliest fastest first: the run's default (full remat at
    ``micro``), keeping the matmul outputs, no remat, the whole batch at once, XLA's attention."""
    first = TrainSetting("full", micro)
    if not sweep:
        return [first]
    out = [first, TrainSetting("dots", micro), TrainSetting("none", micro)]
    if micro < batch:
        out.append(TrainSetting("dots", batch))
    if platform != "cpu":  # the CPU's default is blocked XLA attention already
        out.append(TrainSetting("dots", micro, "xla"))
    return out


def train_figures(
    policy: Any, batch: int, seq_len: int, setting: TrainSetting, repeats: int
) -> dict:
    """``Trainer.step`` seconds and model FLOP/s (6·N·tokens plus the old-policy prefill) under
    ``setting``; an error (out of memory) is the row's ``error``."""
    from rlax_tasks.algorithms import make_objective
    from rlax_tasks.models.attention import ATTENTION_ENV
    from rlax_tasks.trainer import Trainer, TrainerConfig

    tokens = batch * seq_len
    data = random_batch(np.random.default_rng(0), batch, seq_len, policy.config.vocab_size)
    row: dict[str, Any] = {"batch": batch, "seq_len": seq_len, **dataclasses.asdict(setting)}
    previous = os.environ.pop(ATTENTION_ENV, None)
    if setting.attention is not None:  # read when the step is traced, i.e. by this trainer
        os.environ[ATTENTION_ENV] = setting.attention
    try:
        with tempfile.TemporaryDirectory(prefix="rlax_bench_accel_") as run_dir:
            config = TrainerConfig(learning_rate=1e-6, micro_batch_size=setting.micro_batch,
                                   remat=setting.remat, mesh_shape=(1, 1, 1))  # fmt: skip
            trainer = Trainer(policy, make_objective("dapo"), config, run_dir)
            try:
                timing = _timing.median_time(lambda: trainer.step(data), repeats=repeats,
                                             warmup=1)  # fmt: skip
            finally:
                trainer.close()
    except Exception as e:  # noqa: BLE001 - out of memory or a kernel refused: the next setting
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        log.warning("train step %s: %s", setting, row["error"])
        return row
    finally:
        os.environ.pop(ATTENTION_ENV, None)
        if previous is not None:
            os.environ[ATTENTION_ENV] = previous
    passes = 4 if setting.micro_batch < batch else 3  # prefill + forward + backward
    flops = 2 * passes * policy.config.num_parameters() * tokens
    row.update(timing=timing.as_dict(), tokens_per_s=tokens / timing.median_s,
               model_flops_per_step=flops, model_flops_per_s=flops / timing.median_s)  # fmt: skip
    return row


def train_sweep(policy: Any, args: argparse.Namespace, platform: str, peak: Any,
                results: dict) -> None:  # fmt: skip
    """Measures each setting in turn (results["train_sweep"], rewritten after each) within the
    budget; results["train"] is the fastest."""
    start = time.perf_counter()
    rows: list[dict] = results.setdefault("train_sweep", [])
    settings = train_settings(args.train_batch, args.micro_batch, platform, args.train_sweep)
    for i, setting in enumerate(settings):
        spent = time.perf_counter() - start
        if i and spent > args.train_budget_s:
            log.info("train sweep: %.0f s spent, %d settings left unmeasured", spent,
                     len(settings) - i)  # fmt: skip
            break
        log.info("train step: [%d, %d], %s", args.train_batch, args.train_seq_len, setting)
        row = train_figures(policy, args.train_batch, args.train_seq_len, setting, args.repeats)
        if peak is not None and "model_flops_per_s" in row:
            row["mfu"] = row["model_flops_per_s"] / peak[0]
        rows.append(row)
        timed = [r for r in rows if "tokens_per_s" in r]
        if timed:
            best = max(timed, key=lambda r: r["tokens_per_s"])
            results["train"] = best
            results["train_best_settings"] = TrainSetting(
                best["remat"], best["micro_batch"], best["attention"]
            ).overrides()
        _timing.write_json(args.json_out, results, log)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    _timing.setup_logging()
    import jax

    from rlax_tasks.models import Policy

    start = time.perf_counter()
    load = _timing.machine_load(log, settle_s=args.settle_s)
    device = jax.local_devices()[0]
    peak = device_peak(device.device_kind)
    config = model_config(args.shape, args.layers)
    log.info("%s: %.2fB parameters on %s", args.shape, config.num_parameters() / 1e9, device)
    results: dict[str, Any] = {
        "benchmark": "accelerator",
        "args": vars(args),
        "device": {"platform": device.platform, "kind": device.device_kind, "peak": peak},
        "num_parameters": config.num_parameters(),
        "machine_load_before": load,
        "decode": [],
    }
    if args.only != "train":
        sampler_policy = Policy.init(config, dtype="bfloat16", param_dtype="bfloat16")
        for slots in [int(s) for s in args.slots.split(",")]:
            log.info("decode: %d slots, %d + %d tokens", slots, args.prompt_len, args.new_tokens)
            row = decode_figures(sampler_policy, slots, args.prompt_len, args.new_tokens,
                                 args.repeats)  # fmt: skip
            if peak is not None:
                row["roofline_tokens_per_s"] = slots * peak[1] / row["bytes_per_decode_step"]
                row["fraction_of_roofline"] = row["tokens_per_s"] / row["roofline_tokens_per_s"]
                # the decode steps alone against the bytes each must read
                row["decode_step_fraction_of_roofline"] = (
                    row["bytes_per_decode_step"] / peak[1] / row["decode_step_s"]
                )
            results["decode"].append(row)
            _timing.write_json(args.json_out, results, log)  # a later time-out keeps this one
        del sampler_policy
    if args.only != "decode":
        policy = Policy.init(config, dtype="bfloat16", param_dtype="float32")  # master weights
        train_sweep(policy, args, device.platform, peak, results)
    results["wall_s"] = time.perf_counter() - start
    for row in results["decode"]:
        roof = row.get("fraction_of_roofline")
        step = row.get("decode_step_fraction_of_roofline")
        split = f"prefill {row['prefill_s']:.3f} s, decode {row['decode_step_s'] * 1e3:.2f} ms/step"
        print(f"decode {row['slots']:>4} slots: {row['tokens_per_s']:>10.1f} tokens/s"
              + ("" if roof is None else f"  {roof:.1%} of the HBM roofline") + f"; {split}"
              + ("" if step is None else f" ({step:.1%} of its roofline)"))  # fmt: skip
    for row in results.get("train_sweep", []):
        mfu = row.get("mfu")
        what = f"remat {row['remat']}, micro-batch {row['micro_batch']}, attention " + (
            row["attention"] or "default"
        )
        if "error" in row:
            print(f"train step ({what}): {row['error']}")
            continue
        print(f"train step ({what}): {row['timing']['median_s']:.3f} s, "
              f"{row['tokens_per_s']:.0f} tokens/s"
              + ("" if mfu is None else f", MFU {mfu:.1%}"))  # fmt: skip
    if len(results.get("train_sweep", [])) > 1 and "train_best_settings" in results:
        print("fastest train setting: " + " ".join(results["train_best_settings"]))
    print(f"load before: {_timing.describe_load(load)}")
    _timing.write_json(args.json_out, results, log)
    return results


if __name__ == "__main__":
    main()
