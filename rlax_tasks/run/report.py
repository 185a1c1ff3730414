"""The end-of-run report: held-out pass@k before and after, and plots users can read.

PNGs under run_dir/eval/: reward per step, pass@k before/after, rollout staleness per step
(step version − rollout version), weight-sync seconds per version."""

from __future__ import annotations

import io
import json
import logging
import time
from typing import Any

import numpy as np

from rlax_tasks.config import RunConfig
from rlax_tasks.controller.mixture import MixtureComponent, PromptMixture, make_source
from rlax_tasks.controller.scoring import reward_and_verdict
from rlax_tasks.controller.service import RewardScorer
from rlax_tasks.data.prompts import PromptRenderer
from rlax_tasks.evaluation import mean_pass_at_k
from rlax_tasks.evaluation.checkpoints import mirror_arrays, with_named_arrays
from rlax_tasks.evaluation.episodes import EpisodeGenerator
from rlax_tasks.evaluation.generation import PolicySampling, encode_prompts
from rlax_tasks.paramserver.mirror import newest_committed
from rlax_tasks.rollout.requests import GroupResult
from rlax_tasks.rundir import storage
from rlax_tasks.rundir.paths import run_paths
from rlax_tasks.utils.progress_meter import ProgressMeter

log = logging.getLogger(__name__)


class HeldOutEvaluator:
    """Held-out pass@k of the run's base model or of weights pulled from the parameter server.

    The first ``eval.num_prompts`` rows of ``eval.dataset``, rendered and scored as in training
    (too-long prompts skipped and counted). One compiled Sampler takes each version's weights, so
    evaluating during a run costs generation only."""

    def __init__(self, cfg: RunConfig) -> None:
        # lazy: `rlax run`'s supervisor imports this module; the model loads only to evaluate
        from rlax_tasks.models import load_pretrained

        spec = cfg.eval.dataset
        if spec is None:
            raise ValueError("eval.dataset: give a held-out dataset to report pass@k on")
        self.cfg, self.name = cfg, spec.name
        self.policy = load_pretrained(cfg.model.path, dtype=cfg.model.dtype)
        self.base_params = self.policy.params
        environment = None if spec.environment is None else spec.environment.to_dict()
        mixture = PromptMixture(
            [MixtureComponent(spec.name, 1.0, make_source(spec), spec.verifier, environment)]
        )
        count = min(cfg.eval.num_prompts, len(mixture.components[0].source))
        prompts = [mixture.prompt(f"{spec.name}/0/{i}", i) for i in range(count)]
        self.renderer = PromptRenderer(cfg.prompt, self.policy.tokenizer)
        # sampled as training samples: seed 0's per-prompt seeds, the workers' slots
        sampling = {"max_new_tokens": cfg.rollout.max_new_tokens, "seed": 0,
                    "temperature": cfg.eval.temperature,
                    "max_slots": cfg.workers.slots}  # fmt: skip
        if spec.environment is None:
            ids, errors = encode_prompts(
                self.renderer,
                [p.content for p in prompts],
                cfg.workers.max_len - cfg.rollout.max_new_tokens,
            )
        else:  # multi-turn pass@k: episodes as in training, turns and observations to max_len
            self.sampling: PolicySampling = EpisodeGenerator(
                self.policy, max_len=cfg.workers.max_len, environment=spec.environment,
                stop=tuple(cfg.prompt.stop), **sampling,
            )  # fmt: skip
            errors = self.sampling.unusable([p.episode_row() for p in prompts])
            ids = []  # the generator tokenizes each episode's turns itself
        self.skipped = [
            {"prompt_id": p.id, "reason": e} for p, e in zip(prompts, errors, strict=True) if e
        ]
        if self.skipped:
            log.warning(
                "held-out %s: %d of %d prompts skipped; first: %s",
                spec.name, len(self.skipped), count, self.skipped[0]["reason"],
            )  # fmt: skip
        self.prompts = [p for p, e in zip(prompts, errors, strict=True) if e is None]
        self.prompt_ids = [list(t) for t in ids if t is not None]
        if not self.prompts:
            raise ValueError(
                f"eval.dataset {spec.name}: no prompt fits ({self.skipped[0]['reason']})"
            )
        self.scorer = RewardScorer(mixture)
        if spec.environment is None:  # one compiled sampler as long as the longest prompt needs
            longest = max(len(t) for t in self.prompt_ids)
            max_len = max(16, longest + cfg.rollout.max_new_tokens)
            self.sampling = PolicySampling(self.policy, max_len=max_len, **sampling)

    def sample(self, params: Any) -> list[list[Any]]:
        """``eval.num_samples`` completions of every prompt with ``params`` (per-prompt seeds),
        for a dataset without an environment."""
        self.sampling.set_params(params)
        settings = self.sampling.row_params(len(self.prompt_ids), self.cfg.prompt.stop)
        n = self.cfg.eval.num_samples
        meter = ProgressMeter("held-out eval", len(self.prompt_ids) * n, logger=log, unit="samples")
        with meter:
            outs = self.sampling.sampler.generate(
                self.prompt_ids, n=n, params=settings, on_complete=lambda _: meter.update()
            )
        return [outs[i * n : (i + 1) * n] for i in range(len(self.prompt_ids))]

    def rewards(self, params: Any, version: int = 0) -> list[list[float]]:
        """Per prompt, the rewards of its ``eval.num_samples`` samples with ``params`` (weight
        ``version``): scored as in training, by the verifiers, or (episodes) by their
        environment."""
        if isinstance(self.sampling, EpisodeGenerator):
            self.sampling.set_params(params)
            scored = self.sampling(
                [p.episode_row() for p in self.prompts], self.cfg.eval.num_samples
            )
            return [[score.reward for _, score in row] for row in scored]
        groups = self.sample(params)
        decode = self.policy.tokenizer.decode
        results = [
            GroupResult(p.id, version, tuple(ids), comps,
                        [decode(c.tokens, skip_special_tokens=True) for c in comps], 0.0)
            for p, ids, comps in zip(self.prompts, self.prompt_ids, groups, strict=True)
        ]  # fmt: skip
        scores = self.scorer.score(self.prompts, results)
        return [[reward_and_verdict(x)[0] for x in row] for row in scores]

    def evaluate(self, ps: Any | None = None, version: int | None = None) -> dict[str, Any]:
        """pass@k of the base model (``ps`` None), else of the newest version (at least
        ``version`` when given)."""
        if ps is None:
            got, params = 0, self.base_params
        elif version is None:
            got, params = ps.pull(like=self.base_params)
        else:  # the trainer records a step just before it pushes that version: wait for it
            got, params = ps.pull(min_version=version, like=self.base_params, timeout_s=60.0)
        t0 = time.perf_counter()
        rewards = self.rewards(params, got)
        e = self.cfg.eval
        correct = [sum(r > 0 for r in row) for row in rewards]
        result: dict[str, Any] = {
            f"pass@{k}": mean_pass_at_k(e.num_samples, correct, k) for k in e.ks
        }
        result["mean_reward"] = float(np.mean(rewards))
        result.update(
            num_prompts=len(self.prompts),
            num_samples=e.num_samples,
            skipped=len(self.skipped),
            seconds=time.perf_counter() - t0,
            version=got,
        )
        log.info(
            "held-out %s at version %d: %s",
            self.name,
            got,
            ", ".join(f"{k} {v:.3f}" for k, v in result.items() if k.startswith("pass@")),
        )
        return result


class MirroredWeights:
    """The newest version mirrored under a run directory, as ``HeldOutEvaluator.evaluate`` pulls
    weights (a finished colocated run's parameter server is gone; its mirror stays)."""

    def __init__(self, run_dir: str, policy: Any) -> None:
        self.run_dir, self.policy = run_dir, policy

    def pull(self, min_version: int | None = None, *, like: Any = None,
             timeout_s: float | None = None) -> tuple[int, Any]:  # fmt: skip
        newest = newest_committed(self.run_dir)  # read only: a version being written stays
        if newest is None:
            raise FileNotFoundError(f"{self.run_dir}/weights: no committed weight version")
        version, arrays = mirror_arrays(self.run_dir, newest)
        if min_version is not None and version < min_version:
            raise FileNotFoundError(
                f"{self.run_dir}/weights: the newest mirrored version is {version}, "
                f"not {min_version}"
            )
        return version, with_named_arrays(self.policy, arrays).params


def write_report(cfg: RunConfig, report: dict[str, Any]) -> dict[str, Any]:
    """Writes eval/report.json, eval/report.md and the PNG plots under the run directory (local
    or gs://); returns their paths."""
    import matplotlib  # lazy: a heavy plotting library, only for the report

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"): pyplot picks its backend on import

    paths = run_paths(cfg.run_dir)
    out_dir = paths.eval
    metrics = storage.read_jsonl(paths.metrics)
    lineage = storage.read_jsonl(paths.lineage)
    syncs = storage.read_jsonl(paths.weight_sync)
    plots = {}

    def save(fig: Any, name: str) -> None:
        path = storage.join(out_dir, f"{name}.png")
        fig.tight_layout()
        png = io.BytesIO()
        fig.savefig(png, format="png", dpi=110)
        plt.close(fig)
        storage.write_bytes(path, png.getvalue())
        plots[name] = path

    fig, ax = plt.subplots(figsize=(6, 3.5))
    steps = [m["step"] for m in metrics if "reward_mean" in m]
    ax.plot(steps, [m["reward_mean"] for m in metrics if "reward_mean" in m], ".-")
    ax.set(xlabel="training step", ylabel="mean reward", title="Reward per step")
    save(fig, "reward")

    before, after = report.get("before") or {}, report.get("after") or {}
    ks = [k for k in before if k.startswith("pass@")]
    progress = storage.read_jsonl(paths.eval_progress)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    if progress:  # eval.every_steps: held-out pass@k per step
        rows = sorted({r["step"]: r for r in progress}.values(), key=lambda r: r["step"])
        for k in ks:
            ax.plot([r["step"] for r in rows], [r.get(k, np.nan) for r in rows], "o-", label=k)
        ax.set(xlabel="training step", ylim=(0, 1), ylabel="held-out", title="pass@k per step")
    else:
        x = np.arange(len(ks))
        ax.bar(x - 0.2, [before[k] for k in ks], 0.4, label="before")
        ax.bar(x + 0.2, [after.get(k, np.nan) for k in ks], 0.4, label="after")
        ax.set_xticks(x, ks)
        ax.set(ylim=(0, 1), ylabel="held-out", title="pass@k before and after")
    ax.legend()
    save(fig, "pass_at_k")

    fig, ax = plt.subplots(figsize=(6, 3.5))
    stale = [
        (r["step"], float(np.mean([r["version"] - v for v in r["rollout_versions"]])))
        for r in lineage
        if r.get("rollout_versions")
    ]
    if stale:
        ax.plot(*zip(*stale, strict=True), ".-")
    ax.set(xlabel="training step", ylabel="v - u (mean)", title="Rollout staleness")
    save(fig, "staleness")

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([s["step"] for s in syncs], [s["push_s"] for s in syncs], ".-")
    ax.set(xlabel="version", ylabel="seconds", title="Weight push to the parameter server")
    save(fig, "weight_sync")

    summary = {
        "before": before,
        "after": after,
        "delta": {k: after.get(k, np.nan) - before[k] for k in ks},
        "train_seconds": report.get("train_seconds"),
        "restarts": report.get("restarts"),
        "plots": plots,
    }
    storage.write_bytes(
        paths.report_json,
        json.dumps(summary, indent=2, default=float).encode("utf-8"),
    )
    lines = [
        f"# RLAX run {cfg.run_id}",
        "",
        f"Training: {report.get('steps')} steps in {report.get('train_seconds', 0):.0f} s.",
        "",
        "| metric | before | after | change |",
        "|---|---|---|---|",
        *[
            f"| {k} | {before[k]:.3f} | {after.get(k, float('nan')):.3f} | "
            f"{summary['delta'][k]:+.3f} |"
            for k in ks
        ],
        "",
        *[f"![{name}]({name}.png)" for name in plots],
    ]
    storage.write_bytes(paths.report_md, ("\n".join(lines) + "\n").encode())
    print("\n".join(lines[: 6 + len(ks)]))
    return {"report": paths.report_md, "plots": plots}
