"""Import hygiene (issue 19): the light modules load no JAX, and the packages form no cycle.

Airflow's scheduler and triggerer import the configuration, the controller's message types, the
compute backends and the Airflow operators; each of those must stay importable without JAX,
Flax, Optax or Orbax. Data flows down the package layers (data below curation, evaluation and
the controller; the run configuration below every service that reads it), so the graph of
imports between packages has no cycle.
"""

from __future__ import annotations

import ast
import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest

import rlax_tasks

PACKAGE_DIR = pathlib.Path(rlax_tasks.__file__).parent
HEAVY = ("jax", "flax", "optax", "orbax")
# imported by the scheduler, the triggerer, the DAG files and the controller's process
LIGHT_MODULES = (
    "rlax_tasks.config",
    "rlax_tasks.config.checks",
    "rlax_tasks.config.datasets",
    "rlax_tasks.config.sections",
    "rlax_tasks.config.placement",
    "rlax_tasks.config.schema",
    "rlax_tasks.config.loading",
    "rlax_tasks.config.resume",
    "rlax_tasks.controller",
    "rlax_tasks.airflow",
    "rlax_tasks.data",
    "rlax_tasks.rollout.requests",
    "rlax_tasks.algorithms.config",
    "rlax_tasks.compute",
    "rlax_tasks.rundir.paths",
    "rlax_tasks.services.http",
    "rlax_tasks.services.protocol",
    "rlax_tasks.utils.validation",
    "rlax_tasks.utils.byte_sizes",
)
LAZY_PACKAGES = tuple(
    f"rlax_tasks.{p}"
    for p in ("airflow", "algorithms", "controller", "curation", "data", "evaluation", "models")
    + ("paramserver", "rollout", "trainer", "warmup")
)
# the composition roots: they may import every package, and only they may import each other
COMPOSITION_ROOTS = frozenset({"cli", "run", "airflow"})
# the bottom packages, each with the only rlax_tasks packages it may import:
# utils <- rundir <- services, utils <- process
BOTTOM_PACKAGES = {
    "utils": frozenset(),
    "rundir": frozenset({"utils"}),
    "services": frozenset({"utils", "rundir"}),
    "process": frozenset({"utils"}),
}

# Runs in a fresh interpreter: a meta-path finder that sees every import records, for the first
# heavy module asked for, the frames of rlax_tasks code that asked (outermost first).
_PROBE = textwrap.dedent(
    """
    import importlib, json, sys

    HEAVY, MODULES = {heavy!r}, {modules!r}
    chains = {{}}

    class Recorder:
        def find_spec(self, name, path=None, target=None):
            top = name.partition(".")[0]
            if top in HEAVY and top not in chains:
                frames, f = [], sys._getframe(1)
                while f is not None:
                    mod = f.f_globals.get("__name__", "")
                    if mod.startswith("rlax_tasks") or mod == "__main__":
                        frames.append(f"{{mod}}:{{f.f_lineno}} ({{f.f_code.co_name}})")
                    f = f.f_back
                chains[top] = frames[::-1] + [name]
            return None

    sys.meta_path.insert(0, Recorder())
    for m in MODULES:
        module = importlib.import_module(m)
        for name in getattr(module, "__all__", ()):  # a lazy package's stub loads its modules
            getattr(module, name)
    print(json.dumps({{
        "loaded": sorted(t for t in HEAVY if t in sys.modules), "chains": chains,
        "rlax": sorted(m for m in sys.modules if m.startswith("rlax_tasks.")),
    }}))
    """
)


def _probe(heavy: tuple[str, ...], modules: tuple[str, ...]) -> dict:
    """What a fresh interpreter loaded importing ``modules`` and every name they export:
    {"loaded": heavy modules, "chains": {heavy: rlax_tasks frames}, "rlax": rlax_tasks modules}."""
    code = _PROBE.format(heavy=heavy, modules=modules)
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _heavy_imports(heavy: tuple[str, ...], modules: tuple[str, ...]) -> tuple[list[str], str]:
    """(which of ``heavy`` the probe of ``modules`` loaded, the rlax_tasks frames that first
    imported each)."""
    report = _probe(heavy, modules)
    chains = "\n".join(f"{top}: " + "\n  -> ".join(c) for top, c in report["chains"].items())
    return report["loaded"], chains


# the concrete modules behind the light packages: Airflow's operators, triggers and DAG helpers,
# the controller's decision loop and its message types, the compute backends, the run directory;
# the `rlax` command line (each command imports its own module when it runs) and the JAX-free
# services it starts
CONCRETE_LIGHT_MODULES = (
    "rlax_tasks.cli",
    "rlax_tasks.paramserver.cli",
    "rlax_tasks.paramserver.server",
    "rlax_tasks.controller.cli",
    "rlax_tasks.controller.service",
    "rlax_tasks.rollout.cli",
    "rlax_tasks.rollout.service",
    "rlax_tasks.rewards.cli",
    "rlax_tasks.run.cli",
    "rlax_tasks.tools.cli",
    "rlax_tasks.models.cli",
    "rlax_tasks.airflow.cli",
    "rlax_tasks.airflow.operators",
    "rlax_tasks.airflow.triggers",
    "rlax_tasks.airflow.factories",
    "rlax_tasks.airflow.plan_task",
    "rlax_tasks.airflow.dag_watch",
    "rlax_tasks.controller.controller",
    "rlax_tasks.controller.buffer",
    "rlax_tasks.controller.lineage",
    "rlax_tasks.controller.mixture",
    "rlax_tasks.controller.snapshot",
    "rlax_tasks.compute.local",
    "rlax_tasks.compute.cloud_tpu",
    "rlax_tasks.run.heldout",
    "rlax_tasks.plan.launch",
    "rlax_tasks.plan.slices",
    "rlax_tasks.plan.memory_plan",
    "rlax_tasks.plan.preflight",
    "rlax_tasks.rundir.lock",
    "rlax_tasks.rundir.notices",
    "rlax_tasks.services.endpoints",
)


def test_light_modules_import_without_jax() -> None:
    """The scheduler's and triggerer's imports load none of JAX, Flax, Optax, Orbax: the light
    modules, every name they export (a lazy stub resolves to its modules), and the concrete
    modules behind them."""
    report = _probe(HEAVY, LIGHT_MODULES + CONCRETE_LIGHT_MODULES)
    chains = "\n".join(f"{top}: " + "\n  -> ".join(c) for top, c in report["chains"].items())
    assert report["loaded"] == [], f"light imports loaded {report['loaded']}; first of:\n{chains}"
    # the probe reached the modules themselves, not only their packages' stubs
    missing = set(CONCRETE_LIGHT_MODULES) - set(report["rlax"])
    assert not missing, f"not imported by the probe: {sorted(missing)}"


# what a colocated run imports before its first step: the CLI and the services it runs in-process
COLOCATED_MODULES = (
    "rlax_tasks.cli",
    "rlax_tasks.run.cli",
    "rlax_tasks.run.colocated",
    "rlax_tasks.trainer.service",
    "rlax_tasks.rollout.service",
    "rlax_tasks.rollout.worker",
    "rlax_tasks.controller.service",
    "rlax_tasks.paramserver.server",
)


def test_a_colocated_run_imports_no_web_framework_and_no_dataframe_library() -> None:
    """pandas and pyarrow load when a dataset file is read, not with a parser or a service. A
    colocated run calls its trainer and worker in-process: FastAPI loads only where they serve
    HTTP."""
    heavy = ("pandas", "pyarrow", "fastapi", "starlette")
    loaded, chains = _heavy_imports(heavy, COLOCATED_MODULES)
    assert loaded == [], f"they loaded {loaded}; first import of:\n{chains}"


# --------------------------------------------------------------------------- package graph
# Nodes are rlax_tasks' sub-packages (rlax_tasks.X.* → "X") and its top-level modules
# (rlax_tasks/cli.py → "cli"). Every import counts: module-level, inside functions (a lazy
# import still couples the layers) and under TYPE_CHECKING, and so do the modules a package's
# lazy export table names (rlax_tasks.utils.lazy_exports).


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _node(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "rlax_tasks" and len(parts) > 1 else None


def _resolve(name: str, level: int, package: str) -> str:
    if not level:
        return name
    base = package.split(".")[: len(package.split(".")) - level + 1]
    return ".".join(base + ([name] if name else []))


def _imports(path: pathlib.Path) -> Iterator[tuple[int, str]]:
    """(line, imported module) of every import in ``path``."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node.module or "", node.level, package)
            if base != "rlax_tasks":
                yield node.lineno, base
            else:  # `from rlax_tasks import storage` imports a module
                yield from ((node.lineno, f"{base}.{a.name}") for a in node.names)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", "") == "lazy_exports":
            for table in node.args[1:2]:
                for value in getattr(table, "values", []):
                    if isinstance(value, ast.Constant) and isinstance(value.value, str):
                        yield node.lineno, _resolve(*_split_relative(value.value), package)


def _split_relative(name: str) -> tuple[str, int]:
    stripped = name.lstrip(".")
    return stripped, len(name) - len(stripped)


def package_graph() -> dict[str, dict[str, list[str]]]:
    """{node: {imported node: ["module:line -> imported module", ...]}} over rlax_tasks."""
    graph: dict[str, dict[str, list[str]]] = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        module = _module_name(path)
        src = _node(module)
        if src is None:  # rlax_tasks/__init__.py
            continue
        for line, target in _imports(path):
            dst = _node(target)
            if dst is not None and dst != src:
                graph.setdefault(src, {}).setdefault(dst, []).append(f"{module}:{line} -> {target}")
    return graph


def find_cycle(graph: dict[str, dict[str, list[str]]]) -> list[str] | None:
    """One cycle of ``graph`` as its nodes (first == last), or None."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, {})):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def _describe(graph: dict[str, dict[str, list[str]]], cycle: list[str]) -> str:
    lines = [" -> ".join(cycle)]
    for a, b in zip(cycle, cycle[1:], strict=False):
        lines += [f"  {a} -> {b}:"] + [f"    {edge}" for edge in graph[a][b]]
    return "\n".join(lines)


def test_packages_have_no_import_cycle() -> None:
    """Layers flow down: no package imports one that (transitively) imports it back."""
    graph = package_graph()
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle between rlax_tasks packages:\n" + _describe(graph, cycle)


def test_only_composition_roots_import_composition_roots() -> None:
    """``cli``, ``run`` and ``airflow`` wire the system together; nothing below imports them."""
    wrong = [
        edge
        for src, targets in package_graph().items()
        if src not in COMPOSITION_ROOTS
        for dst in COMPOSITION_ROOTS & set(targets)
        for edge in targets[dst]
    ]
    assert wrong == [], "lower layers import a composition root:\n" + "\n".join(wrong)


def bottom_layer_violations(graph: dict[str, dict[str, list[str]]]) -> list[str]:
    """The edges by which a bottom package imports a package it may not (``BOTTOM_PACKAGES``)."""
    return [
        edge
        for src, allowed in BOTTOM_PACKAGES.items()
        for dst, edges in sorted(graph.get(src, {}).items())
        if dst not in allowed
        for edge in edges
    ]


def test_bottom_packages_import_only_the_packages_below_them() -> None:
    """utils, rundir, services and process sit under every other package: each imports only
    the bottom packages below it (``BOTTOM_PACKAGES``), so any package may use them."""
    wrong = bottom_layer_violations(package_graph())
    assert wrong == [], "a bottom package imports above its layer:\n" + "\n".join(wrong)


def test_the_bottom_layer_rule_names_a_wrong_import() -> None:
    """The checker itself: services importing compute, or utils importing rundir, is named."""
    graph = {
        "services": {
            "compute": ["rlax_tasks.services.endpoints:28 -> rlax_tasks.compute.types"],
            "rundir": ["rlax_tasks.services.endpoints:29 -> rlax_tasks.rundir"],
        },
        "utils": {"rundir": ["rlax_tasks.utils.x:3 -> rlax_tasks.rundir.paths"]},
        "controller": {"config": ["rlax_tasks.controller.y:5 -> rlax_tasks.config"]},
    }
    assert bottom_layer_violations(graph) == [
        "rlax_tasks.utils.x:3 -> rlax_tasks.rundir.paths",
        "rlax_tasks.services.endpoints:28 -> rlax_tasks.compute.types",
    ]


def test_find_cycle_reports_the_cycle() -> None:
    """The checker itself: a two-package loop is found and named with its edges."""
    graph = {"a": {"b": ["rlax_tasks.a.x:3 -> rlax_tasks.b"]}, "b": {"a": ["rlax_tasks.b:7 -> a"]}}
    cycle = find_cycle(graph)
    assert cycle == ["a", "b", "a"]
    assert "rlax_tasks.b:7 -> a" in _describe(graph, cycle)
    assert find_cycle({"a": {"b": []}, "b": {}}) is None


def test_lazy_packages_list_and_resolve_their_names() -> None:
    """Lazy package exports stay public: in ``__all__`` and ``dir()``, importable by name."""
    import importlib

    for name in LAZY_PACKAGES:
        package = importlib.import_module(name)
        assert set(package.__all__) <= set(dir(package)), name
        for export in package.__all__:  # every table entry names a real definition
            assert getattr(package, export) is not None, f"{name}.{export}"
    from rlax_tasks.algorithms import make_objective
    from rlax_tasks.evaluation import pass_at_k
    from rlax_tasks.rollout import GroupRequest, Sampler

    assert callable(make_objective) and pass_at_k(2, 1, 1) == 0.5
    assert Sampler.__module__ == "rlax_tasks.rollout.sampler"
    assert GroupRequest.__module__ == "rlax_tasks.rollout.requests"


@pytest.mark.parametrize("first", ["import rlax_tasks", ""])
def test_no_pytorch_advice_on_import_without_pytorch(first):
    """transformers' "PyTorch was not found" line never reaches a user of the package (who needs
    no PyTorch); without the package's import first it does (the check's positive control)."""
    code = f"import sys; sys.modules['torch'] = None; {first}\nimport transformers"
    env = {k: v for k, v in os.environ.items() if k != "TRANSFORMERS_NO_ADVISORY_WARNINGS"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert ("PyTorch was not found" in out.stderr + out.stdout) == (not first)


# --------------------------------------------------------------------------- the drawing
# docs/design.md §8 draws the packages as layers, top to bottom, in a ```text block after the
# line "The layers:"; each of its rows reads "<layer>  <package>, <package>, ...".
_DRAWING = re.compile(r"The layers:.*?\n```text\n(.*?)```", re.S)


def drawn_layers(design: str) -> dict[str, int]:
    """{package: its layer number} as docs/design.md §8 draws them."""
    found = _DRAWING.search(design)
    assert found, "docs/design.md §8 has no ```text drawing of the layers after 'The layers:'"
    layers: dict[str, int] = {}
    for row in found.group(1).splitlines():
        number, _, names = row.strip().partition(" ")
        if number.isdigit():
            layers.update((n.strip(), int(number)) for n in names.split(",") if n.strip())
    return layers


def upward_arrows(graph: dict[str, dict[str, list[str]]], layers: dict[str, int]) -> list[str]:
    """The imports that do not point to a lower row of the drawing, and the packages it lacks."""
    nodes = set(graph) | {dst for targets in graph.values() for dst in targets}
    wrong = [f"{n}: not in the drawing" for n in sorted(nodes - set(layers))]
    return wrong + [
        f"{src} (layer {layers[src]}) -> {dst} (layer {layers[dst]}): {edges[0]}"
        for src, targets in sorted(graph.items())
        for dst, edges in sorted(targets.items())
        if src in layers and dst in layers and layers[dst] >= layers[src]
    ]


def test_the_design_drawing_of_the_layers_has_no_upward_arrow() -> None:
    """Every import between packages points down the drawing in docs/design.md §8, and the
    drawing names every package: the picture a newcomer reads is the code's real structure."""
    layers = drawn_layers((PACKAGE_DIR.parent / "docs" / "design.md").read_text())
    wrong = upward_arrows(package_graph(), layers)
    assert wrong == [], "the drawing in docs/design.md §8 is wrong:\n" + "\n".join(wrong)


def test_an_upward_arrow_is_named() -> None:
    """The checker itself: an import sideways or up the drawing, and a missing package."""
    graph = {"run": {"plan": ["rlax_tasks.run.x:1 -> rlax_tasks.plan.y"]}, "plan": {"new": ["e"]}}
    assert upward_arrows(graph, {"run": 2, "plan": 2}) == [
        "new: not in the drawing",
        "run (layer 2) -> plan (layer 2): rlax_tasks.run.x:1 -> rlax_tasks.plan.y",
    ]
    assert upward_arrows({"run": {"plan": ["e"]}}, {"run": 2, "plan": 1}) == []
