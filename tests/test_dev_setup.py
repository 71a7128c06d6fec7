"""``dev.py``'s set-up does what its docstrings and the README say: torch with
pip first (its bytecode compiled afterwards on every core), the rest with uv
(bytecode compiled), and pip instead where uv fails; the unwanted CUDA
packages removed; the stamp written last.

The commands are recorded, not run (``dev.run`` replaced): a failing uv is a
fault these machines cannot produce on demand (PyPI answers here), and a real
install takes a minute and 3.5 GB. The README's own test command runs the real
set-up on every CI run.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

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
