"""`rlax data preview` and the dataset / prompt flags that `rlax curate` and `rlax eval` share.

``rlax data preview FILE --format NAME [--model-dir DIR] [-n 3]`` prints the first rows as the
sampler will see them (text, token count, parsed references) and the unusable rows with why."""

from __future__ import annotations

import argparse
import json
import os
import textwrap
from typing import Any

import yaml

from rlax_tasks.data.formats import FORMAT_NAMES
from rlax_tasks.data.prompts import TEMPLATES, PromptRenderer, PromptSettings, PromptSettingsError
from rlax_tasks.rundir import storage


# --------------------------------------------------------------------------- shared flags
def add_format_args(p: argparse.ArgumentParser) -> None:
    """--format and --columns: how the input files' layout maps to rows."""
    p.add_argument(
        "--format",
        default="rlax",
        choices=FORMAT_NAMES,
        help="input layout: rlax (the row schema), gsm8k, math, dapo, messages, code, or "
        "columns (with --columns)",
    )
    p.add_argument(
        "--columns",
        default=None,
        metavar="FIELD=COLUMN,...",
        help="for --format columns: e.g. prompt=question,answer=final_answer",
    )


def parse_columns(text: str | None) -> dict[str, str] | None:
    """ "prompt=question,answer=final_answer" -> {"prompt": "question", "answer": ...}."""
    if not text:
        return None
    out = {}
    for part in text.split(","):
        field, sep, column = part.partition("=")
        if not sep or not field.strip() or not column.strip():
            raise ValueError(f"--columns: expected FIELD=COLUMN pairs, got {part!r}")
        out[field.strip()] = column.strip()
    return out


def add_prompt_args(p: argparse.ArgumentParser) -> None:
    """Prompt rendering flags (the run configuration's ``prompt`` section)."""
    g = p.add_argument_group("prompt rendering (the run config's `prompt` section)")
    g.add_argument(
        "--prompt-config",
        default=None,
        metavar="YAML",
        help="take the `prompt` section of this YAML file (e.g. a run's config.yaml), so "
        "prompts render exactly as in that run; the flags below then may not be given",
    )
    g.add_argument("--template", choices=TEMPLATES, default=None, help="raw (default) or chat")
    g.add_argument("--system", default=None, help="system prompt")
    g.add_argument("--instruction", default=None, help="appended to each problem")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def prompt_settings(args: argparse.Namespace) -> PromptSettings:
    """The PromptSettings the flags describe (or the --prompt-config file's section)."""
    given = {
        "template": args.template,
        "system": args.system,
        "instruction": args.instruction,
        "stop": args.stop,
    }
    given = {k: v for k, v in given.items() if v is not None}
    try:
        if args.prompt_config:
            if given:
                raise ValueError(
                    f"--prompt-config takes the whole prompt section; drop "
                    f"{', '.join('--' + k for k in given)}"
                )
            return read_prompt_section(args.prompt_config)
        return PromptSettings.from_dict(given)
    except PromptSettingsError as e:
        raise ValueError(f"prompt.{e}") from None


def read_prompt_section(path: str) -> PromptSettings:
    """The ``prompt`` section of a YAML file (defaults when it has none)."""
    if not storage.is_gcs(path) and not os.path.isfile(path):
        raise FileNotFoundError(f"--prompt-config {path}: no such file")
    try:
        raw = yaml.safe_load(storage.read_bytes(path)) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"--prompt-config {path}: not valid YAML: {e}") from None
    section = raw.get("prompt") if isinstance(raw, dict) else None
    try:
        return PromptSettings.from_dict(section)
    except PromptSettingsError as e:
        raise ValueError(f"--prompt-config {path}: prompt.{e}") from None


# --------------------------------------------------------------------------- preview
def _indent(text: str) -> str:
    return textwrap.indent(text, "    ", lambda _: True)


def _reference(row: Any) -> str:
    if row["answer"] is not None:
        return f"answer: {row['answer']}"
    tests = row["tests"]
    kind = f"call-based {tests['fn_name']}()" if tests["fn_name"] else "stdin/stdout"
    public = sum(c["public"] for c in tests["cases"])
    limits = "".join(
        f", {k} {tests[k]}" for k in ("time_limit_s", "memory_mb") if tests[k] is not None
    )
    first = tests["cases"][0]
    return (
        f"tests: {len(tests['cases'])} {kind} cases ({public} public){limits}; first: input "
        f"{json.dumps(first['input'])} -> output {json.dumps(first['output'])}"
    )


def preview(args: argparse.Namespace) -> int:
    """Prints the first ``-n`` rows as the sampler will see them, and the rejected rows."""
    from rlax_tasks.data.dataset import load_dataset  # lazy: pandas, only when a file is read

    settings = prompt_settings(args)
    if args.model_dir:
        renderer = PromptRenderer.for_model(settings, args.model_dir)
    elif settings.template == "chat":
        raise ValueError("--template chat renders with the model's tokenizer: give --model-dir")
    else:
        renderer = PromptRenderer(settings, None)
    rows = load_dataset(args.file, args.format, parse_columns(args.columns))
    frame = rows.frame
    print(
        f"{args.file} (format {rows.format.name}, verifier {rows.format.verifier}): "
        f"{rows.rows_read} rows read, {len(frame)} usable, {len(rows.rejected)} rejected"
    )
    for i in range(min(args.n, len(frame))):
        row = frame.iloc[i]
        print(f"\nrow {i + 1} ({row['origin_file']}:{row['origin_row']}, id {row['id']})")
        if renderer.tokenizer is None:
            print("  prompt (template raw; give --model-dir for its tokens):")
            print(_indent(renderer.text(row["prompt"])))
        else:
            try:
                ids = renderer.encode(row["prompt"])
                count = f"{len(ids)} tokens"
            except ValueError as e:
                count = f"cannot be encoded: {e}"
            print(f"  prompt ({count}, template {settings.template}):")
            print(_indent(renderer.text(row["prompt"])))
        print(f"  {_reference(row)}")
    if rows.rejected:
        print(f"\nrejected rows ({len(rows.rejected)}):")
        for r in rows.rejected[: max(args.n, 10)]:
            print(f"  {r.file} row {r.row}: {r.reason}")
        if len(rows.rejected) > max(args.n, 10):
            print(f"  ... and {len(rows.rejected) - max(args.n, 10)} more")
    if settings.stop:
        print(f"\nstop strings: {list(settings.stop)}")
    return 0


def add_data_parser(sub: argparse._SubParsersAction) -> argparse._SubParsersAction:
    """Registers `rlax data preview`; returns the `data` sub-commands (a higher layer adds
    `rlax data episodes`)."""
    data = sub.add_parser("data", help="datasets: preview how a file is read and rendered")
    data_sub = data.add_subparsers(dest="data_command", metavar="COMMAND", required=True)
    p = data_sub.add_parser(
        "preview", help="print rows as the sampler will see them, with their references"
    )
    p.add_argument("file", help="a dataset file, directory or gs:// path")
    add_format_args(p)
    p.add_argument("--model-dir", default=None, help="HF model directory: its tokenizer renders")
    p.add_argument("-n", type=int, default=3, help="rows to show (default 3)")
    add_prompt_args(p)
    p.set_defaults(func=preview)
    return data_sub
