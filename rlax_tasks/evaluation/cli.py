"""`rlax eval`: evaluate one model (or two, side by side) on a dataset."""

from __future__ import annotations

import argparse
import os
from typing import Any

from rlax_tasks.data.cli import add_format_args, add_prompt_args, parse_columns, prompt_settings


def parse_ks(text: str) -> tuple[int, ...]:
    """ "1,8" -> (1, 8)."""
    try:
        ks = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError as exc:
        raise ValueError(f"--k must be comma-separated integers, got {text!r}") from exc
    if not ks:
        raise ValueError("--k: give at least one k, e.g. --k 1,8")
    return ks


def add_generation_args(p: argparse.ArgumentParser, max_new_tokens: int = 256) -> None:
    """Sampling and prompt-rendering flags shared by `rlax eval` and `rlax curate`."""
    p.add_argument(
        "--weights-from",
        default=None,
        metavar="RUN_ROOT[@VERSION]",
        help="use the weights a parameter server mirrored under RUN_ROOT/weights "
        "(newest committed version, or @VERSION) on top of --model-dir",
    )
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-len", type=int, default=2048, help="prompt + completion tokens")
    p.add_argument("--max-slots", type=int, default=32, help="sampler batch slots")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    add_prompt_args(p)


def sampling_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling flags as the generators' settings (``PolicySampling``'s fields)."""
    names = ("max_new_tokens", "temperature", "seed", "max_slots", "max_len")
    return {name: getattr(args, name) for name in names}


def make_generator(args: argparse.Namespace, model_dir: str, weights_from: str | None):  # noqa: ANN201
    """A PolicyGenerator for the model at `model_dir` with the sampling and prompt flags."""
    # lazy: JAX loads only when a model does (every `rlax` command builds this parser)
    from rlax_tasks.evaluation.checkpoints import load_model
    from rlax_tasks.evaluation.generation import PolicyGenerator

    settings = prompt_settings(args)  # a bad flag fails before the model loads
    policy = load_model(model_dir, weights_from, args.dtype)
    return PolicyGenerator(policy, prompt=settings, **sampling_settings(args))


def make_episode_generator(args: argparse.Namespace, model_dir: str, weights_from: str | None):  # noqa: ANN201
    """An EpisodeGenerator for ``--environment-from``'s environment, sampling as `make_generator`
    does (its stop strings from the prompt flags)."""
    from rlax_tasks.evaluation.checkpoints import load_model  # lazy: JAX
    from rlax_tasks.evaluation.episodes import EpisodeGenerator, load_environment

    environment = load_environment(args.environment_from)  # a bad config fails before the model
    stop = tuple(prompt_settings(args).stop)
    policy = load_model(model_dir, weights_from, args.dtype)
    return EpisodeGenerator(policy, environment=environment, stop=stop, **sampling_settings(args))


def _run(args: argparse.Namespace) -> int:
    # lazy: pandas and JAX load only when `rlax eval` runs
    from rlax_tasks.data.prompt_source import open_dataset, rejected_note
    from rlax_tasks.evaluation.evaluator import EvalConfig, evaluate
    from rlax_tasks.evaluation.report import write_eval_outputs

    config = EvalConfig(n=args.n, ks=parse_ks(args.k), limit=args.limit)
    dataset = open_dataset(args.dataset, args.format, parse_columns(args.columns), config.limit)
    models = [(args.model_dir, args.weights_from)]
    if args.compare:
        models.append((args.compare, args.compare_weights_from))
    results = []
    for model_dir, weights_from in models:
        if args.environment_from:
            generator = make_episode_generator(args, model_dir, weights_from)
            unusable = None  # it screens each row's episode itself
        else:
            generator = make_generator(args, model_dir, weights_from)
            unusable = generator.unusable
        name = os.path.basename(os.path.normpath(model_dir)) + (
            f"@{weights_from}" if weights_from else ""
        )
        if any(r.name == name for r in results):
            name = f"{name} (compare)"
        results.append(evaluate(dataset.frame, generator, config, name, unusable))
    data = write_eval_outputs(results, args.dataset, args.out)
    for model in data["models"]:
        o = model["overall"]
        metrics = ", ".join(
            f"{k}={o[k]:.3f}"
            for k in o
            if k not in ("prompts", "maj_prompts", "skipped") and o[k] is not None
        )
        skipped = f" ({o['skipped']} skipped: too long or not encodable)" if o["skipped"] else ""
        print(f"{model['name']}: {o['prompts']} prompts{skipped}, {metrics}")
    note = rejected_note(dataset)
    if note:
        print(note)
    print(f"results in {args.out}")
    return 0


def add_eval_parser(sub: argparse._SubParsersAction) -> None:
    """Registers `rlax eval`."""
    p = sub.add_parser("eval", help="pass@k / maj@k evaluation of a model on a dataset")
    p.add_argument("--model-dir", required=True, help="HF model directory")
    p.add_argument("--compare", default=None, help="a second HF model directory, side by side")
    p.add_argument(
        "--compare-weights-from",
        default=None,
        metavar="RUN_ROOT[@VERSION]",
        help="parameter-server mirror weights for the --compare model",
    )
    p.add_argument("--dataset", required=True, help="Parquet/JSONL/CSV file or directory")
    add_format_args(p)
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--k", default="1,8", help="comma-separated k values for pass@k and maj@k")
    p.add_argument("--limit", type=int, default=None, help="evaluate the first N prompts only")
    p.add_argument("--out", required=True, help="output directory (local or gs://)")
    p.add_argument(
        "--environment-from",
        default=None,
        metavar="YAML",
        help="run each row as an episode of this run config's eval.dataset.environment (e.g. "
        "a run's config.yaml), with its tools, scored by the environment as in training",
    )
    add_generation_args(p)
    p.set_defaults(func=_run)
