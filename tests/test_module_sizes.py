"""Small modules with one job: every shipped module (benchmarks and the demo
aside) is under :data:`MAX_MODULE_LINES` lines, and every class, counted
with its bases, under :data:`MAX_CLASS_LINES`.

A class counts the span of its own statement (from its first decorator to
its last line, as ``ast`` gives it) plus the spans of every base class it
inherits from the shipped code, through any depth, each class once
(issue 47: ``Store(StoreWrites, StoreReads, StoreFeed, ...)`` passed a
per-class rule at 621 lines in 5 files). A base is resolved as Python
would: a class of the same module, or a name imported into it (``from X
import Y [as Z]``, ``import X`` then ``X.Y``, relative imports too),
followed through re-exports; bases outside the shipped code (the standard
library's, a dependency's) count nothing. Splitting a class across files
therefore never makes it smaller: a class that needs splitting holds its
parts instead (docs/architecture.md)."""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("ucm_db", "connector", "tools", "migrations")
#: Where each folder's modules are imported from (pyproject.toml's package-dir).
PACKAGES = {"ucm_db": "ucm_db", "connector": "ucm_db.connector", "tools": "ucm_db.tools", "migrations": "ucm_db.migrations"}
MAX_MODULE_LINES = 400
MAX_CLASS_LINES = 300
#: Classes over :data:`MAX_CLASS_LINES` counted with their bases when this
#: rule came in (issue 47), each held at the lines recorded here until it
#: gets parts it holds; then its entry goes. Never add one.
OVER_LIMIT = {
    "ucm_db.connector.hybrid.ssm_state.SsmStateScheduler": 393,  # a subclass of UcmDbScheduler (291 lines)
    "ucm_db.engines.lmdb.engine.LmdbEngine": 329,  # 295 lines of its own, over the Engine interface (34)
}


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


@dataclass
class Module:
    """One parsed module: its top-level classes and what its names import."""

    name: str
    is_package: bool
    classes: dict[str, ast.ClassDef] = field(default_factory=dict)
    #: local name -> (module, name in it); name None: the module itself (``import X as Y``).
    imported: dict[str, tuple[str, str | None]] = field(default_factory=dict)


def module_name(path: Path, root: Path = ROOT) -> tuple[str, bool]:
    """The dotted import name of a shipped module, and whether it is a package's ``__init__``."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    if is_package:
        parts = parts[:-1]
    return ".".join([PACKAGES[parts[0]], *parts[1:]]), is_package


def parse_module(path: Path, root: Path = ROOT) -> Module:
    name, is_package = module_name(path, root)
    module = Module(name, is_package)
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):  # imports inside functions and ``if TYPE_CHECKING:`` name bases too
        if isinstance(node, ast.ImportFrom):
            source = _absolute(module, node.module, node.level)
            for alias in node.names:
                module.imported[alias.asname or alias.name] = (source, alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    module.imported[alias.asname] = (alias.name, None)
                else:  # ``import a.b`` binds ``a``
                    head = alias.name.split(".")[0]
                    module.imported[head] = (head, None)
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            module.classes[node.name] = node
    return module


def _absolute(module: Module, target: str | None, level: int) -> str:
    if level == 0:
        return target or ""
    package = module.name.split(".")
    if not module.is_package:
        package = package[:-1]
    package = package[: len(package) - (level - 1)]
    return ".".join(package + ([target] if target else []))


class ShippedClasses:
    """Every shipped module's classes, their bases resolved across modules."""

    def __init__(self, modules: dict[str, Module]) -> None:
        self.modules = modules

    @classmethod
    def of(cls, paths: list[Path], root: Path = ROOT) -> ShippedClasses:
        parsed = [parse_module(path, root) for path in paths]
        return cls({m.name: m for m in parsed})

    def resolve(self, module_name: str, dotted: str, seen: frozenset[tuple[str, str]] = frozenset()) -> tuple[str, str] | None:
        """``(module, class name)`` that ``dotted`` names in ``module_name``, or None outside the shipped code."""
        module = self.modules.get(module_name)
        if module is None or (module_name, dotted) in seen:
            return None
        seen = seen | {(module_name, dotted)}
        head, _, rest = dotted.partition(".")
        if not rest and head in module.classes:
            return module_name, head
        if head in module.imported:
            source, name = module.imported[head]
            if name is None:  # a module: ``X.Y`` (or deeper) names what X holds
                return self._in_module(source, rest, seen) if rest else None
            if f"{source}.{name}" in self.modules:  # ``from package import submodule``
                return self._in_module(f"{source}.{name}", rest, seen) if rest else None
            return self.resolve(source, f"{name}.{rest}" if rest else name, seen)
        return None

    def _in_module(self, module_name: str, dotted: str, seen: frozenset[tuple[str, str]]) -> tuple[str, str] | None:
        head, _, rest = dotted.partition(".")
        if rest and f"{module_name}.{head}" in self.modules:
            return self._in_module(f"{module_name}.{head}", rest, seen)
        return self.resolve(module_name, dotted, seen)

    def bases(self, module_name: str, node: ast.ClassDef) -> list[tuple[str, str]]:
        found = []
        for base in node.bases:
            while isinstance(base, ast.Subscript):  # Generic[T], Protocol[T]
                base = base.value
            dotted = _dotted(base)
            target = None if dotted is None else self.resolve(module_name, dotted)
            if target is not None:
                found.append(target)
        return found

    def lines_with_bases(self, module_name: str, class_name: str) -> int:
        """The class's span plus each of its shipped bases' (transitively, each once)."""
        total = 0
        todo = [(module_name, class_name)]
        counted: set[tuple[str, str]] = set()
        while todo:
            key = todo.pop()
            if key in counted:
                continue
            counted.add(key)
            node = self.modules[key[0]].classes[key[1]]
            total += span(node)
            todo += self.bases(key[0], node)
        return total


def span(node: ast.ClassDef) -> int:
    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    return (node.end_lineno or node.lineno) - first + 1


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        value = _dotted(node.value)
        return None if value is None else f"{value}.{node.attr}"
    return None


@cache
def _shipped() -> ShippedClasses:
    return ShippedClasses.of(_shipped_modules())


@pytest.mark.parametrize("path", _shipped_modules(), ids=_rel)
def test_module_and_class_sizes(path: Path) -> None:
    text = path.read_text()
    lines = len(text.splitlines())
    assert lines < MAX_MODULE_LINES, f"{_rel(path)} has {lines} lines (< {MAX_MODULE_LINES}): split it by job"
    shipped = _shipped()
    name, _ = module_name(path)
    for class_name in shipped.modules[name].classes:
        counted = shipped.lines_with_bases(name, class_name)
        limit = OVER_LIMIT.get(f"{name}.{class_name}", MAX_CLASS_LINES - 1)
        assert counted <= limit, (
            f"{_rel(path)}: class {class_name} spans {counted} lines with its bases (< {MAX_CLASS_LINES}): "
            "give it parts it holds, not mixins")


def test_the_classes_over_the_limit_are_still_over_it() -> None:
    """An entry of :data:`OVER_LIMIT` goes once its class fits (the list only shrinks)."""
    shipped = _shipped()
    for dotted in OVER_LIMIT:
        module, _, class_name = dotted.rpartition(".")
        assert shipped.lines_with_bases(module, class_name) >= MAX_CLASS_LINES, f"{dotted} fits now: drop it from OVER_LIMIT"


def test_a_class_is_counted_with_its_bases_across_modules(tmp_path: Path) -> None:
    """Mixins split over files (the old ``Store``), imported every way a
    base can be, count as one class; a base outside the shipped code and a
    part held (not inherited) count nothing."""
    package = tmp_path / "ucm_db" / "shop"
    package.mkdir(parents=True)
    (tmp_path / "ucm_db" / "__init__.py").write_text("")
    (package / "base.py").write_text("class Base:\n" + "    x = 1\n" * 9)  # 10 lines
    (package / "reads.py").write_text("from ucm_db.shop.base import Base\n\n\nclass Reads(Base):\n" + "    y = 1\n" * 19)  # 20
    (package / "writes.py").write_text("from . import base\n\n\nclass Writes(base.Base):\n" + "    z = 1\n" * 29)  # 30
    (package / "feed.py").write_text("import ucm_db.shop.base as b\nfrom typing import Generic, TypeVar\nT = TypeVar('T')\n\n\n"
                                     "class Feed(b.Base, Generic[T]):\n" + "    w = 1\n" * 39)  # 40
    (package / "parts.py").write_text("class Part:\n" + "    p = 1\n" * 99)  # 100, held below: not counted
    (package / "__init__.py").write_text(
        "from ucm_db.shop.reads import Reads\nfrom .writes import Writes as W\nfrom ucm_db.shop import feed\n"
        "from ucm_db.shop.parts import Part\n\n\n"
        "class Store(Reads, W, feed.Feed, Exception):\n    def __init__(self) -> None:\n        self.part = Part()\n")
    (package / "again.py").write_text("from ucm_db.shop import Store\n\n\nclass Again(Store):\n    pass\n")
    shipped = ShippedClasses.of(sorted(tmp_path.rglob("*.py")), tmp_path)
    assert shipped.lines_with_bases("ucm_db.shop", "Store") == 3 + 20 + 30 + 40 + 10  # the shared base once
    assert shipped.lines_with_bases("ucm_db.shop.again", "Again") == 2 + 103
    assert shipped.lines_with_bases("ucm_db.shop.parts", "Part") == 100
