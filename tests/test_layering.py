"""Layering and safety rules, checked on the shipped source.

* The core (ucm_db/) imports no torch, vllm or click: checked statically
  and by importing the whole core in a fresh interpreter.
* tools/ and migrations/ do not import the connector (nor vllm/torch at
  module level).
* No pickle / marshal / eval / exec / torch.load anywhere shipped; rocksdict
  only in raw mode.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ["ucm_db", "connector", "migrations", "tools"]


def _modules(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def _imports(path: Path, *, top_level_only: bool = False) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    names: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("path", _modules("ucm_db"), ids=lambda p: str(p.relative_to(ROOT)))
def test_core_imports_no_torch_vllm_click(path: Path) -> None:
    bad = {n for n in _imports(path) if n.split(".")[0] in {"torch", "vllm", "click"} or n.startswith("ucm_db.connector") or n.startswith("ucm_db.tools")}
    assert not bad, f"{path} imports {bad}"


def test_importing_the_core_loads_no_torch_vllm_click() -> None:
    code = (
        "import sys, pkgutil, importlib, ucm_db\n"
        "for m in pkgutil.walk_packages(ucm_db.__path__, 'ucm_db.'):\n"
        "    if m.name.split('.')[1] not in ('connector', 'tools', 'migrations'):\n"
        "        try: importlib.import_module(m.name)\n"
        "        except ImportError as e: print('IMPORT-ERROR', m.name, e)\n"
        "print(sorted(n for n in ('torch', 'vllm', 'click') if n in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


@pytest.mark.parametrize("folder", ["tools", "migrations"])
def test_tools_and_migrations_do_not_import_the_connector(folder: str) -> None:
    for path in _modules(folder):
        bad = {n for n in _imports(path) if n.startswith("ucm_db.connector") or n.split(".")[0] == "vllm"}
        assert not bad, f"{path} imports {bad}"
        top = {n for n in _imports(path, top_level_only=True) if n.split(".")[0] == "torch"}
        assert not top, f"{path} imports torch at module level"


def test_no_top_level_connector_tools_or_migrations_packages_are_shipped() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    for name in ("connector", "tools", "migrations"):
        assert f'"{name}"' not in text.split("packages = ")[1].split("\n")[0]


_FORBIDDEN_CALLS = {"eval", "exec"}
_FORBIDDEN_MODULES = {"pickle", "marshal", "cPickle", "dill", "cloudpickle", "shelve"}


@pytest.mark.parametrize("path", [p for f in SHIPPED for p in _modules(f)], ids=lambda p: str(p.relative_to(ROOT)))
def test_no_unsafe_deserialisation(path: Path) -> None:
    tree = ast.parse(path.read_text(), filename=str(path))
    assert not {n.split(".")[0] for n in _imports(path)} & _FORBIDDEN_MODULES
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name):
                assert func.id not in _FORBIDDEN_CALLS, f"{path}:{node.lineno} calls {func.id}"
            if isinstance(func, ast.Attribute) and func.attr == "load" and isinstance(func.value, ast.Name):
                assert func.value.id != "torch", f"{path}:{node.lineno} calls torch.load"
            if isinstance(func, ast.Attribute) and func.attr == "Rdict" or isinstance(func, ast.Name) and func.id == "Rdict":
                source = ast.get_source_segment(path.read_text(), node) or ""
                assert "raw_mode" in source or "options" in source, f"{path}:{node.lineno} opens rocksdict without raw_mode"


@pytest.mark.slow
def test_core_is_mypy_clean() -> None:
    pytest.importorskip("mypy")
    out = subprocess.run([sys.executable, "-m", "mypy", "ucm_db"], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:]
