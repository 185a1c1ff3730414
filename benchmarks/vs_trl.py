"""Ours (`rlax run`, tiny-arith; colocated and disaggregated) vs TRL's ``GRPOTrainer`` (PyTorch
CPU): wall-clock time to the same held-out pass@1 target, from the same base model, prompts,
reward and mapped hyper-parameters, evaluated by the same evaluator with both clocks paused
(benchmarks/README.md: what each clock counts). ``--rounds N`` alternates the order and reports
the median ratio; ``--model-size 30m``: rl_throughput.py. Needs ``scripts/setup.sh --bench``."""

from __future__ import annotations

import argparse
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

from benchmarks import _timing, rl_throughput  # noqa: E402
from benchmarks.async_vs_sync import (  # noqa: E402
    PRESET,
    after_first_step,
    base_model_dir,
    fmt_value,
    print_curves,
    print_table,
    run_ours,
    time_to_target,
)

log = logging.getLogger("benchmarks.vs_trl")

# ours' layouts (placement.mode): the preset's own (colocated) and the paper's separate jobs
LAYOUTS: dict[str, dict[str, Any]] = {
    "colocated": {"placement.mode": "colocated", "workers.count": 1, "workers.slots": 256},
    "disaggregated": {"placement.mode": "disaggregated", "workers.count": 2, "workers.slots": 128},
}


# ------------------------------------------------------------------------------------ data
def preset_config(model_dir: str, overrides: dict[str, Any] | None = None) -> Any:
    from rlax_tasks.config import load_config

    return load_config(PRESET, {"model.path": model_dir, **(overrides or {})})


def training_prompts(cfg: Any, n: int) -> list[tuple[str, str]]:
    """The first ``n`` (prompt, reference) pairs the controller draws (same mixture, same seed)."""
    from rlax_tasks.controller.mixture import PromptMixture

    mixture = PromptMixture.from_specs(cfg.datasets, seed=cfg.seed)
    return [(p.content, p.reference) for p in mixture.take(n)]


def heldout(cfg: Any) -> tuple[Any, list[Any]]:
    """(TinyArith format, problems) of the preset's held-out evaluation set."""
    from rlax_tasks.warmup import TinyArith

    source = cfg.eval.dataset.source
    fmt = TinyArith(dict(source.knobs))
    return fmt, fmt.problems(cfg.eval.num_prompts, seed=source.seed)


def arithmetic_scorer(cfg: Any) -> Any:
    """reward(prompt, reference, completion_text): the task's own verifier, as the controller."""
    from rlax_tasks.rewards.tasks import Problem
    from rlax_tasks.warmup import TinyArith

    fmt = TinyArith(dict(cfg.datasets[0].source.knobs))

    def score(prompt: str, reference: str, text: str) -> float:
        return float(fmt.score(Problem(fmt.task.name, "", prompt, reference), text))

    return score


# ------------------------------------------------------------------------------------ TRL
class TorchHeldOut:
    """Held-out pass@k of the torch model: ``generate`` sampled at the eval temperature."""

    def __init__(self, cfg: Any, tokenizer: Any) -> None:
        import torch
        from transformers import GenerationConfig

        self.fmt, self.problems = heldout(cfg)
        self.tokenizer, self.n, self.ks = tokenizer, cfg.eval.num_samples, list(cfg.eval.ks)
        prompts = [self.fmt.encode_prompt(tokenizer, p) for p in self.problems]
        width = max(len(p) for p in prompts)
        pad = tokenizer.pad_token_id
        self.input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        self.attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        self.generation = GenerationConfig(
            do_sample=True,
            temperature=cfg.eval.temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=cfg.rollout.max_new_tokens,
            num_return_sequences=self.n,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=pad,
            bos_token_id=tokenizer.bos_token_id,
        )

    def evaluate(self, model: Any, step: int) -> dict[str, Any]:
        import torch

        from rlax_tasks.warmup.pass_rates import score_pass_rates

        t0 = time.perf_counter()
        was_training = model.training
        model.eval()
        with torch.random.fork_rng(), torch.no_grad():  # leave the training RNG untouched
            torch.manual_seed(step)
            out = model.generate(
                input_ids=self.input_ids,
                attention_mask=self.attention,
                generation_config=self.generation,
            )
        model.train(was_training)
        completions = out[:, self.input_ids.shape[1] :].tolist()
        eos = self.tokenizer.eos_token_id
        completions = [c[: c.index(eos) + 1] if eos in c else c for c in completions]
        scores = score_pass_rates(
            self.fmt, self.tokenizer, self.problems, completions, self.n, self.ks
        )
        result = {k: v for k, v in scores.items() if k.startswith("pass@")}
        result["eval_seconds"] = time.perf_counter() - t0
        return result


class RlaxHeldOut:
    """Held-out pass@k of the torch model's weights with the evaluator ``rlax run`` uses
    (``HeldOutEvaluator``: the same problems, JAX Sampler and seeds as ours' progress.jsonl)."""

    def __init__(self, cfg: Any) -> None:
        from rlax_tasks.run.report import HeldOutEvaluator

        self.evaluator, self.dtype = HeldOutEvaluator(cfg), cfg.model.dtype
        self.tmp = tempfile.mkdtemp(prefix="rlax-bench-trl-weights-")

    def evaluate(self, model: Any, step: int) -> dict[str, Any]:
        from rlax_tasks.models import hf_io

        t0 = time.perf_counter()
        model.save_pretrained(self.tmp)  # HF safetensors, read back like any HF checkpoint
        # the hand-over of the weights to the evaluator: on TRL's clock, as ours (its push to
        # the parameter server every eval.every_steps) is on ours
        handover = time.perf_counter() - t0
        params = hf_io.read_params(self.tmp, self.evaluator.base_params, self.dtype)

        class Weights:  # what HeldOutEvaluator.evaluate pulls from (a parameter server)
            def pull(self, like: Any = None) -> tuple[int, Any]:
                return step, params

        res = self.evaluator.evaluate(Weights())
        out = {k: v for k, v in res.items() if k.startswith("pass@")}
        out["eval_seconds"] = time.perf_counter() - t0
        out["handover_seconds"] = handover
        return out


def exact_pass_at_1(cfg: Any, model: Any, tokenizer: Any) -> float:
    """Mean over the held-out problems of P(answer + <eos> | prompt) under the torch model.

    pass@1 at temperature 1 without sampling noise (a slight lower bound: another completion with
    the same final integer also scores 1). A check on the sampled estimates.
    """
    import torch

    fmt, problems = heldout(cfg)
    rows = [fmt.encode_example(tokenizer, p) for p in problems]
    width = max(len(ids) for ids, _ in rows)
    ids = torch.tensor([i + [tokenizer.pad_token_id] * (width - len(i)) for i, _ in rows])
    att = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i, _ in rows])
    mask = torch.tensor([m + [0] * (width - len(m)) for _, m in rows], dtype=torch.float32)
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids, attention_mask=att).logits.float(), -1)
    token_lp = torch.gather(logp[:, :-1], 2, ids[:, 1:, None])[..., 0]
    return float(torch.exp((token_lp * mask[:, 1:]).sum(1)).mean())


def run_trl(
    cfg: Any,
    model_dir: str,
    *,
    max_steps: int,
    max_seconds: float,
    eval_every: int,
    target: float | None,
    early_stop: bool,
    evaluation: str = "rlax",
    started: float | None = None,
    off_clock: float = 0.0,
) -> dict[str, Any]:
    """TRL's GRPOTrainer on the same model, data, reward and hyper-parameters as the preset.
    ``started``: the monotonic time its clock starts at (``run_trl_fresh``: before this process
    was launched, so its imports count; default now). ``off_clock``: seconds of the benchmark's
    own set-up before the call, taken off the clock like the prompt list and evaluator here."""
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    r, t = cfg.rollout, cfg.trainer
    if cfg.algorithm.preset != "grpo":
        raise ValueError(f"the TRL mapping covers the grpo preset, not {cfg.algorithm.preset!r}")
    schedule_steps = t.total_steps or max_steps
    imported = time.monotonic()
    # the benchmark's set-up, off the clock: ours' controller draws the same prompts on its own
    pairs = training_prompts(cfg, max_steps * r.prompts_per_step)
    off_clock += time.monotonic() - imported
    dataset = Dataset.from_dict(
        {"prompt": [p for p, _ in pairs], "reference": [ref for _, ref in pairs]}
    )
    score = arithmetic_scorer(cfg)

    def reward(prompts: list[str], completions: list[str], reference: list[str], **_: Any):
        return [score(p, ref, c) for p, ref, c in zip(prompts, reference, completions, strict=True)]

    reward.__name__ = "arithmetic"
    out_dir = tempfile.mkdtemp(prefix="rlax-bench-trl-")
    args = GRPOConfig(
        output_dir=out_dir,
        # one optimizer step per generated batch of 32 prompts x 8 completions, like ours
        per_device_train_batch_size=r.prompts_per_step * r.group_size,
        gradient_accumulation_steps=1,
        num_generations=r.group_size,
        num_iterations=1,
        max_completion_length=r.max_new_tokens,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=0,
        # GRPO: (R - mean) / std per group, PPO clip, mean over each sequence's tokens, no KL
        loss_type="grpo",
        scale_rewards="group",
        epsilon=0.2,
        beta=0.0,
        learning_rate=t.learning_rate,
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": t.final_lr_ratio},
        warmup_steps=t.warmup_steps,
        max_steps=schedule_steps,
        weight_decay=t.weight_decay,
        adam_beta1=t.adam_b1,
        adam_beta2=t.adam_b2,
        adam_epsilon=t.adam_eps,
        max_grad_norm=t.max_grad_norm,
        shuffle_dataset=False,
        seed=cfg.seed,
        use_cpu=True,
        bf16=False,
        fp16=False,
        logging_steps=10,  # log_history: the mean reward of every 10 steps
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
        remove_unused_columns=False,
        log_completions=False,
    )
    log.info(
        "TRL %s, torch %s (%d threads): GRPO, %d prompts x %d, lr %g, schedule over %d steps",
        trl.__version__,
        torch.__version__,
        torch.get_num_threads(),
        r.prompts_per_step,
        r.group_size,
        t.learning_rate,
        schedule_steps,
    )

    state: dict[str, Any] = {
        "paused": 0.0,  # evaluation
        "off_clock": 0.0,  # the benchmark's set-up (``started`` given)
        "rows": [],
        "stopped": "max-steps",
        "intervals": [],
    }

    class HeldOutCallback(TrainerCallback):
        def __init__(self, evaluator: Any) -> None:
            self.evaluator = evaluator
            self.last_step_end: float | None = None

        def clock(self) -> float:
            return time.monotonic() - state["t0"] - state["paused"] - state["off_clock"]

        def _evaluate(self, model: Any, step: int, produced: float) -> dict[str, Any]:
            t0 = time.monotonic()
            res = self.evaluator.evaluate(model, step)
            row = {"version": step, "seconds": round(produced, 3), **res}
            state["rows"].append(row)
            state["paused"] += time.monotonic() - t0 - res.get("handover_seconds", 0.0)
            log.info(
                "[trl] held-out at step %d (%.1fs of training): pass@1 %.3f, pass@8 %.3f "
                "(eval %.1fs)",
                step,
                produced,
                res.get("pass@1", float("nan")),
                res.get("pass@8", float("nan")),
                res["eval_seconds"],
            )
            return row

        def on_train_begin(self, args, state_, control, model=None, **kw):
            self._evaluate(model, 0, 0.0)
            state["train_begin"] = self.clock()

        def on_step_end(self, args, state_, control, model=None, **kw):
            now = self.clock()
            if self.last_step_end is not None:
                state["intervals"].append(now - self.last_step_end)
            step = state_.global_step
            state.setdefault("first_step_seconds", now)
            state["steps"] = step
            state["train_seconds"] = now
            if step % eval_every == 0 or step >= max_steps:
                row = self._evaluate(model, step, now)
                if early_stop and target is not None and row["pass@1"] >= target:
                    state["stopped"] = "target"
                    control.should_training_stop = True
            if now >= max_seconds and not control.should_training_stop:
                state["stopped"] = "max-seconds"
                control.should_training_stop = True
            if step >= max_steps:
                control.should_training_stop = True
            if step % 10 == 0:
                log.info("[trl] step %d/%d  %.1fs of training", step, max_steps, now)
            self.last_step_end = self.clock()

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    built = time.monotonic()
    evaluator = RlaxHeldOut(cfg) if evaluation == "rlax" else TorchHeldOut(cfg, tokenizer)
    off_clock += time.monotonic() - built
    if started is None:
        state["t0"] = time.monotonic()  # before the model is loaded
    else:
        state["t0"], state["off_clock"] = started, off_clock
        state["imports_seconds"] = imported - started
        log.info("[trl] interpreter start and imports: %.1fs, on its clock", imported - started)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[reward],
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[HeldOutCallback(evaluator)],
    )
    trainer.remove_callback(PrinterCallback)  # no metrics dict on stdout every log step
    try:
        trainer.train()
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
        if isinstance(evaluator, RlaxHeldOut):
            shutil.rmtree(evaluator.tmp, ignore_errors=True)
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    intervals = state["intervals"]
    steps = state.get("steps", 0)
    return {
        "label": "trl",
        "steps": steps,
        "stopped": state["stopped"],
        "train_seconds": state.get("train_seconds"),
        "startup_seconds": state.get("train_begin"),
        "imports_seconds": state.get("imports_seconds"),
        "setup_seconds_off_clock": state["off_clock"],
        "first_step_seconds": state.get("first_step_seconds"),
        "seconds_per_step_total": state["train_seconds"] / steps if steps else None,
        "step_interval_median": statistics.median(intervals) if intervals else None,
        "step_interval_mean": statistics.fmean(intervals) if intervals else None,
        "curve": [
            {k: row.get(k) for k in ("version", "seconds", "pass@1", "pass@8")}
            for row in state["rows"]
        ],
        "eval_seconds_total": state["paused"],
        # save_pretrained for the evaluator: on the clock (see the module docstring)
        "handover_seconds_total": sum(row.get("handover_seconds", 0.0) for row in state["rows"]),
        # log_history has one row per 10 steps (logging_steps), each the mean over its steps
        "reward_last10": rewards[-1] if rewards else None,
        "versions": {"trl": trl.__version__, "torch": torch.__version__},
    }


def run_trl_fresh(
    model_dir: str, overrides: dict[str, Any], *, torch_threads: int | None = None, **kw: Any
) -> dict[str, Any]:
    """``run_trl`` in a fresh Python process, its clock started before that process is launched:
    TRL's imports (torch, transformers, TRL) count, as ours' do in the
    processes ``run_local`` starts; in this process they would already be loaded."""
    return _timing.run_in_fresh_process(_trl_process, model_dir, overrides, torch_threads, kw)


def _trl_process(
    model_dir: str,
    overrides: dict[str, Any],
    torch_threads: int | None,
    kw: dict[str, Any],
    *,
    launched: float,
) -> dict[str, Any]:
    _timing.setup_logging()
    t0 = time.monotonic()
    cfg = preset_config(model_dir, overrides)  # the benchmark's set-up: off the clock
    off_clock = time.monotonic() - t0
    if torch_threads:
        import torch

        torch.set_num_threads(torch_threads)
    return run_trl(cfg, model_dir, started=launched, off_clock=off_clock, **kw)


# ------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--gain", type=float, default=0.15, help="target = base pass@1 + gain")
    ap.add_argument("--target", type=float, default=None, help="absolute held-out pass@1 target")
    ap.add_argument("--eval-every", type=int, default=10, help="held-out pass@k every N steps")
    ap.add_argument("--max-steps", type=int, default=300, help="cap on training steps (each)")
    ap.add_argument(
        "--max-seconds", type=float, default=900.0, help="cap on training seconds (each)"
    )
    ap.add_argument("--no-early-stop", action="store_true", help="run on to the caps")
    ap.add_argument("--reload-every", type=int, default=None, help="ours: j (default: preset)")
    ap.add_argument("--max-staleness", type=int, default=None, help="ours: k (default: preset)")
    ap.add_argument("--only", choices=("ours", "trl"), default=None, help="run one side only")
    ap.add_argument(
        "--trl-eval",
        choices=("rlax", "torch"),
        default="rlax",
        help="how TRL's held-out pass@k is measured: rlax = the evaluator ours uses, on TRL's\n"
        "weights (same sampler and seeds); torch = transformers generate on the torch model",
    )
    ap.add_argument("--torch-threads", type=int, default=None, help="TRL: torch.set_num_threads")
    ap.add_argument(
        "--compilation-cache",
        default=None,
        help="ours: JAX compilation cache directory kept across invocations (a second run\n"
        "starts warm); default: a fresh one per run, i.e. a first run's compile times",
    )
    ap.add_argument(
        "--eval-beside-training",
        action="store_true",
        help="ours: keep training while the held-out evaluation samples (competing for the\n"
        "CPU) instead of holding the run still and taking the pauses off its clock",
    )
    _timing.add_rounds_option(ap)
    ap.add_argument(
        "--layouts",
        default="colocated,disaggregated",
        help="ours: the placement modes to run, side by side (comma-separated)",
    )
    ap.add_argument(
        "--model-size",
        choices=("tiny", "30m"),
        default="tiny",
        help="tiny: time to the held-out target on the preset's model; 30m: RL steps per\n"
        "second on a 30M-parameter Qwen2-shaped model (benchmarks/rl_throughput.py)",
    )
    rl_throughput.add_args(ap.add_argument_group("--model-size 30m"))
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    unknown = sorted(set(layouts) - set(LAYOUTS))
    if unknown or not layouts:
        ap.error(f"--layouts: {unknown or 'none'}; choose from {', '.join(LAYOUTS)}")
    if args.only != "ours" and (missing := rl_throughput.trl_missing()):
        print(missing, file=sys.stderr)
        return 2
    _timing.setup_logging()
    if args.model_size == "30m":
        out = rl_throughput.run(args, layouts, args.only)
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump(out, f, indent=2)
        return 0
    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
    load_before = _timing.machine_load(log)
    busy = load_before["busy_cores"]
    model_dir = base_model_dir()
    cache_state = "cold (a fresh cache per run)"
    if args.compilation_cache:
        from rlax_tasks.plan.compilation_cache import DIR_ENV

        os.makedirs(args.compilation_cache, exist_ok=True)
        entries = len(os.listdir(args.compilation_cache))
        cache_state = f"{args.compilation_cache}: {entries} entries at start"
        os.environ[DIR_ENV] = os.path.abspath(args.compilation_cache)
    ours_overrides: dict[str, Any] = {"eval.every_steps": args.eval_every}
    if args.reload_every is not None:
        ours_overrides["staleness.reload_every"] = args.reload_every
    if args.max_staleness is not None:
        ours_overrides["staleness.max_staleness"] = args.max_staleness
    # the learning-rate schedule decays to its end over trainer.total_steps (the preset's run
    # length): a longer cap stretches it, on both sides
    if args.max_steps > (preset_config(model_dir).trainer.total_steps or 0):
        ours_overrides["trainer.total_steps"] = args.max_steps
    cfg = preset_config(model_dir, ours_overrides)

    # one target for both sides, from the base model's held-out pass@1 measured by the evaluator
    # of the run report; beside it, two checks of that estimate on the same base weights
    from rlax_tasks.run.report import HeldOutEvaluator

    base = HeldOutEvaluator(cfg).evaluate()["pass@1"]
    target = args.target if args.target is not None else base + args.gain
    checks = base_checks(cfg, model_dir)
    log.info(
        "base held-out pass@1: %.3f (rlax evaluator), %.3f (torch generate), %.3f (exact); "
        "target %.3f",
        base,
        checks["torch_sampled"],
        checks["exact"],
        target,
    )
    early = not args.no_early_stop

    def stop_when(rows: list[dict[str, Any]], elapsed: float) -> str | None:
        if early and time_to_target(rows, target) is not None:
            return "target"
        if elapsed > args.max_seconds:
            return "max-seconds"
        return None

    def run_side(label: str) -> dict[str, Any]:
        if label == "trl":
            result = run_trl_fresh(
                model_dir,
                ours_overrides,
                torch_threads=args.torch_threads,
                max_steps=args.max_steps,
                max_seconds=args.max_seconds,
                eval_every=args.eval_every,
                target=target,
                early_stop=early,
                evaluation=args.trl_eval,
            )
        else:
            result = run_ours(
                label,
                {**ours_overrides, **LAYOUTS[label.removeprefix("ours-")]},
                args.max_steps,
                model_dir=model_dir,
                stop_when=stop_when,
                pause_for_eval=not args.eval_beside_training,
            )
        result["time_to_target"] = time_to_target(result["curve"], target)
        return result

    sides = [f"ours-{layout}" for layout in layouts] if args.only != "trl" else []
    sides += ["trl"] if args.only != "ours" else []
    orders = _timing.round_orders(sides, args.rounds)
    rounds: list[dict[str, dict[str, Any]]] = []
    for i, order in enumerate(orders):
        if args.rounds > 1:
            log.info("round %d of %d: %s", i + 1, args.rounds, ", ".join(order))
        done = {label: run_side(label) for label in order}
        rounds.append({label: done[label] for label in sides})

    s = cfg.staleness
    print()
    print(
        f"tiny-arith: ours (rlax run, j={s.reload_every}, k={s.max_staleness}; "
        f"{', '.join(layouts)}) vs TRL GRPOTrainer (PyTorch CPU), {os.cpu_count()} CPUs "
        f"(before start: {_timing.describe_load(load_before)}); "
        f"ours' JAX compilation cache: {cache_state}"
    )
    print(
        f"target held-out pass@1 {target:.3f}"
        + (f" (base {base:.3f} + {args.gain})" if args.target is None else "")
        + f", eval every {args.eval_every} steps ({args.trl_eval} evaluator for TRL), caps "
        f"{args.max_steps} steps / {args.max_seconds:.0f}s"
    )
    print(
        f"base pass@1 check: rlax evaluator {base:.3f}, torch generate "
        f"{checks['torch_sampled']:.3f}, exact P(answer<eos>) {checks['exact']:.3f} (a gap "
        "beyond ~0.03 means an evaluator's samples are not independent)"
    )
    lines = [
        ("time to target", lambda r: _ttt(r["time_to_target"])),
        ("  of which after 1st step", lambda r: _ttt(after_first_step(r))),
        ("steps to target", lambda r: fmt_value((r["time_to_target"] or {}).get("step"), "{}")),
        ("steps run", lambda r: str(r["steps"])),
        ("stopped by", lambda r: r["stopped"]),
        ("training seconds", lambda r: fmt_value(r["train_seconds"], "{:.1f}")),
        ("first step done at s", lambda r: fmt_value(r["first_step_seconds"], "{:.1f}")),
        (
            "evaluation s, off the clock",
            lambda r: fmt_value(
                r.get("eval_pause_seconds") or r.get("eval_seconds_total"), "{:.1f}"
            ),
        ),
        (
            "save_pretrained for eval s, on the clock",
            lambda r: fmt_value(r.get("handover_seconds_total"), "{:.2f}"),
        ),
        ("s/step (median interval)", lambda r: fmt_value(r["step_interval_median"])),
        ("s/step (mean interval)", lambda r: fmt_value(r["step_interval_mean"])),
        ("pass@1 at step 0", lambda r: fmt_value(r["curve"][0]["pass@1"] if r["curve"] else None)),
        ("best pass@1", lambda r: fmt_value(max((c["pass@1"] for c in r["curve"]), default=None))),
        ("mean reward, last 10 steps", lambda r: fmt_value(r["reward_last10"])),
    ]
    for i, results in enumerate(rounds):
        if len(rounds) > 1:
            print()
            print(f"round {i + 1} of {len(rounds)} (in this order: {', '.join(orders[i])}):")
        print_table(list(results.items()), lines)
        print()
        print_curves(
            results,
            "held-out pass@1 by step (seconds of training when that step's weights existed):",
        )
    load_after = _timing.machine_load(log, when="after")
    print()
    print(f"ratios{_timing.contended_mark(load_before, load_after) or ' (quiet machine)'}:")
    per_round: list[dict[str, dict[str, float | None]]] = []
    for i, results in enumerate(rounds):
        if len(rounds) > 1:
            print(f"round {i + 1}:")
        per_round.append({k: _ratios(results, k) for k in results if k.startswith("ours")})
    ratios = median_ratios(per_round)
    if len(rounds) > 1:
        print(f"median over {len(rounds)} rounds:")
        for label, r in ratios.items():
            print(f"  {label}: TRL / ours = {_times(r['end_to_end'])} end to end, "
                  f"{_times(r['from_first_step'])} from each side's first step")  # fmt: skip
    print(f"peak RSS of this process: {_timing.peak_rss_bytes() / 2**20:.0f} MiB")
    ratio = (ratios.get("ours-colocated") or next(iter(ratios.values()), {})).get("end_to_end")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(
                {
                    "target": target,
                    "base_pass@1": base,
                    "base_checks": checks,
                    "trl_eval": args.trl_eval,
                    "eval_every": args.eval_every,
                    "max_steps": args.max_steps,
                    "max_seconds": args.max_seconds,
                    "cpu_count": os.cpu_count(),
                    "busy_cores_before": busy,
                    "results": rounds[0],
                    "ratio_trl_over_ours": ratio,
                    "ratios_trl_over_ours": ratios,
                    "rounds": [
                        {"results": r, "ratios_trl_over_ours": q}
                        for r, q in zip(rounds, per_round, strict=True)
                    ],
                    "layouts": layouts,
                    "machine_load": {"before": load_before, "after": load_after},
                    "compilation_cache": cache_state,
                },
                f,
                indent=2,
            )
        log.info("wrote %s", args.json_out)
    return 0


def median_ratios(
    per_round: list[dict[str, dict[str, float | None]]],
) -> dict[str, dict[str, float | None]]:
    """Each layout's ratios (end to end, from the first step) as the median over the rounds that
    have one (None when none has)."""
    out: dict[str, dict[str, float | None]] = {}
    for label in per_round[0] if per_round else {}:
        out[label] = {}
        for kind in ("end_to_end", "from_first_step"):
            values = [r[label][kind] for r in per_round if r[label][kind] is not None]
            out[label][kind] = statistics.median(values) if values else None
    return out


def _times(ratio: float | None) -> str:
    return "n/a" if ratio is None else f"{ratio:.2f}x"


def base_checks(cfg: Any, model_dir: str) -> dict[str, float]:
    """The base model's held-out pass@1 by torch sampling and exactly (teacher-forced)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return {
        "torch_sampled": TorchHeldOut(cfg, tokenizer).evaluate(model, 0)["pass@1"],
        "exact": exact_pass_at_1(cfg, model, tokenizer),
    }


def _ttt(t: dict[str, Any] | None) -> str:
    return "not reached" if t is None else f"{t['seconds']:.1f}s"


def _ratios(results: dict[str, dict[str, Any]], label: str) -> dict[str, float | None]:
    """Prints and returns TRL's time to target over ``label``'s: end to end and counted from
    each side's first training step."""
    out: dict[str, float | None] = {"end_to_end": None, "from_first_step": None}
    ours_t = results[label]["time_to_target"]
    trl_t = (results.get("trl") or {}).get("time_to_target")
    if "trl" not in results:
        return out
    if ours_t and trl_t:
        out["end_to_end"] = trl_t["seconds"] / ours_t["seconds"]
        print(f"{label}: TRL time / ours = {out['end_to_end']:.2f}x end to end")
        steady = [after_first_step(results[k]) for k in (label, "trl")]
        if all(steady):
            out["from_first_step"] = steady[1]["seconds"] / steady[0]["seconds"]
            print(
                f"  counted from each side's first training step (start-up and first compile "
                f"excluded): TRL / ours = {out['from_first_step']:.2f}x"
            )
        return out
    bound = _lower_bound(results, label)
    print(
        f"{label}: TRL time / ours: n/a, the target was not reached by "
        + " and ".join(k for k in (label, "trl") if results[k]["time_to_target"] is None)
        + (f" (a lower bound: {bound})" if bound else "")
    )
    return out


def _lower_bound(results: dict[str, dict[str, Any]], label: str) -> str:
    """When only ours reached the target: TRL's training time so far over ours (a lower bound)."""
    ours, trl_r = results[label], results["trl"]
    if ours["time_to_target"] and not trl_r["time_to_target"] and trl_r["train_seconds"]:
        return f"TRL / ours > {trl_r['train_seconds'] / ours['time_to_target']['seconds']:.2f}x"
    if trl_r["time_to_target"] and not ours["time_to_target"] and ours["train_seconds"]:
        return f"TRL / ours < {trl_r['time_to_target']['seconds'] / ours['train_seconds']:.2f}x"
    return ""


if __name__ == "__main__":
    sys.exit(main())
