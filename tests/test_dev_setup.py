"""``dev.py``'s set-up does what its docstrings and the README say: torch with
pip first (its bytecode compiled afterwards on every core), the rest with uv
(bytecode compiled), and pip instead where uv fails; the unwanted CUDA
packages removed; the stamp written last, and covering every file the build
reads (setup.py's C sources and headers among them).

The commands are recorded, not run (``dev.run`` replaced): a failing uv is a
fault these machines cannot produce on demand (PyPI answers here), and a real
install takes a minute and 3.5 GB. The README's own test command runs the real
set-up on every CI run.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _dev(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, uv_fails: bool) -> tuple[object, list[list[str]]]:
    spec = importlib.util.spec_from_file_location("dev_under_test", ROOT / "dev.py")
    assert spec is not None and spec.loader is not None
    dev = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dev)
    calls: list[list[str]] = []

    def run(*args: str, check: bool = True, quiet: bool = False) -> None:
        calls.append(list(args))
        if uv_fails and args[1:3] == ("-m", "uv"):
            raise subprocess.CalledProcessError(2, list(args))

    monkeypatch.setattr(dev, "run", run)
    monkeypatch.setattr(dev, "PY", Path(sys.executable))  # an existing interpreter: no venv is created
    monkeypatch.setattr(dev, "STAMP", tmp_path / "stamp")
    return dev, calls


def _installs(calls: list[list[str]]) -> list[str]:
    return [" ".join(c[c.index("install") + 1:]) if "install" in c else " ".join(c[1:]) for c in calls]


def test_setup_installs_torch_with_pip_then_the_rest_with_uv(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    dev, calls = _dev(monkeypatch, tmp_path, uv_fails=False)
    dev.ensure_venv()
    steps = _installs(calls)
    assert calls[0][1:4] == ["-m", "pip", "install"] and steps[0].endswith("--no-compile torch==2.13.0")
    assert calls[2][1:5] == ["-m", "uv", "pip", "install"] and steps[2].endswith(f"-e {ROOT}[vllm,dev]")
    assert "--compile-bytecode" in calls[2]
    assert calls[-2][1:4] == ["-m", "pip", "uninstall"] and set(dev.UNWANTED) <= set(calls[-2])
    assert calls[-1][1:3] == ["-m", "compileall"] and Path(calls[-1][-1]).name == "torch"
    assert not any(c[1:3] == ["-m", "pip"] and c[-1].endswith("[vllm,dev]") for c in calls)
    assert (tmp_path / "stamp").read_text() == dev.install_stamp()


def test_setup_falls_back_to_pip_where_uv_fails(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    dev, calls = _dev(monkeypatch, tmp_path, uv_fails=True)
    dev.ensure_venv()
    assert "installing with uv failed" in capsys.readouterr().out
    pip_project = [c for c in calls if c[1:4] == ["-m", "pip", "install"] and c[-1] == f"{ROOT}[vllm,dev]"]
    assert len(pip_project) == 1
    assert calls.index(pip_project[0]) < len(calls) - 2 and calls[-2][1:4] == ["-m", "pip", "uninstall"]
    assert calls[-1][1:3] == ["-m", "compileall"]
    assert (tmp_path / "stamp").read_text() == dev.install_stamp()


def test_an_installed_venv_with_its_stamp_runs_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    dev, calls = _dev(monkeypatch, tmp_path, uv_fails=False)
    (tmp_path / "stamp").write_text(dev.install_stamp())
    dev.ensure_venv()
    assert calls == []


def _load_dev() -> object:
    spec = importlib.util.spec_from_file_location("dev_under_test", ROOT / "dev.py")
    assert spec is not None and spec.loader is not None
    dev = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dev)
    return dev


def _setup_build_inputs() -> set[str]:
    """The C sources and headers setup.py's extensions read: each Extension's
    ``sources`` and ``depends``, the headers in its ``include_dirs``, and every
    ``#include "..."`` those sources and headers name (found from the file's own
    folder or an include dir)."""
    tree = ast.parse((ROOT / "setup.py").read_text(), filename="setup.py")
    files: set[str] = set()
    include_dirs: list[str] = []
    extensions = [node for node in ast.walk(tree) if isinstance(node, ast.Call)
                  and (getattr(node.func, "id", None) or getattr(node.func, "attr", None)) == "Extension"]
    assert extensions, "setup.py declares no Extension: update this test"
    for call in extensions:
        args = {kw.arg: kw.value for kw in call.keywords}
        if "sources" not in args and len(call.args) > 1:
            args["sources"] = call.args[1]
        assert "sources" in args, "an Extension in setup.py has no sources this test can read"
        for key in ("sources", "depends", "include_dirs"):
            if key in args:
                names = ast.literal_eval(args[key])  # a literal list: a computed one needs this test updated
                if key == "include_dirs":
                    include_dirs.extend(names)
                else:
                    files.update(names)
    for folder in include_dirs:
        files.update(p.relative_to(ROOT).as_posix() for p in (ROOT / folder).glob("*.h"))
    pending = [name for name in files if name.endswith((".c", ".h"))]
    while pending:
        path = ROOT / pending.pop()
        if not path.exists():
            continue
        for included in re.findall(r'^\s*#\s*include\s*"([^"]+)"', path.read_text(), flags=re.M):
            for folder in [path.parent, *(ROOT / d for d in include_dirs)]:
                candidate = (folder / included).resolve()
                if candidate.is_file() and candidate.is_relative_to(ROOT):
                    name = candidate.relative_to(ROOT).as_posix()
                    if name not in files:
                        files.add(name)
                        pending.append(name)
                    break
    return files


def test_every_c_source_and_header_the_build_reads_is_stamped() -> None:
    """A C file or header setup.py compiles from (or that a compiled file
    includes) that dev.py does not stamp would leave a stale extension in an
    installed venv after an edit."""
    dev = _load_dev()
    inputs = _setup_build_inputs()
    assert {"ucm_db/_native.c"} <= inputs, f"setup.py's sources were not found: {sorted(inputs)}"
    stamped = set(dev.stamped_files())
    for name in sorted(inputs):
        assert (ROOT / name).is_file(), f"setup.py names {name}, which does not exist"
        assert name in stamped, f"{name} is read by the build (setup.py) but dev.py does not stamp it: cover it in dev.py's STAMPED or STAMPED_GLOBS"
    assert {"pyproject.toml", "setup.py"} <= stamped


def test_the_stamp_changes_with_any_c_source_or_header(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Editing any one C source or header (or adding a new one) changes the
    stamp, so the next run re-installs and recompiles the extension."""
    dev = _load_dev()
    names = dev.stamped_files()
    for name in names:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / name, tmp_path / name)
    monkeypatch.setattr(dev, "ROOT", tmp_path)
    assert dev.stamped_files() == names
    before = dev.install_stamp()
    c_files = [name for name in names if name.endswith((".c", ".h"))]
    assert {n for n in c_files if n.endswith(".c")} and {n for n in c_files if n.endswith(".h")}
    seen = {before}
    for name in c_files:
        path = tmp_path / name
        original = path.read_bytes()
        path.write_bytes(original + b"\n/* edited */\n")
        changed = dev.install_stamp()
        assert changed not in seen, f"editing {name} does not change dev.py's install stamp"
        seen.add(changed)
        path.write_bytes(original)
        assert dev.install_stamp() == before
    new = tmp_path / "ucm_db" / "_native_new_part.c"
    new.write_text("/* a new source */\n")
    assert "ucm_db/_native_new_part.c" in dev.stamped_files()
    assert dev.install_stamp() != before


@pytest.mark.parametrize("args, split", [([], True), (["--long", "-x", "-q"], True), (["tests/test_a.py"], False),
                                         (["-k", "put"], False), (["-m", "not vllm"], False), (["--part", "2"], False)])
def test_the_suite_splits_in_two_only_when_no_argument_chooses_tests(args: list[str], split: bool) -> None:
    dev: Any = _load_dev()
    assert dev.splits(args) is split


@pytest.mark.parametrize("failing", ["2", "1", None])
def test_two_parts_run_every_test_once_and_fail_when_either_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   capfd: pytest.CaptureFixture[str],
                                                                   failing: str | None) -> None:
    """dev.py's docstring: the two parts (tests/conftest.py's ``--part``) run every test once between them, part
    2's output first, then part 1's log; the command fails if either part does. A tiny tree with the real
    conftest: one test under tests/vllm, one marked vllm elsewhere, one plain."""
    dev: Any = _load_dev()
    (tmp_path / "tests" / "vllm").mkdir(parents=True)
    shutil.copyfile(ROOT / "tests" / "conftest.py", tmp_path / "tests" / "conftest.py")
    verdict = {part: "False" if part == failing else "True" for part in ("1", "2")}
    (tmp_path / "tests" / "vllm" / "test_under_vllm.py").write_text(f"def test_under_vllm():\n    assert {verdict['1']}\n")
    (tmp_path / "tests" / "test_marked.py").write_text("import pytest\n\n@pytest.mark.vllm\ndef test_marked():\n    pass\n\n"
                                                       f"def test_plain():\n    assert {verdict['2']}\n")
    # Part 1 leads its own session: a test looking at its process group sees its own part only.
    (tmp_path / "tests" / "vllm" / "test_own_session.py").write_text(
        "import os\n\n\ndef test_own_session():\n    assert os.getsid(0) == os.getpid()\n")
    monkeypatch.setattr(dev, "ROOT", tmp_path)
    monkeypatch.setattr(dev, "PY", Path(sys.executable))
    code = dev.run_in_two_parts(["-v", "-p", "no:cacheprovider"], dict(os.environ))
    out = capfd.readouterr().out
    assert (code != 0) is (failing is not None), out
    first_log = out[out.index("=== part 1 "):]
    assert "test_plain" in out[: out.index("=== part 1 ")] and "test_plain" not in first_log
    assert "test_under_vllm PASSED" in first_log or failing == "1"
    assert "test_marked PASSED" in first_log and "test_own_session PASSED" in first_log
    runs = {name: sum(out.count(f"::{name} {word}") for word in ("PASSED", "FAILED"))
            for name in ("test_under_vllm", "test_marked", "test_plain")}
    assert runs == {"test_under_vllm": 1, "test_marked": 1, "test_plain": 1}, out
