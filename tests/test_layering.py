"""Layering and safety rules, checked on the shipped source.

* The core (ucm_db/) imports no torch, vllm or click: checked statically
  and by importing the whole core in a fresh interpreter.
* tools/ and migrations/ do not import the connector (nor vllm/torch at
  module level).
* No pickle / marshal / eval / exec / torch.load anywhere shipped; rocksdict
  only in raw mode.
* The house rules of docs/architecture.md: tools/ and connector/ reach the
  store only through the public API (``ucm_db.__all__``, the public modules
  ``ucm_db.maintenance``, ``errors``, ``keys``, ``units``, ``config``,
  ``cpu_placement``) and
  ``ucm_db.migrations``; no import cycle among the shipped modules (every
  import counts: deferred imports inside functions and ``if TYPE_CHECKING:``
  imports alike).
* The core's layer table (``LAYERS``, docs/architecture.md): every core
  part (a package such as ``ucm_db.index``, or a top-level module) has a
  layer, and imports only itself and parts of lower layers: no arrow runs
  up or sideways (the remote wing never imports the store that holds it,
  the store never imports maintenance).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest

import ucm_db

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


def test_the_connectors_settings_and_layouts_import_without_vllm() -> None:
    """connector/__init__.py's promise: the torch-only modules load no vLLM."""
    code = ("import sys; sys.modules['vllm'] = None\n"
            "import ucm_db.connector.settings, ucm_db.connector.layouts\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert out.stdout.strip() == "ok", out.stderr[-2000:]


@pytest.mark.parametrize("folder", ["tools", "migrations"])
def test_tools_and_migrations_do_not_import_the_connector(folder: str) -> None:
    for path in _product_modules(folder):  # the benchmarks and the demo drive vLLM engines
        bad = {n for n in _imports(path) if n.startswith("ucm_db.connector") or n.split(".")[0] == "vllm"}
        assert not bad, f"{path} imports {bad}"
        top = {n for n in _imports(path, top_level_only=True) if n.split(".")[0] == "torch"}
        assert not top, f"{path} imports torch at module level"


def test_no_top_level_connector_tools_or_migrations_packages_are_shipped() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    for name in ("connector", "tools", "migrations"):
        assert f'"{name}"' not in text.split("packages = ")[1].split("\n")[0]


def test_the_wheel_lists_every_package_of_the_shipped_folders() -> None:
    """setuptools' ``packages`` is explicit: a package folder left out of it
    is missing from a wheel (a non-editable install) though every editable
    checkout imports it."""
    import tomllib

    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {folder: name for name, folder in setup["package-dir"].items()}
    found = set()
    for folder in SHIPPED:
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((folders[folder], *relative)))
    assert sorted(found) == sorted(setup["packages"])


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


# -- the house rules (docs/architecture.md) ------------------------------------
#: Where each shipped folder lives in the ``ucm_db`` package.
PACKAGE_OF = {"ucm_db": "ucm_db", "connector": "ucm_db.connector", "migrations": "ucm_db.migrations", "tools": "ucm_db.tools"}
#: Core modules that are public API besides the names in ``ucm_db.__all__``.
PUBLIC_MODULES = {"ucm_db", *(m for m in ucm_db.PUBLIC_MODULES if m != "ucm_db.migrations")}
#: Packages public as a whole (every submodule).
PUBLIC_PACKAGES = ("ucm_db.migrations",)
#: Measuring and demo code: it times and drives the internals it measures, so
#: the public-API rule does not bind it (nothing product-side imports it).
MEASURING = ("tools/bench/", "tools/demo.py")


def _module_name(path: Path) -> str:
    folder, *rest = path.relative_to(ROOT).with_suffix("").parts
    return ".".join([PACKAGE_OF[folder], *[p for p in rest if p != "__init__"]])


def _is_public(module: str, own_package: str) -> bool:
    return (module in PUBLIC_MODULES or module == own_package or module.startswith(own_package + ".")
            or any(module == p or module.startswith(p + ".") for p in PUBLIC_PACKAGES))


def _public_names() -> set[str]:
    import ucm_db

    return set(ucm_db.__all__) | {"__version__"} | {m.split(".", 1)[1] for m in PUBLIC_MODULES if "." in m} | {
        p.split(".", 1)[1] for p in PUBLIC_PACKAGES}


def private_uses(path: Path, own_package: str) -> list[str]:
    """Imports (and ``ucm_db.X`` attribute uses) of ``path`` that are not public API."""
    tree = ast.parse(path.read_text(), filename=str(path))
    public_names = _public_names()
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bad += [f"line {node.lineno}: import {a.name}" for a in node.names
                    if a.name.split(".")[0] == "ucm_db" and not _is_public(a.name, own_package)]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.split(".")[0] == "ucm_db":
            if not _is_public(node.module, own_package):
                bad.append(f"line {node.lineno}: from {node.module} import ...")
            elif node.module == "ucm_db":
                bad += [f"line {node.lineno}: from ucm_db import {a.name}" for a in node.names if a.name not in public_names]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "ucm_db":
            if node.attr not in public_names:
                bad.append(f"line {node.lineno}: ucm_db.{node.attr}")
    return bad


def _product_modules(folder: str) -> list[Path]:
    return [p for p in _modules(folder) if not str(p.relative_to(ROOT)).startswith(MEASURING)]


def test_measuring_code_reaches_the_core_only_through_public_modules() -> None:
    problems = {}
    for path in _modules("tools"):
        relative = str(path.relative_to(ROOT))
        if not relative.startswith(MEASURING):
            continue
        uses = [u for u in private_uses(path, "ucm_db.tools") if "ucm_db.connector" not in u]
        if uses:
            problems[relative] = uses
    assert not problems, f"benchmark or demo code reaching into the core (use ucm_db's public API): {problems}"


@pytest.mark.parametrize("folder", ["tools", "connector"])
def test_tools_and_connector_use_only_the_public_api(folder: str) -> None:
    problems = {str(p.relative_to(ROOT)): private_uses(p, PACKAGE_OF[folder]) for p in _product_modules(folder)}
    problems = {k: v for k, v in problems.items() if v}
    assert not problems, f"private imports (see docs/architecture.md): {problems}"


def test_cli_and_connector_start_load_no_measuring_code() -> None:
    """What ``ucm-db`` and vLLM load at start: no benchmark or demo module,
    and the CLI no vllm or torch."""
    code = (
        "import sys, ucm_db.tools.cli\n"
        "print(sorted(n for n in sys.modules if n.split('.')[0] in ('vllm', 'torch')"
        " or n.startswith(('ucm_db.tools.bench', 'ucm_db.tools.demo', 'ucm_db.connector'))))\n"
        "import ucm_db.connector\n"
        "print(sorted(n for n in sys.modules if n.startswith(('ucm_db.tools.bench', 'ucm_db.tools.demo',"
        " 'ucm_db.connector.bench', 'ucm_db.connector.demo'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    assert out.stdout.split("\n")[:2] == ["[]", "[]"], out.stdout


def test_the_public_api_rule_catches_private_imports(tmp_path: Path) -> None:
    """The checker itself: each kind of private use is caught, public ones pass."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import ucm_db\nfrom ucm_db import Namespace, maintenance, migrations\nfrom ucm_db.errors import ConfigError\n"
        "from ucm_db.migrations.convert import convert\nfrom ucm_db.tools.cli_common import emit\n"
        "from ucm_db.index.local import LocalTier\nfrom ucm_db import codec\nimport ucm_db.remote.link\n"
        "x = ucm_db.open\ny = ucm_db.store\n"
    )
    assert private_uses(sample, "ucm_db.tools") == [
        "line 6: from ucm_db.index.local import ...", "line 7: from ucm_db import codec",
        "line 8: import ucm_db.remote.link", "line 10: ucm_db.store",
    ]


def _shipped_imports(path: Path, modules: set[str]) -> set[str]:
    """Shipped modules that ``path`` imports anywhere (function bodies and
    ``if TYPE_CHECKING:`` blocks too: a deferred or typing-only import still
    ties the two modules together). ``from P import name`` counts as
    importing ``P.name`` when that is a module, else ``P``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                found.add(sub if sub in modules else node.module)
    return found & modules


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module, or with a self-edge."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan; the graph is small, recursion is fine
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return cycles


def test_no_import_cycles_among_shipped_modules() -> None:
    graph = _import_graph()
    assert sum(len(v) for v in graph.values()) > 50  # the walk found the imports
    assert import_cycles(graph) == []


def test_the_cycle_finder_finds_cycles() -> None:
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"a"}, "b": set()}) == [["a"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


#: The core's layers, lowest first (docs/architecture.md, "The layers"): a
#: core module imports its own part (package or top-level module) and parts
#: of lower layers only, never a part of its own layer or of a higher one.
LAYERS: list[tuple[str, set[str]]] = [
    ("foundations", {"ucm_db.errors", "ucm_db.version", "ucm_db.stats", "ucm_db.cpu_placement", "ucm_db.buffers"}),
    ("basics", {"ucm_db.crashpoints", "ucm_db.storelock", "ucm_db.events", "ucm_db.auth", "ucm_db.keys"}),
    ("engines", {"ucm_db.engines"}),
    ("codec", {"ucm_db.codec"}),
    ("settings", {"ucm_db.config", "ucm_db.arguments"}),
    ("block index", {"ucm_db.index"}),
    ("format", {"ucm_db.format"}),
    ("migrations, remote wing", {"ucm_db.migrations", "ucm_db.remote"}),
    ("store", {"ucm_db.store"}),
    ("maintenance", {"ucm_db.maintenance"}),
    ("core doors", {"ucm_db", "ucm_db.components"}),
    ("commit process", {"ucm_db.committer"}),
]
LAYER_OF = {part: rank for rank, (_name, parts) in enumerate(LAYERS) for part in parts}


def core_part(module: str) -> str | None:
    """The layer-table part a core module belongs to (``ucm_db.index.local``
    -> ``ucm_db.index``); None outside the core (connector, tools)."""
    pieces = module.split(".")
    if pieces[0] != "ucm_db" or (len(pieces) > 1 and pieces[1] in ("connector", "tools")):
        return None
    return ".".join(pieces[:2])


def _import_graph() -> dict[str, set[str]]:
    paths = {_module_name(p): p for folder in SHIPPED for p in _modules(folder)}
    return {name: _shipped_imports(path, set(paths)) - {name} for name, path in paths.items()}


def upward_arrows(graph: dict[str, set[str]]) -> list[str]:
    """Core imports that do not run down the layers: ``"importer -> imported"``."""
    def allowed(src: str, dst: str) -> bool:
        src_part, dst_part = core_part(src), core_part(dst)
        if src_part is None or dst_part is None or src_part == dst_part:
            return True
        return LAYER_OF[dst_part] < LAYER_OF[src_part]
    return sorted(f"{src} -> {dst}" for src, dsts in graph.items() for dst in dsts if not allowed(src, dst))


def test_every_core_part_has_a_layer() -> None:
    parts = {core_part(name) for name in _import_graph()} - {None}
    assert parts - set(LAYER_OF) == set(), "a core part is in no layer: add it to LAYERS and docs/architecture.md"
    assert set(LAYER_OF) - parts == set(), "a layer names a part that no longer exists"


def test_no_import_runs_up_the_core_layers() -> None:
    assert upward_arrows(_import_graph()) == []


def test_the_layer_rule_finds_upward_and_sideways_arrows() -> None:
    graph = {
        "ucm_db.config": {"ucm_db.remote.envelope"}, "ucm_db.index.accounting": {"ucm_db.format"},
        "ucm_db.migrations.convert": {"ucm_db.store.view"}, "ucm_db.store": {"ucm_db.index.local", "ucm_db.format"},
        "ucm_db.migrations": {"ucm_db.format", "ucm_db.engines.base", "ucm_db.remote.tier"},
        "ucm_db.remote.warming": {"ucm_db.store", "ucm_db.remote.promotion", "ucm_db.index.local", "ucm_db.keys"},
        "ucm_db.remote.promotion": {"ucm_db.remote.link", "ucm_db.remote.tier"},
        "ucm_db.connector.worker.hooks": {"ucm_db.store"},
    }
    assert upward_arrows(graph) == [
        "ucm_db.config -> ucm_db.remote.envelope", "ucm_db.index.accounting -> ucm_db.format",
        "ucm_db.migrations -> ucm_db.remote.tier", "ucm_db.migrations.convert -> ucm_db.store.view",
        "ucm_db.remote.warming -> ucm_db.store",
    ]


def test_typing_only_imports_count_for_cycles(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ucm_db.store import Store\n")
    assert _shipped_imports(module, {"ucm_db.store"}) == {"ucm_db.store"}


def _put_blocks_calls(path: Path) -> list[tuple[str, bool]]:
    """``(enclosing function, enqueues upload)`` of each ``.put_blocks(...)``
    call in ``path``. An omitted ``enqueue_upload`` is ``put_blocks``' own
    default (read from its signature: False); an expression that is no
    constant counts as enqueueing (the Store's ``wing is not None``)."""
    default = _put_blocks_definition().parameters["enqueue_upload"].default
    tree = ast.parse(path.read_text(), filename=str(path))
    calls = []
    for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(function):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "put_blocks":
                enqueue = next((k.value for k in node.keywords if k.arg == "enqueue_upload"), ast.Constant(default))
                calls.append((function.name, not (isinstance(enqueue, ast.Constant) and not enqueue.value)))
    return calls


def _put_blocks_definition() -> inspect.Signature:
    """The signature of the one ``put_blocks`` the index package defines
    (whichever of its classes holds it)."""
    import ucm_db.index

    found = []
    for info in pkgutil.iter_modules(ucm_db.index.__path__, "ucm_db.index."):
        module = importlib.import_module(info.name)
        found += [cls.put_blocks for cls in vars(module).values()
                  if isinstance(cls, type) and cls.__module__ == module.__name__ and "put_blocks" in vars(cls)]
    assert len(found) == 1, found
    return inspect.signature(found[0])


def test_an_omitted_enqueue_upload_counts_as_put_blocks_default(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        "def omitted(tier, e):\n    tier.put_blocks(e)\n"
        "def refused(tier, e):\n    tier.put_blocks(e, enqueue_upload=False)\n"
        "def queued(tier, e):\n    tier.put_blocks(e, enqueue_upload=True)\n"
        "def decided(tier, e, wing):\n    tier.put_blocks(e, enqueue_upload=wing is not None)\n"
    )
    assert _put_blocks_calls(module) == [("omitted", False), ("refused", False), ("queued", True), ("decided", True)]


def test_fetched_blocks_enter_the_local_tier_through_one_function() -> None:
    """Remote promotion is one function (``ucm_db.remote.promotion.promote``):
    no other module of the wing puts blocks, and nowhere else in the core is
    a block put without queueing it for upload (what a fetched block is)."""
    found: dict[str, set[str]] = {}
    for path in _modules("ucm_db"):
        name = _module_name(path)
        for function, enqueues in _put_blocks_calls(path):
            if name.startswith("ucm_db.remote.") or not enqueues:
                found.setdefault(name, set()).add(function)
    assert found == {"ucm_db.remote.promotion": {"promote"}}


def test_lmdb_page_code_is_reached_only_through_its_package() -> None:
    """The LMDB engine and its page-level code (ucm_db/engines/lmdb/) are one
    fenced package: shipped modules outside it import ``ucm_db.engines.lmdb``'s
    own names, never its submodules (tests may)."""
    graph = _import_graph()
    inside = "ucm_db.engines.lmdb"
    bad = sorted(f"{src} -> {dst}" for src, dsts in graph.items() for dst in dsts
                 if dst.startswith(inside + ".") and not (src == inside or src.startswith(inside + ".")))
    assert bad == [], "import these through ucm_db.engines.lmdb's __init__"


def test_one_list_of_public_modules() -> None:
    """``ucm_db.PUBLIC_MODULES``, this test's rule and docs/architecture.md's
    "Public API is exactly" paragraph name the same modules."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    paragraph = text[text.index('"Public API" is exactly'):]
    paragraph = paragraph[:paragraph.index("PUBLIC_MODULES` holds.")]
    documented = set(re.findall(r"`(ucm_db\.[a-z_.]+)`", paragraph)) - {"ucm_db.__all__", "ucm_db.__version__"}
    assert documented == set(ucm_db.PUBLIC_MODULES)
    assert set(PUBLIC_PACKAGES) | PUBLIC_MODULES == {"ucm_db", *ucm_db.PUBLIC_MODULES}
