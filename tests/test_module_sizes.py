"""Small modules with one job: every shipped module (benchmarks and the demo
aside) is under :data:`MAX_MODULE_LINES` lines and every class under
:data:`MAX_CLASS_LINES` (a class's span from its first decorator to its last
line, as ``ast`` gives it)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("ucm_db", "connector", "tools", "migrations")
MAX_MODULE_LINES = 400
MAX_CLASS_LINES = 300


def _shipped_modules() -> list[Path]:
    out = []
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith("tools/bench/") or rel == "tools/demo.py":  # measuring code (docs/architecture.md)
                continue
            out.append(path)
    return out


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


@pytest.mark.parametrize("path", _shipped_modules(), ids=_rel)
def test_module_and_class_sizes(path: Path) -> None:
    text = path.read_text()
    lines = len(text.splitlines())
    assert lines < MAX_MODULE_LINES, f"{_rel(path)} has {lines} lines (< {MAX_MODULE_LINES}): split it by job"
    for node in ast.walk(ast.parse(text, filename=str(path))):
        if isinstance(node, ast.ClassDef):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            span = (node.end_lineno or node.lineno) - first + 1
            assert span < MAX_CLASS_LINES, f"{_rel(path)}: class {node.name} spans {span} lines (< {MAX_CLASS_LINES})"
