"""vs_trl.py's TRL side and its shared set-up: the preset's prompts and reward, TRL's
``GRPOTrainer`` with the preset's hyper-parameters mapped onto it (in a fresh process, its
imports on its clock), and the held-out evaluators of the torch model (paused clocks)."""

from __future__ import annotations

import logging
import shutil
import statistics
import tempfile
import time
from typing import Any

from benchmarks import _timing
from benchmarks.async_vs_sync import PRESET

log = logging.getLogger("benchmarks.vs_trl")


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
