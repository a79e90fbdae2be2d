"""What a non-editable install ships: every source of the fused CPU kernels, headers included."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from vitrain import kernels

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ROOT / "src" / "vitrain" / "kernels"


def test_the_wheel_ships_every_kernel_source(tmp_path):
    pytest.importorskip("setuptools", minversion="70.1", reason="building the wheel needs setuptools (the dev extra)")
    tree = tmp_path / "tree"  # a copy: the build writes build/ and egg-info beside the sources
    shutil.copytree(ROOT / "src", tree / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tree / name)
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp_path, tree],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (wheel,) = tmp_path.glob("vitrain-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    sources = sorted(path.name for path in KERNELS.iterdir() if path.is_file() and path.suffix != ".pyc")
    assert {path.name for path in kernels.build.SOURCES + kernels.build.HEADERS} <= set(sources)
    missing = [name for name in sources if f"vitrain/kernels/{name}" not in shipped]
    assert not missing, f"not in the wheel: {missing}"


def test_missing_kernel_sources_are_named_once_and_the_run_falls_back(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(kernels.build, "HEADERS", [*kernels.build.HEADERS, tmp_path / "tiles.h"])
    monkeypatch.setattr(kernels.build, "_module", None)
    monkeypatch.setattr(kernels.build, "_failure", None)
    with caplog.at_level(logging.WARNING, logger="vitrain"):
        assert kernels.load() is None and kernels.load() is None
    warnings = [record.getMessage() for record in caplog.records]
    assert len(warnings) == 1, warnings
    assert "kernel sources missing from" in warnings[0] and "tiles.h" in warnings[0] and "reinstall" in warnings[0]


def test_the_torch_floor_is_the_one_pyproject_requires():
    import tomllib

    import vitrain

    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch_requirement,) = [entry for entry in dependencies if entry.startswith("torch>")]
    assert torch_requirement == "torch>=" + ".".join(map(str, vitrain.MIN_TORCH))


@pytest.mark.parametrize(
    ("version", "supported"),
    [("2.5.1+cu124", False), ("1.13.1", False), ("2.7.1", False), ("2.8.0", True), ("2.8.0a0+5228986c39", True)]
    + [("2.11.0+cu130", True), ("2.14.1", True), ("3.0.0", True)],
)
def test_an_older_torch_stops_the_import_with_the_fix(version, supported):
    """What ``import vitrain`` does under a torch of ``version`` (the installed one's metadata faked)."""
    fake = (
        "import importlib.metadata as m; real = m.version; "
        f"m.version = lambda name: {version!r} if name == 'torch' else real(name); import vitrain"
    )
    result = subprocess.run([sys.executable, "-c", fake], capture_output=True, text=True, timeout=60)
    if supported:
        assert result.returncode == 0, result.stderr[-2000:]
    else:
        assert result.returncode != 0
        last = result.stderr.strip().splitlines()[-1]
        assert last.startswith("ImportError: vitrain needs torch >= 2.8, and this environment has torch " + version)
        assert "pip install 'torch>=2.8'" in last


DISTRIBUTIONS = {"yaml": "pyyaml", "PIL": "pillow"}
"""Import names whose distribution has another name."""


def _module_level_imports(nodes) -> set[str]:
    """Top-level names of the modules these statements import when their module is imported: imports inside
    functions and classes, and under ``if TYPE_CHECKING:``, are not run then."""
    import ast

    names = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
        elif isinstance(node, ast.Try):
            names |= _module_level_imports([*node.body, *node.orelse, *node.finalbody])
        elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
            names |= _module_level_imports([*node.body, *node.orelse])
    return names


def test_importing_vitrain_needs_only_the_base_dependencies():
    """`make train` installs the base dependencies alone: a module-level import of an extra's package (DALI,
    ONNX, the sinks' clients, webdataset, pytest) would break the default run; those are imported where used."""
    import ast
    import re

    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = {re.match(r"[A-Za-z0-9_.-]+", requirement).group().lower() for requirement in project["dependencies"]}
    allowed = set(sys.stdlib_module_names) | {"vitrain", "__future__"}
    found = {}
    for path in sorted((ROOT / "src" / "vitrain").rglob("*.py")):
        for name in _module_level_imports(ast.parse(path.read_text()).body) - allowed:
            found.setdefault(DISTRIBUTIONS.get(name, name).lower(), []).append(str(path.relative_to(ROOT)))
    outside = {name: paths for name, paths in found.items() if name not in base}
    assert not outside, f"imported at module level but not a base dependency: {outside}"
    assert {"torch", "pydantic", "pyyaml", "numpy", "pillow", "timm"} <= set(found)  # the scan sees imports
