"""`rlax curate`: run the curation pipeline from the command line."""

from __future__ import annotations

import argparse

from rlax_tasks.data.cli import add_format_args, parse_columns
from rlax_tasks.evaluation.cli import add_generation_args, make_generator


def _run(args: argparse.Namespace) -> int:
    # lazy: pandas loads only when `rlax curate` runs (every `rlax` command builds this parser)
    from rlax_tasks.curation.dedup import MinHashConfig
    from rlax_tasks.curation.pipeline import CurationConfig, run_curation
    from rlax_tasks.curation.report import write_outputs

    columns = parse_columns(args.columns)
    config = CurationConfig(
        inputs=tuple(args.inputs),
        format=args.format,
        columns=tuple(sorted(columns.items())) if columns else (),
        eval_sets=tuple(args.eval_set or ()),
        split_date=args.split_date,
        ngram=args.ngram,
        near_dedup=not args.no_near_dedup,
        minhash=MinHashConfig(threshold=args.near_threshold),
        pass_rate_k=args.k if args.model_dir else 0,
    )
    if args.model_dir is None and args.weights_from:
        raise ValueError("--weights-from needs --model-dir (the model's config and tokenizer)")
    generator = None
    if args.model_dir:
        if args.k < 1:
            raise ValueError(f"--k must be >= 1 with --model-dir, got {args.k}")
        generator = make_generator(args, args.model_dir, args.weights_from)
    result = run_curation(config, generator, generator.unusable if generator is not None else None)
    report = write_outputs(result, config, args.out)
    t = report["totals"]
    print(
        f"read {t['rows_read']} rows: {t['train']} train, {t['test']} test, "
        f"{t['quarantined']} quarantined, {t['removed']} removed"
    )
    for s in report["stages"]:
        if s["removed"]:
            print(f"  {s['stage']}: -{s['removed']}")
    print(f"outputs in {args.out} (report.md, report.json, train.parquet, test.parquet)")
    return 0


def add_curate_parser(sub: argparse._SubParsersAction) -> None:
    """Registers `rlax curate`."""
    p = sub.add_parser("curate", help="curate datasets: validate, dedup, filter, split")
    p.add_argument("inputs", nargs="+", help="JSONL/Parquet/CSV files, directories or gs:// paths")
    add_format_args(p)
    p.add_argument("--out", required=True, help="output directory (local or gs://)")
    p.add_argument(
        "--eval-set",
        action="append",
        help="evaluation set to decontaminate against (repeatable; read in --format when it "
        "fits, else as the row schema)",
    )
    p.add_argument(
        "--split-date", default=None, help="ISO date: rows before it go to train, the rest to test"
    )
    p.add_argument("--ngram", type=int, default=13, help="decontamination n-gram size (words)")
    p.add_argument(
        "--near-threshold",
        type=float,
        default=0.8,
        help="MinHash Jaccard threshold for near duplicates",
    )
    p.add_argument("--no-near-dedup", action="store_true", help="skip near-duplicate removal")
    p.add_argument(
        "--model-dir", default=None, help="HF model directory: turns on the pass-rate filter"
    )
    p.add_argument("--k", type=int, default=8, help="samples per prompt for the pass-rate filter")
    add_generation_args(p)
    p.set_defaults(func=_run)
