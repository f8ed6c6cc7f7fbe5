"""The package's layers, read from the source (ast), imports inside functions included:

    core  <-  rewrite  <-  pipeline
    core  <-  launcher <-  pipeline

No cycle among parastream's modules; the launcher (the runtime) never imports rewrite or pipeline; core imports
none of the others.  The launcher is runtime only: the timing of launchers (what the build times to decide, and
``parastream bench``) is pipeline/bench.py, and no module under launcher/ defines it.  A function-level import of a heavy optional dependency (torch, tensorrt, cuda) is outside the
package and not counted; a function-level import of a parastream module counts like a top-level one, so it cannot
hide a cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("core", "rewrite", "pipeline", "launcher")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["parastream", *parts])


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph() -> nx.DiGraph:
    """Module -> parastream module it imports (``from pkg import mod`` counts as importing ``pkg.mod``)."""
    files = {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph = nx.DiGraph()
    graph.add_nodes_from(files)
    for module, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(module, is_package, node)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in files:  # "parastream.x.y.attr" -> the module that defines it
                    target = target.rpartition(".")[0]
                if target and target != module:
                    graph.add_edge(module, target)
    return graph


def _layer(module: str) -> str:
    return module.split(".")[1] if module.count(".") else ""


def test_every_package_module_is_in_the_graph():
    graph = import_graph()
    assert {"parastream.core.errors", "parastream.rewrite.cost", "parastream.pipeline.build",
            "parastream.launcher.plan"} <= set(graph)


def test_no_import_cycle():
    graph = import_graph()
    cycles = sorted(sorted(c) for c in nx.simple_cycles(graph))
    assert cycles == [], f"import cycles: {cycles[:5]}"


@pytest.mark.parametrize("layer, forbidden", [("core", {"rewrite", "pipeline", "launcher"}),
                                              ("launcher", {"rewrite", "pipeline"}),
                                              ("rewrite", {"pipeline", "launcher"})])
def test_layers_point_one_way(layer, forbidden):
    graph = import_graph()
    wrong = sorted((a, b) for a, b in graph.edges if _layer(a) == layer and _layer(b) in forbidden)
    assert wrong == []


def test_the_checker_sees_a_function_level_cycle(tmp_path, monkeypatch):
    """The walk reads imports inside functions: a cycle hidden in one is found."""
    for pkg in PACKAGES:
        (tmp_path / pkg).mkdir()
    (tmp_path / "core" / "a.py").write_text("from . import b\n")
    (tmp_path / "core" / "b.py").write_text("def f():\n    from .a import x\n    return x\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    graph = import_graph()
    assert list(nx.simple_cycles(graph)) != []


# What times a launcher, defined in pipeline/bench.py: the build's measurements (GPU replays, the GPU timing lock,
# CPU calls in alternating blocks, the machine's load meanwhile) and ``parastream bench``.
TIMING = ("measure", "gpu_timing_lock", "time_calls", "race_calls", "time_alternating", "OthersLoad",
          "WholeModelLauncher", "bench_bundle", "bench_cpu", "bench_buckets", "print_bench", "print_bench_cpu")


def _top_level_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}


def timing_in_launcher() -> list[str]:
    """``module: name`` for every timing entry point (TIMING, or a name starting ``bench``/``print_bench``) that a
    module under launcher/ defines, and every launcher module named bench."""
    found = []
    for path in sorted((ROOT / "launcher").rglob("*.py")):
        module = _module_name(path)
        if path.stem.startswith("bench"):
            found.append(f"{module}: a benchmarking module")
        found += [f"{module}: {name}" for name in sorted(_top_level_names(path))
                  if name in TIMING or name.startswith(("bench", "print_bench"))]
    return found


def test_the_launcher_is_runtime_only():
    assert timing_in_launcher() == []


def test_the_timing_entry_points_are_in_pipeline_bench():
    """The list above names what pipeline/bench.py defines (a renamed entry point must be renamed here too)."""
    assert set(TIMING) <= _top_level_names(ROOT / "pipeline" / "bench.py")


def test_the_checker_sees_timing_code_in_the_launcher(tmp_path, monkeypatch):
    (tmp_path / "launcher").mkdir()
    (tmp_path / "launcher" / "cpu.py").write_text("def race_calls(runners):\n    return {}\n\nclass CpuLauncher:\n    pass\n")
    (tmp_path / "launcher" / "bench.py").write_text("")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert timing_in_launcher() == ["parastream.launcher.bench: a benchmarking module",
                                    "parastream.launcher.cpu: race_calls"]
