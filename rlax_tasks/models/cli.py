"""`rlax import gguf FILE OUT_DIR`: the command that converts a GGUF file with
models/gguf_import.py. Light to import (no JAX): the importer loads when the command runs."""

from __future__ import annotations

import argparse

from rlax_tasks.models.config import SUPPORTED_DTYPES


def _import_command(args: argparse.Namespace) -> int:
    from rlax_tasks.models.gguf_import import import_gguf  # loads JAX (hf_io): when it runs

    import_gguf(args.file, args.out_dir, dtype=args.dtype, overwrite=args.overwrite)
    print(args.out_dir)
    return 0


def add_import_parser(sub: argparse._SubParsersAction) -> None:
    """Registers `rlax import gguf FILE OUT_DIR`."""
    p = sub.add_parser("import", help="convert a model file into a Hugging Face directory")
    kinds = p.add_subparsers(dest="kind", required=True)
    g = kinds.add_parser(
        "gguf",
        help="a GGUF file (llama.cpp) to an HF directory: dequantized weights, tokenizer with "
        "its chat template, generation config",
    )
    g.add_argument("file", metavar="FILE", help="the .gguf file")
    g.add_argument("out_dir", metavar="OUT_DIR", help="the HF directory to write")
    g.add_argument(
        "--dtype", choices=SUPPORTED_DTYPES, default="float32", help="dtype of the weights"
    )
    g.add_argument(
        "--overwrite", action="store_true", help="replace OUT_DIR when it exists and is not empty"
    )
    g.set_defaults(func=_import_command)
