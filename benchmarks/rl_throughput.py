"""RL steps per second at a real model size: ours (`rlax run` colocated; ``--layouts`` adds
disaggregated) vs TRL's ``GRPOTrainer`` on the same random 30M-parameter Qwen2 model (the tiny
preset's tokenizer widened to 32000), prompts, batch and completion length, GRPO without KL,
float32 CPU. Figure: (N - 1) / (t_N - t_1), past the first (compiling) step. Called by
``vs_trl.py --model-size 30m``; ``.venv/bin/python benchmarks/rl_throughput.py [--steps 6]``"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _setup  # noqa: E402, F401  (the repository root on sys.path; JAX on the CPU by default)

from benchmarks import _models, _timing  # noqa: E402

log = logging.getLogger("benchmarks.rl_throughput")

VOCAB = 32000
LAYOUTS: dict[str, dict[str, Any]] = {
    "colocated": {"placement.mode": "colocated", "workers.count": 1},
    "disaggregated": {"placement.mode": "disaggregated", "workers.count": 2},
}


def build_model(path: str, tokenizer_dir: str, seed: int = 0) -> int:
    """The 30M model (forward.py's shape) with ``tokenizer_dir``'s tokenizer widened to VOCAB
    entries, saved as an HF directory at ``path``; returns its parameter count."""
    import torch
    from transformers import Qwen2ForCausalLM

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(tokenizer_dir, "tokenizer.json")) as f:
        tok = json.load(f)
    vocab = tok["model"]["vocab"]
    for i in range(len(vocab), VOCAB):
        vocab[f"<x{i}>"] = i  # never produced from text (one character at a time); decodable
    with open(os.path.join(path, "tokenizer.json"), "w") as f:
        json.dump(tok, f)
    shutil.copy(os.path.join(tokenizer_dir, "tokenizer_config.json"), path)
    cfg = _models.hf_config(2048, vocab_size=VOCAB, pad_token_id=0)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg)
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def overrides(args: argparse.Namespace, model_dir: str) -> dict[str, Any]:
    """The preset's settings changed to the benchmark's batch, length and model."""
    return {
        "model.path": model_dir,
        "model.warmup_if_missing": False,
        "rollout.prompts_per_step": args.prompts,
        "rollout.group_size": args.group,
        "rollout.max_new_tokens": args.new_tokens,
        "workers.max_len": 32 + args.new_tokens,
        "workers.slots": args.prompts * args.group,
        "trainer.total_steps": None,  # a constant rate after warm-up: no schedule end
        "trainer.warmup_steps": 0,
        "trainer.checkpoint_every": 0,
        "eval.every_steps": 0,
        "staleness.reload_every": 1,
        "staleness.max_staleness": 1,  # on-policy, as TRL
    }


def trl_missing() -> str | None:
    """What the TRL side needs and this environment lacks (a message), or None; checked before
    anything runs, not minutes in when TRL's side starts."""
    missing = [m for m in ("trl", "datasets") if importlib.util.find_spec(m) is None]
    if not missing:
        return None
    return (
        f"{' and '.join(missing)} not installed, needed by the TRL side: "
        "bash scripts/setup.sh --bench (or --only ours)"
    )


def steps_per_second(times: list[float]) -> float | None:
    """(N - 1) / (t_N - t_1) over the step end times (the first step excluded)."""
    if len(times) < 2 or times[-1] <= times[0]:
        return None
    return (len(times) - 1) / (times[-1] - times[0])


def run_ours(layout: str, args: argparse.Namespace, model_dir: str) -> dict[str, Any]:
    from rlax_tasks.config import load_config
    from rlax_tasks.run.local_run import run_local

    root = tempfile.mkdtemp(prefix=f"rlax-bench-throughput-{layout}-")
    cfg = load_config("tiny-arith", {"run_root": root, "run_id": layout,
                                     **overrides(args, model_dir), **LAYOUTS[layout]})  # fmt: skip
    t0 = time.time()
    run_local(cfg, args.steps, evaluate=False, status_every_s=30.0)
    with open(os.path.join(cfg.run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    times = [float(r["time"]) for r in sorted(rows, key=lambda r: r["step"])]
    shutil.rmtree(root, ignore_errors=True)
    return {
        "label": f"ours-{layout}",
        "steps": len(times),
        "first_step_s": times[0] - t0 if times else None,
        "steps_per_s": steps_per_second(times),
        "completion_tokens_per_step": [r.get("completion_tokens") for r in rows],
    }


def run_trl(args: argparse.Namespace, model_dir: str) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    from benchmarks._trl_side import arithmetic_scorer, preset_config, training_prompts

    cfg = preset_config(model_dir, overrides(args, model_dir))
    pairs = training_prompts(cfg, args.steps * args.prompts)
    dataset = Dataset.from_dict({"prompt": [p for p, _ in pairs],
                                 "reference": [r for _, r in pairs]})  # fmt: skip
    score = arithmetic_scorer(cfg)

    def reward(prompts: list[str], completions: list[str], reference: list[str], **_: Any):
        return [score(p, r, c) for p, r, c in zip(prompts, reference, completions, strict=True)]

    reward.__name__ = "arithmetic"
    out_dir = tempfile.mkdtemp(prefix="rlax-bench-throughput-trl-")
    t = cfg.trainer
    config = GRPOConfig(
        output_dir=out_dir, per_device_train_batch_size=args.prompts * args.group,
        gradient_accumulation_steps=1, num_generations=args.group, num_iterations=1,
        max_completion_length=args.new_tokens, temperature=1.0, top_p=1.0, top_k=0,
        loss_type="grpo", scale_rewards="group", epsilon=0.2, beta=0.0,
        learning_rate=t.learning_rate, max_steps=args.steps, max_grad_norm=t.max_grad_norm,
        shuffle_dataset=False, seed=cfg.seed, use_cpu=True, bf16=False, fp16=False,
        logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True,
        dataloader_num_workers=0, remove_unused_columns=False, log_completions=False,
    )  # fmt: skip
    ends: list[float] = []

    class StepTimes(TrainerCallback):
        def on_step_end(self, args_, state, control, **kw):
            ends.append(time.time())

    t0 = time.time()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=config,
                          train_dataset=dataset, processing_class=tokenizer,
                          callbacks=[StepTimes()])  # fmt: skip
    trainer.remove_callback(PrinterCallback)
    try:
        trainer.train()
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    lengths = [h.get("completions/mean_length") for h in trainer.state.log_history]
    return {
        "label": "trl",
        "steps": len(ends),
        "first_step_s": ends[0] - t0 if ends else None,
        "steps_per_s": steps_per_second(ends),
        "mean_completion_length": [x for x in lengths if x is not None],
        "torch_threads": torch.get_num_threads(),
    }


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--steps", type=int, default=6, help="RL steps of each side")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per step")
    ap.add_argument("--group", type=int, default=4, help="completions per prompt")
    ap.add_argument("--new-tokens", type=int, default=128, help="longest completion")


def run(args: argparse.Namespace, layouts: list[str], only: str | None) -> dict[str, Any]:
    """Both sides on the 30M model, ``args.rounds`` times (ours first in odd rounds, TRL first
    in even ones); prints each round's table and ratios and their median; returns the figures."""
    rounds = args.rounds
    before = _timing.machine_load(log)
    tmp = tempfile.mkdtemp(prefix="rlax-bench-30m-")
    from benchmarks.async_vs_sync import base_model_dir

    model_dir = os.path.join(tmp, "model")
    n = build_model(model_dir, base_model_dir())
    log.info("built the %.1fM-parameter model at %s", n / 1e6, model_dir)
    sides = [f"ours-{layout}" for layout in layouts] if only != "trl" else []
    sides += ["trl"] if only != "ours" else []
    orders = _timing.round_orders(sides, rounds)
    per_round: list[dict[str, dict[str, Any]]] = []
    try:
        for i, order in enumerate(orders):
            if rounds > 1:
                log.info("round %d of %d: %s", i + 1, rounds, ", ".join(order))
            done = {
                label: run_trl(args, model_dir)
                if label == "trl"
                else run_ours(label.removeprefix("ours-"), args, model_dir)
                for label in order
            }
            per_round.append({label: done[label] for label in sides})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    after = _timing.machine_load(log, when="after")
    mark = _timing.contended_mark(before, after)
    print()
    print(
        f"RL steps/s, {n / 1e6:.1f}M-parameter Qwen2 shape, {args.prompts} prompts x "
        f"{args.group} completions of up to {args.new_tokens} tokens, {args.steps} steps (rate "
        f"after the first); {os.cpu_count()} CPUs; {_timing.describe_load(before)}{mark}"
    )
    round_ratios = []
    for i, results in enumerate(per_round):
        if rounds > 1:
            print(f"round {i + 1} of {rounds} (in this order: {', '.join(orders[i])}):")
        for label, r in results.items():
            rate = r["steps_per_s"]
            print(f"  {label:<20} {'n/a' if rate is None else f'{rate:.4f}'} steps/s  "
                  f"(first step done at {r['first_step_s']:.1f}s)")  # fmt: skip
        round_ratios.append(ratios_over_trl(results))
        for label, ratio in round_ratios[-1].items():
            print(f"  {label} / TRL = {ratio:.2f}x  (target >= 2x){mark}")
    ratios = median_ratios(round_ratios)
    if rounds > 1:
        print(f"median over {rounds} rounds:")
        for label, ratio in ratios.items():
            print(f"  {label} / TRL = {ratio:.2f}x  (target >= 2x){mark}")
    return {
        "parameters": n,
        "results": per_round[0],
        "ratios": ratios,
        "rounds": [
            {"order": order, "results": results, "ratios": q}
            for order, results, q in zip(orders, per_round, round_ratios, strict=True)
        ],
        "machine_load": {"before": before, "after": after},
        "args": {k: getattr(args, k) for k in ("steps", "prompts", "group", "new_tokens")},
    }


def ratios_over_trl(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Each of ours' steps/s over TRL's, where both have a rate."""
    trl_rate = (results.get("trl") or {}).get("steps_per_s")
    return {
        label: r["steps_per_s"] / trl_rate
        for label, r in results.items()
        if label.startswith("ours") and trl_rate and r["steps_per_s"]
    }


def median_ratios(round_ratios: list[dict[str, float]]) -> dict[str, float]:
    """Each layout's ratio as the median over the rounds that have one."""
    labels = dict.fromkeys(label for q in round_ratios for label in q)
    return {
        label: statistics.median(q[label] for q in round_ratios if label in q) for label in labels
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_args(ap)
    ap.add_argument("--layouts", default="colocated,disaggregated")
    ap.add_argument("--only", choices=("ours", "trl"), default=None)
    _timing.add_rounds_option(ap)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    if args.only != "ours" and (missing := trl_missing()):
        print(missing, file=sys.stderr)
        return 2
    _timing.setup_logging()
    out = run(args, [x for x in args.layouts.split(",") if x], args.only)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
