"""`rlax data episodes RUN_DIR`: a run's trained episodes turn by turn (docs/design.md §15), each
span marked as the model's (trained on) or an observation (masked out of the loss), decoded
with the run's tokenizer from its rollouts files."""

from __future__ import annotations

import argparse
import os
import textwrap
from collections.abc import Sequence
from typing import Any

from rlax_tasks.rundir import storage
from rlax_tasks.rundir.paths import run_paths


def spans(mask: Sequence[int]) -> list[tuple[int, int, int]]:
    """(start, end, mask value) of each run of equal values in ``mask``."""
    out: list[tuple[int, int, int]] = []
    for i, m in enumerate(mask):
        if out and out[-1][2] == m:
            out[-1] = (out[-1][0], i + 1, m)
        else:
            out.append((i, i + 1, int(m)))
    return out


def episode_lines(
    prompt: Sequence[int], tokens: Sequence[int], mask: Sequence[int], tokenizer: Any
) -> list[str]:
    """An episode as text: its prompt, then each span of model tokens and of observation."""
    decode = tokenizer.decode
    lines = [f"  prompt ({len(prompt)} tokens):", _indent(decode(list(prompt)))]
    turn = 0
    for start, end, trained in spans(mask):
        if trained:
            turn += 1
            lines.append(f"  model turn {turn} ({end - start} tokens, trained):")
        else:
            lines.append(f"  observation ({end - start} tokens, masked out of the loss):")
        lines.append(_indent(decode(list(tokens[start:end]))))
    return lines


def _indent(text: str) -> str:
    return textwrap.indent(text, "    | ", lambda _: True)


def _model_dir(run_dir: str, given: str | None) -> str:
    if given:
        return given
    import yaml  # lazy: only this command reads the run's config

    config = run_paths(run_dir).config
    try:
        raw = yaml.safe_load(storage.read_bytes(config))
        return str(raw["model"]["path"])
    except (FileNotFoundError, KeyError, TypeError) as e:
        raise ValueError(
            f"{run_dir}: no model.path in {config} ({e}); give --model-dir for the tokenizer"
        ) from None


def preview_episodes(args: argparse.Namespace) -> int:
    """Prints the first ``-n`` episodes of the run's rollouts (of ``--step``, else any)."""
    from rlax_tasks.controller import read_rollouts  # lazy: pandas and pyarrow
    from rlax_tasks.models.tokenizer_loading import load_tokenizer

    if not storage.exists(args.run_dir) and not os.path.isdir(args.run_dir):
        raise FileNotFoundError(f"{args.run_dir}: no such run directory")
    rows = read_rollouts(args.run_dir)
    if len(rows) == 0:
        raise ValueError(f"{args.run_dir}: no rollouts yet (rollouts/step-*.parquet)")
    if args.step is not None:
        rows = rows[rows["step"] == args.step]
    if "loss_mask" in rows:
        rows = rows[rows["loss_mask"].notna()]
    if len(rows) == 0:
        where = f" at step {args.step}" if args.step is not None else ""
        raise ValueError(f"{args.run_dir}: no episode in its rollouts{where} (no environment?)")
    tokenizer = load_tokenizer(_model_dir(args.run_dir, args.model_dir))
    for _, row in rows.head(args.n).iterrows():
        print(f"\nstep {row['step']}, {row['prompt_id']} sample {row['sample']}: reward "
              f"{row['reward']:g}, {row['finish_reason']}, {row['episode'] or ''}")  # fmt: skip
        for line in episode_lines(row["prompt_tokens"], row["tokens"], row["loss_mask"], tokenizer):
            print(line)
    return 0
