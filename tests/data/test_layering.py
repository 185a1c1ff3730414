"""The data path is straight (docs/design.md §11): rlax_tasks.data is below curation, evaluation,
the controller and rollout, and imports none of them — neither at module level nor inside
functions."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import rlax_tasks.data

ABOVE = ("curation", "evaluation", "controller", "rollout")
DATA_DIR = os.path.dirname(rlax_tasks.data.__file__)


def _imported_modules(path: str) -> set[str]:
    """Every module an ``import`` / ``from ... import`` anywhere in the file names."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_data_imports_nothing_from_the_layers_above_it():
    files = [f for f in sorted(os.listdir(DATA_DIR)) if f.endswith(".py")]
    assert {"formats.py", "prompts.py", "readers.py", "schema.py", "dataset.py"} <= set(files)
    offending = {
        f"{f}: {name}"
        for f in files
        for name in _imported_modules(os.path.join(DATA_DIR, f))
        if any(name == f"rlax_tasks.{p}" or name.startswith(f"rlax_tasks.{p}.") for p in ABOVE)
    }
    assert not offending, f"rlax_tasks.data imports from the layers above it: {sorted(offending)}"


def test_importing_every_data_module_loads_none_of_the_layers_above():
    modules = [f"rlax_tasks.data.{f[:-3]}" for f in os.listdir(DATA_DIR) if f.endswith(".py")]
    code = (
        "import importlib, sys\n"
        f"for m in {sorted(modules)!r}: importlib.import_module(m)\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[:2] in "
        f"[['rlax_tasks', p] for p in {ABOVE!r}]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]", out.stdout


def test_the_layers_above_read_datasets_through_data():
    """Curation, evaluation and the controller no longer carry their own readers."""
    import rlax_tasks.curation as curation

    curation_dir = os.path.dirname(curation.__file__)
    assert not {"ingest.py", "io.py", "schema.py", "normalize.py"} & set(os.listdir(curation_dir))
    for module in ("curation/pipeline.py", "controller/mixture.py", "evaluation/cli.py"):
        path = os.path.join(os.path.dirname(DATA_DIR), module)
        assert any(n.startswith("rlax_tasks.data") for n in _imported_modules(path)), module
