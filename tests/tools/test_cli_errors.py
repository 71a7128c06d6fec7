"""Hostile stores, remotes and arguments: the CLI reports, it never hangs,
crashes with a traceback or creates what it was only asked to look at.

Commands that looped forever before the fix run in a subprocess with a time
limit, so a regression fails instead of hanging the suite.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

import pytest

import ucm_db
from ucm_db import codec
from ucm_db.index.local import BlockMeta
from ucm_db.remote.tier import RemoteRoot

from cli_stores import NS_A, chain_keys, invoke, invoke_json, make_store, payload

#: Seconds a command may take before it counts as hung (they finish in ~1 s).
HANG_LIMIT_S = 60


def run_cli(*args: Any) -> subprocess.CompletedProcess[str]:
    """The real `ucm-db` entry point in a child process, killed if it hangs."""
    code = "import sys; from ucm_db.tools.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, timeout=HANG_LIMIT_S)


def set_parent(path: Path, key: bytes, parent: bytes) -> None:
    """Rewrites one metadata record to name ``parent`` (damage by hand)."""
    with ucm_db.open(path) as store:
        def run(txn: Any) -> None:
            meta = BlockMeta.unpack(txn.get("meta", key))
            meta.parent = parent
            txn.put("meta", key, meta.pack())
        store._tier.engine.write(run)


@pytest.mark.parametrize("cycle", ["self", "descendant"])
def test_inspect_top_reports_a_parent_cycle_and_verify_fix_removes_it(tmp_path: Path, cycle: str) -> None:
    chains = make_store(tmp_path / "s")
    a0 = chains["a0"]
    set_parent(tmp_path / "s", a0[2], a0[2] if cycle == "self" else a0[4])  # a0[4] descends from a0[2]

    done = run_cli("inspect", tmp_path / "s", "--top", 3, "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    on_cycle = {a0[2].hex()} if cycle == "self" else {a0[2].hex(), a0[3].hex(), a0[4].hex()}
    assert set(report["parent_cycles"]) == on_cycle
    assert sum(c["blocks"] for c in report["hottest_chains"]) <= 23 and len(report["hottest_chains"]) == 3

    fixed = run_cli("verify", tmp_path / "s", "--fix", "--json")
    assert fixed.returncode == 1, fixed.stderr  # found problems are reported even when fixed
    assert {c["key"] for c in json.loads(fixed.stdout)["corrupt"]} == on_cycle
    assert invoke_json("verify", tmp_path / "s")["corrupt"] == []
    with ucm_db.open(tmp_path / "s") as store:
        assert store.lookup(NS_A, a0) == 2  # the blocks before the damage are still served
        assert store.lookup(NS_A, chains["a1"]) == 5


def test_gc_ends_when_remote_objects_name_each_other_as_parent(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'remote'}"
    root = RemoteRoot.from_url(url)
    root.ensure_manifest(NS_A.digest[:16], NS_A.to_dict())  # as an uploader does first: gc touches only ucm-db's namespaces
    tier = root.tier(NS_A.digest[:16])
    x, y, old = chain_keys(NS_A, "cycle", 3)
    tier.store(x, y, codec.encode(x, payload("c", 0), codec="none"))
    tier.store(y, x, codec.encode(y, payload("c", 1), codec="none"))
    tier.store(old, None, codec.encode(old, payload("c", 2), codec="none"))
    ten_days_ago = time.time() - 10 * 86400
    os.utime(tier.path(old), (ten_days_ago, ten_days_ago))

    done = run_cli("gc", url, "--older-than", "7d", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["removed_by_rule"] == 1 and report["removed_descendants"] == 2  # no root holds the cycle up
    assert tier.exists([x, y, old]) == [False, False, False]


def json_error(result: Any, exit_code: int = 2) -> dict[str, Any]:
    """The error document of a failed ``--json`` command (and no traceback)."""
    assert result.exit_code == exit_code, f"exit {result.exit_code}\n{result.stdout}\n{result.stderr}"
    assert "Traceback" not in result.stdout + result.stderr
    error = json.loads(result.stdout)["error"]
    assert error["hint"] and error["message"] and error["exit_code"] == exit_code
    assert f"ucm-db: error: {error['message']}" in result.stderr  # the human line still goes to stderr
    return error


def write_tar(path: Path, members: dict[str, bytes]) -> None:
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_import_of_a_file_that_is_not_a_tar_archive(tmp_path: Path) -> None:
    (tmp_path / "notes.tar").write_bytes(b"just some text, not a tar archive\n" * 40)
    error = json_error(invoke("import", tmp_path / "notes.tar", tmp_path / "s", "--json", expect=None))
    assert error["type"] == "ConfigError" and "not a tar archive" in error["message"]
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("missing", ["namespaces", "blocks"])
def test_import_of_a_manifest_missing_a_section(tmp_path: Path, missing: str) -> None:
    manifest = {"format": "ucm-db-export", "version": 1, "namespaces": {}, "blocks": []}
    del manifest[missing]
    write_tar(tmp_path / "a.tar", {"manifest.json": json.dumps(manifest).encode()})
    error = json_error(invoke("import", tmp_path / "a.tar", tmp_path / "s", "--json", expect=None))
    assert missing in error["message"]


def test_import_into_a_path_that_is_a_file_changes_nothing(tmp_path: Path) -> None:
    make_store(tmp_path / "s")
    invoke("export", tmp_path / "s", tmp_path / "a.tar")
    (tmp_path / "target").write_bytes(b"precious")
    error = json_error(invoke("import", tmp_path / "a.tar", tmp_path / "target", "--json", expect=None))
    assert "is a file" in error["message"]
    assert (tmp_path / "target").read_bytes() == b"precious"


def test_export_into_a_missing_directory(tmp_path: Path) -> None:
    make_store(tmp_path / "s")
    error = json_error(invoke("export", tmp_path / "s", tmp_path / "no" / "such" / "a.tar", "--json", expect=None))
    assert "does not exist" in error["message"] and "mkdir" in error["hint"]
    assert not (tmp_path / "no").exists()


@pytest.mark.parametrize("size", ["5ib", "ib", "5 kbb", "5x"])
def test_gc_refuses_a_malformed_size(tmp_path: Path, size: str) -> None:
    error = json_error(invoke("gc", f"file://{tmp_path}", "--max-bytes", size, "--json", expect=None))
    assert "cannot read size" in error["message"]


def test_gc_reads_well_formed_sizes() -> None:
    from ucm_db.tools.remote_cmds import parse_size_bytes

    assert [parse_size_bytes(s) for s in ("4096", "4096b", "5k", "500MB", "10GiB", "1.5 TiB")] == [
        4096, 4096, 5000, 500_000_000, 10 << 30, int(1.5 * (1 << 40))]


@pytest.mark.parametrize("command", ["inspect", "verify", "compact", "export", "migrate"])
def test_every_json_command_prints_its_error_as_json(tmp_path: Path, command: str) -> None:
    extra = [tmp_path / "a.tar"] if command == "export" else []
    error = json_error(invoke(command, tmp_path / "nothing-here", *extra, "--json", expect=None))
    assert error["type"] == "ConfigError" and "no ucm-db store" in error["message"]
    assert not (tmp_path / "nothing-here").exists()


def test_json_errors_of_the_remote_commands(tmp_path: Path) -> None:
    error = json_error(invoke("gc", f"file://{tmp_path}", "--json", expect=None))
    assert "--older-than" in error["message"]
    (tmp_path / "keys.txt").write_text("zz-not-hex\n")
    error = json_error(invoke("warm", tmp_path / "s", "--remote", f"file://{tmp_path / 'r'}", "--namespace", "x",
                              "--keys", tmp_path / "keys.txt", "--json", expect=None))
    assert "cannot read" in error["message"]
    error = json_error(invoke("import", tmp_path / "missing.tar", tmp_path / "s", "--json", expect=None))
    assert "missing.tar" in error["message"]


def test_a_usage_error_under_json_is_json_too(tmp_path: Path) -> None:
    result = invoke("verify", tmp_path, "--sample", "0", "--json", expect=None)
    assert result.exit_code == 2
    assert json.loads(result.stdout)["error"]["type"] == "BadParameter"


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_looking_at_a_store_without_its_data_file_creates_none(tmp_path: Path, command: str) -> None:
    make_store(tmp_path / "s")
    (tmp_path / "s" / "lmdb" / "data.mdb").unlink()
    error = json_error(invoke(command, tmp_path / "s", "--json", expect=None))
    assert "data.mdb" in error["message"]
    assert not (tmp_path / "s" / "lmdb" / "data.mdb").exists()


def test_export_into_a_directory_that_refuses_files(tmp_path: Path) -> None:
    make_store(tmp_path / "s")  # /proc exists but takes no new files, even from root
    error = json_error(invoke("export", tmp_path / "s", "/proc/ucm-db-test.tar", "--json", expect=None), exit_code=1)
    assert error["type"] == "TierError" and "/proc" in error["hint"]
    assert not Path("/proc/ucm-db-test.tar.partial").exists()


@pytest.mark.parametrize("record", [b"settings", b"format_version", b"created"])
def test_verify_and_inspect_report_a_damaged_store_record(tmp_path: Path, record: bytes) -> None:
    """The store refuses to open with such a record and points at verify:
    verify must then report it (exit 1), and inspect show it (exit 1: a
    problem found, issue 46 finding 7), not fail."""
    make_store(tmp_path / "s")
    with ucm_db.open(tmp_path / "s") as store:
        store._tier.engine.write(lambda txn: txn.put("info", record, b"\x00\xffgarbage"))
    report = invoke_json("verify", tmp_path / "s", expect=1)
    assert report["checked"] == 23 and report["corrupt"] == []
    assert any(f"'{record.decode()}' is damaged" in p for p in report["index_problems"]), report["index_problems"]
    shown = invoke_json("inspect", tmp_path / "s", expect=1)
    assert shown["blocks"] == 23 and any(record.decode() in d for d in shown["damaged_records"])


def test_a_command_exiting_with_a_message_prints_it(monkeypatch, capsys) -> None:
    # A job that fails with SystemExit("...") (the benchmarks' engine jobs
    # do) must show its message, as `python -c 'sys.exit("...")'` would.
    from ucm_db.tools import cli as cli_module

    def failing_main(**_: Any) -> None:
        raise SystemExit("engine job failed: see its log")

    monkeypatch.setattr(cli_module.cli, "main", failing_main)
    assert cli_module.main(["inspect", "x"]) == cli_module.EXIT_PROBLEMS
    assert "engine job failed: see its log" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["import", "warm", "export-to", "to-engine-dest", "compact", "verify", "inspect", "invalidate",
                                     "events", "migrate"])
def test_an_empty_path_argument_is_a_usage_error_and_creates_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     command: str) -> None:
    """Issue 26 item 15 through the CLI: pathlib reads "" as ".", so
    `ucm-db import ARCHIVE ""` created a store in the current directory
    (``ucm_db.open("")`` is refused, but the CLI passed it ``Path(".")``)."""
    make_store(tmp_path / "s")
    invoke("export", tmp_path / "s", tmp_path / "a.tar")
    (tmp_path / "keys.txt").write_text("00" * 32 + "\n")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    args = {"import": ["import", tmp_path / "a.tar", ""],
            "warm": ["warm", "", "--remote", f"file://{tmp_path / 'r'}", "--namespace", "m", "--keys", tmp_path / "keys.txt"],
            "export-to": ["export", tmp_path / "s", ""],
            "to-engine-dest": ["migrate", "--to-engine", "rocksdb", tmp_path / "s", ""]}.get(command, [command, ""])
    result = invoke(*args, expect=2)
    assert "empty path" in result.stderr, result.stderr
    assert list(cwd.iterdir()) == []


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_a_path_with_a_name_too_long_is_a_usage_error_without_a_traceback(tmp_path: Path, command: str) -> None:
    """Issue 46 finding 11: the checking child printed its traceback (and
    the 5000-byte name twice) before the error."""
    path = tmp_path / ("a" * 5000)
    result = subprocess.run([sys.executable, "-m", "ucm_db.tools.cli", command, str(path)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and "name of 5000 bytes" in result.stderr
    assert len(result.stderr) < 1000, "the name is not echoed in full"


@pytest.mark.parametrize("command", [
    ["pin", "{L}", "--namespace", "m", "--tokens", "{T}"], ["lookup", "{L}", "--namespace", "m", "--tokens", "{T}"],
    ["unpin", "{L}", "--namespace", "m", "--tokens", "{T}"], ["invalidate", "{L}", "--namespace", "m"],
    ["events", "{L}"], ["compact", "{L}"], ["export", "{L}", "{D}/x.tar"], ["import", "{D}/x.tar", "{L}"],
    ["migrate", "{L}"], ["migrate", "--to-engine", "rocksdb", "{L}", "{D}/dest"], ["inspect", "{L}"], ["verify", "{L}"],
], ids=lambda c: " ".join(c[:3]))
def test_a_store_path_no_file_system_takes_is_a_usage_error_not_a_traceback(tmp_path: Path, command: list[str]) -> None:
    """A name over 255 bytes: the path checks raised OSError (ENAMETOOLONG) past every handler."""
    tokens = tmp_path / "p.jsonl"
    tokens.write_text("[1, 2, 3, 4]\n")
    long_path = tmp_path / ("y" * 300)
    args = [a.format(L=long_path, T=tokens, D=tmp_path) for a in command]
    result = invoke(*args, expect=2)
    assert "Traceback" not in result.stderr and "hint:" in result.stderr, result.stderr
