"""Measuring code stays apart from product code.

* What the ``ucm-db`` script and vLLM load at start (``ucm_db.tools.cli``,
  ``ucm_db``, ``ucm_db.connector``) imports no benchmark or demo module
  (checked in a fresh interpreter), and no module of the core, the
  connector or the migrations names one (checked statically, so the
  connector's vLLM-importing modules are covered without starting vLLM).
* No command-line entry point parses arguments with argparse: every one is
  on click.
* ``ucm-db bench`` is a click group whose every benchmark imports, is a
  click command named like its key, and documents itself with an example.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from ucm_db.tools.cli_bench import BENCHMARKS, SUMMARIES, bench_group

ROOT = Path(__file__).resolve().parents[1]
MEASURING = ("ucm_db.tools.bench", "ucm_db.tools.demo")


def _measuring(modules: list[str]) -> list[str]:
    return [m for m in modules if any(m == p or m.startswith(p + ".") for p in MEASURING)]


def _modules_after_import(statement: str) -> list[str]:
    code = f"import json, sys\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("statement", [
    "import ucm_db.tools.cli",
    "from ucm_db.tools.cli import cli; cli.main(['inspect', '--help'], standalone_mode=False)",
    "import ucm_db",
    "import ucm_db.connector",
])
def test_start_up_imports_no_measuring_code(statement: str) -> None:
    loaded = _modules_after_import(statement)
    assert "ucm_db" in loaded
    assert _measuring(["ucm_db.tools.bench.core", "ucm_db.tools.demo"]) != []  # the check can fail
    assert _measuring(loaded) == []


def _imports(path: Path) -> list[str]:
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
            names.extend(f"{node.module}.{a.name}" for a in node.names)
    return names


def test_product_code_imports_no_measuring_code() -> None:
    # Static, so it covers the connector without starting vLLM: no module of
    # the core or the connector names a benchmark or the demo.
    offenders = {str(path.relative_to(ROOT)): _measuring(_imports(path))
                 for folder in ("ucm_db", "connector", "migrations") for path in (ROOT / folder).rglob("*.py")}
    assert {path: names for path, names in offenders.items() if names} == {}
    assert _measuring(_imports(ROOT / "tools" / "demo.py")) != []  # the scan sees such imports


def test_no_argparse_anywhere() -> None:
    offenders = [str(path.relative_to(ROOT)) for folder in ("ucm_db", "connector", "tools", "migrations")
                 for path in (ROOT / folder).rglob("*.py") if any(n.split(".")[0] == "argparse" for n in _imports(path))]
    assert offenders == []
    assert "argparse" not in _imports(ROOT / "dev.py")


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_every_benchmark_is_a_documented_click_command(name: str) -> None:
    command = bench_group.get_command(click.Context(bench_group), name)
    assert isinstance(command, click.Command) and command.name == name
    assert command.help and "Example:" in command.help and f"ucm-db bench {name}" in command.help
    result = CliRunner().invoke(bench_group, [name, "--help"])
    assert result.exit_code == 0 and "Example:" in result.output
    assert SUMMARIES[name] == command.get_short_help_str(limit=200)  # what the group's help lists without importing it


def test_the_group_lists_every_benchmark_and_refuses_others() -> None:
    result = CliRunner().invoke(bench_group, ["--help"])
    assert result.exit_code == 0
    for name in BENCHMARKS:
        assert name in result.output
    unknown = CliRunner().invoke(bench_group, ["nonsense"])
    assert unknown.exit_code == 2 and "No such command" in unknown.output


def test_the_groups_help_imports_no_benchmark() -> None:
    """``ucm-db bench --help`` took about 8 s: listing the commands imported every benchmark (torch, vLLM)."""
    code = ("import sys; from click.testing import CliRunner; from ucm_db.tools.cli import cli; "
            "out = CliRunner().invoke(cli, ['bench', '--help']); assert out.exit_code == 0, out.output; "
            "print(sorted(m for m in sys.modules if m.startswith('ucm_db.tools.bench.') or m in ('torch', 'vllm')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


def test_python_m_runs_the_same_group() -> None:
    done = subprocess.run([sys.executable, "-m", "ucm_db.tools.bench", "engines", "--blocks", "16", "--chain-blocks", "8",
                           "--block-bytes", "4096", "--repeat", "1", "--json"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["blocks"] == 16


def test_every_engine_job_resolves_to_a_function() -> None:
    from ucm_db.tools.bench import engine_process

    for job in engine_process.JOBS:
        assert callable(engine_process._resolve(job))
    with pytest.raises(ValueError, match="unknown engine job"):
        engine_process.run_in_new_process("nonsense", {}, ROOT, "x")
