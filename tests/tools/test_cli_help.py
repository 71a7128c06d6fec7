"""Every command is documented with an example; the real entry point works."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ucm_db.tools.cli import cli

from cli_stores import invoke, make_store

COMMANDS = ["inspect", "verify", "compact", "gc", "export", "import", "warm", "bench", "migrate", "invalidate", "events", "proxy",
            "pin", "unpin", "lookup"]


def test_group_lists_every_command() -> None:
    assert sorted(cli.commands) == sorted(COMMANDS)
    out = invoke("--help").stdout
    for name in COMMANDS:
        assert name in out


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_has_help_with_an_example(name: str) -> None:
    command = cli.commands[name]
    assert command.help and "Example:" in command.help and f"ucm-db {name}" in command.help
    out = invoke(name, "--help").stdout
    assert "Example:" in out and f"ucm-db {name}" in out


def test_usage_error_exits_2() -> None:
    result = invoke("inspect", expect=2)
    assert "Missing argument" in result.stderr


def test_real_entry_point_in_a_subprocess(tmp_path: Path) -> None:
    make_store(tmp_path / "s")
    exe = Path(sys.executable).parent / "ucm-db"
    assert exe.exists(), "ucm-db is not installed in this environment (pip install -e .)"
    done = subprocess.run([str(exe), "inspect", str(tmp_path / "s"), "--json"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["blocks"] == 23
    missing = subprocess.run([str(exe), "verify", str(tmp_path / "nothing")], capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "no ucm-db store" in missing.stderr
    assert not (tmp_path / "nothing").exists()  # looking never creates a store


def test_bench_delegates_and_compares_engines() -> None:
    assert "ucm-db bench core" in invoke("bench", "--help").stdout
    report = json.loads(invoke("bench", "engines", "--blocks", 32, "--chain-blocks", 8, "--block-bytes", 4096, "--repeat", 1, "--json").stdout)
    assert set(report["engines"]) == {"lmdb", "rocksdb"} and report["blocks"] == 32
    assert all(e["put_MBps"] > 0 and e["get_MBps"] > 0 for e in report["engines"].values())


#: Commands without ``--json`` (README: ``events`` streams JSON lines, ``proxy`` serves HTTP, ``bench`` is a group).
NO_JSON = {"events", "proxy", "bench"}


def test_every_command_and_benchmark_offers_json_but_the_named_few() -> None:
    """README: every command prints human output by default and JSON with
    ``--json``, but the ones it names; so does every benchmark."""
    from ucm_db.tools.cli_bench import BENCHMARKS, bench_group

    def has_json(command: object) -> bool:
        return any("--json" in getattr(param, "opts", ()) for param in command.params)  # type: ignore[attr-defined]

    assert sorted(name for name in COMMANDS if not has_json(cli.commands[name])) == sorted(NO_JSON)
    lacking = [name for name in BENCHMARKS if not has_json(bench_group.get_command(None, name))]  # type: ignore[arg-type]
    assert lacking == []
