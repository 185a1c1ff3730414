"""Finding dataset files and reading or writing them, local or gs:// (rlax_tasks.rundir.storage)."""

from __future__ import annotations

import glob
import gzip
import os

from rlax_tasks.rundir import storage

FORMATS = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".parquet": "parquet",
    ".pq": "parquet",
    ".csv": "csv",
}


def file_format(path: str) -> str:
    """The format of a file from its name: jsonl, parquet or csv (text may end in .gz)."""
    name = path[:-3] if path.endswith(".gz") else path
    ext = os.path.splitext(name)[1].lower()
    if ext not in FORMATS:
        raise ValueError(
            f"{path}: unknown input format {ext or '(no extension)'!r}; "
            f"use one of {', '.join(sorted(FORMATS))}"
        )
    if path.endswith(".gz") and FORMATS[ext] == "parquet":
        raise ValueError(f"{path}: Parquet files are compressed internally; drop the .gz")
    return FORMATS[ext]


def read_bytes(path: str) -> bytes:
    """The whole content of a local file or gs:// object (gunzipped when it ends in .gz)."""
    if not storage.is_gcs(path) and not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file")
    data = storage.read_bytes(path)
    return gzip.decompress(data) if path.endswith(".gz") else data


def _is_input(name: str) -> bool:
    try:
        file_format(name)
    except ValueError:
        return False
    return True


def expand_inputs(path: str) -> list[str]:
    """The input files under `path`: itself if a file, the supported files of a directory or
    gs:// prefix ending in "/" (sorted), or the matches of a local glob pattern."""
    if storage.is_gcs(path):
        if not path.endswith("/") and storage.exists(path):
            return [path]
        files = [f for f in storage.list_prefix(path) if _is_input(f)]
    elif os.path.isdir(path):
        files = sorted(
            os.path.join(root, f) for root, _, fs in os.walk(path) for f in fs if _is_input(f)
        )
    elif any(ch in path for ch in "*?["):
        files = sorted(f for f in glob.glob(path, recursive=True) if os.path.isfile(f))
    else:
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path}: no such file or directory")
        return [path]
    if not files:
        raise FileNotFoundError(f"{path}: no .jsonl/.parquet/.csv files found")
    return files


def write_bytes(path: str, data: bytes) -> None:
    """Write a local file (creating its directory) or a gs:// object."""
    if not storage.is_gcs(path):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    storage.write_bytes(path, data)


join = storage.join
