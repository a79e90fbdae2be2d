"""Dependencies point one way: the import graph of ``src/vitrain`` (imports inside functions included) has
no cycle and follows the layer list of docs/architecture.md; every module imports on its own, first, in a
fresh process."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "vitrain"
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def module_files(package: Path = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, packages by their ``__init__.py``."""
    modules = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _imported(module: str, path: Path, node: ast.AST, modules: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        base = base[: len(base) - node.level + 1]
        stem = ".".join(base + ([node.module] if node.module else []))
    else:
        stem = node.module or ""
    return [f"{stem}.{alias.name}" if f"{stem}.{alias.name}" in modules else stem for alias in node.names]


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the vitrain modules it imports anywhere in its file. Importing ``a.b.c`` runs ``a/__init__``
    and ``a/b/__init__`` first, so those count as imported too."""
    modules = module_files(package)
    graph: dict[str, set[str]] = defaultdict(set)
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for name in _imported(module, path, node, modules):
                if name != "vitrain" and not name.startswith("vitrain."):
                    continue
                while name not in modules:
                    name = name.rsplit(".", 1)[0]
                parts = name.split(".")
                for end in range(2, len(parts) + 1):
                    target = ".".join(parts[:end])
                    if target != module and not module.startswith(target + ".") and target in modules:
                        graph[module].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        while work:
            node, successors = work[-1]
            child = next(successors, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                work.append((child, iter(sorted(graph.get(child, ())))))
            elif child in stack:
                low[node] = min(low[node], index[child])
    return found


def documented_layers(text: str) -> dict[str, int]:
    """Top-level package or module -> its layer number, from the numbered list of the ``## Layers`` section."""
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    layers = {}
    for number, names in re.findall(r"^(\d+)\. (.+)$", section, re.M):
        for name in re.findall(r"`([\w.]+)`", names):
            layers[name] = int(number)
    return layers


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "vitrain"


def upward_imports(graph: dict[str, set[str]], layers: dict[str, int]) -> list[str]:
    """``a -> b`` for each import of a package of the same or a later layer (the root package excepted)."""
    wrong = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            source, imported = _top(module), _top(target)
            if imported == "vitrain" or source == imported:
                continue
            if layers.get(imported, 10**6) >= layers.get(source, -1):
                wrong.append(f"{module} -> {target}")
    return wrong


def test_the_import_graph_has_no_cycle():
    assert cycles(import_graph()) == []


def test_every_import_points_down_the_documented_layers():
    layers = documented_layers(ARCHITECTURE.read_text())
    packages = {_top(module) for module in module_files()} - {"vitrain"}
    assert packages == set(layers), "docs/architecture.md's layer list and src/vitrain's packages differ"
    graph = import_graph()
    assert upward_imports(graph, layers) == []
    assert not graph.get("vitrain"), "vitrain/__init__.py imports vitrain modules"
    assert {_top(target) for target in graph.get("vitrain.config", ())} <= {"config", "vitrain"}


def test_the_checks_catch_a_cycle_and_an_upward_import(tmp_path):
    """The graph, cycle and layer checks on a made-up package: config importing models inside a function
    is both a cycle (models imports config) and an upward import."""
    package = tmp_path / "vitrain"
    (package / "config").mkdir(parents=True)
    (package / "models").mkdir()
    (package / "__init__.py").write_text("")
    (package / "config" / "__init__.py").write_text("def f():\n    from vitrain.models import build\n")
    (package / "models" / "__init__.py").write_text("from vitrain.config import f\nbuild = 1\n")
    graph = import_graph(package)
    assert cycles(graph) == [["vitrain.config", "vitrain.models"]]
    assert upward_imports(graph, {"config": 1, "models": 3}) == ["vitrain.config -> vitrain.models"]


_THIRD_PARTY = """
import importlib, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
print(" ".join(sorted(name for name in sys.modules if not name.startswith(("vitrain", "_")))))
"""

_FIRST_IMPORT = """
import importlib, os, sys, traceback
names = sys.argv[1:]
separator = names.index("--")
for name in names[:separator]:  # every third-party module vitrain imports, once, before the forks
    try:
        importlib.import_module(name)
    except BaseException:
        pass
failed, running = [], {}
pending = names[separator + 1 :]
while pending or running:  # two children at a time (2 cores)
    while pending and len(running) < 2:
        name = pending.pop(0)
        pid = os.fork()
        if pid == 0:
            try:
                importlib.import_module(name)
            except BaseException:
                traceback.print_exc()
                os._exit(1)
            os._exit(0)
        running[pid] = name
    pid, status = os.wait()
    if os.waitstatus_to_exitcode(status) != 0:
        failed.append(running[pid])
    del running[pid]
print("FAILED", " ".join(failed))
"""


def test_every_module_imports_first_in_a_fresh_process():
    """Each vitrain module imported before any other vitrain module (a forked child of a process that has
    imported only the third-party modules vitrain uses, so each child pays for vitrain's code alone), so a
    cycle that only the CLI's import order hides shows here."""
    names = [name for name in module_files() if not name.endswith("__main__")]
    env = {**os.environ, "PYTHONPATH": str(PACKAGE.parent)}
    every = subprocess.run(
        [sys.executable, "-c", _THIRD_PARTY, *names], capture_output=True, text=True, env=env, timeout=600
    )
    assert every.returncode == 0, every.stderr[-3000:]
    third_party = every.stdout.split()
    command = [sys.executable, "-c", _FIRST_IMPORT, *third_party, "--", *names]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("FAILED"), result.stdout[-500:] + result.stderr[-3000:]
