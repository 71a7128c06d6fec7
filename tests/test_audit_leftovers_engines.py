"""Audit: a store directory holding both ``lmdb/`` and ``rocksdb/``.

An older ucm-db whose creators raced (before ``hold_creation``), or a copy by
hand, could leave both engine directories in one store path. Every open then
picked ``lmdb/`` silently: the RocksDB store's blocks were invisible, and a
later command (``verify --fix``, ``compact``, ``gc``) acted on whichever
engine came first. Now every open of such a directory, read-write or
read-only, through ``ucm_db.open``, the maintenance views or the CLI, with or
without ``engine``, is a ConfigError naming both directories and the fix,
and creates or changes nothing there. An empty engine directory beside a
real one is refused too (its fix is an ``rmdir``): see
:mod:`ucm_db.store.path`'s invariants for why it is not ignored.

The stores are real: an LMDB and a RocksDB store each written by ucm-db,
whose engine directories are then moved into one fresh directory (no lock
file there, so an open that got as far as locking would leave one).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import ucm_db
from ucm_db import ConfigError, Namespace, maintenance
from ucm_db.tools.cli import cli

pytest.importorskip("rocksdict")

NS = Namespace(model="test/two-engines", kv_dtype="bfloat16", block_size=16)
BLOCK_BYTES = 2048


def _chain(tag: int, blocks: int) -> list[bytes]:
    return NS.block_keys([tag * 1000 + i for i in range(blocks * NS.block_size)])


def _write_store(path: Path, engine: str, tag: int, blocks: int) -> list[bytes]:
    keys = _chain(tag, blocks)
    with ucm_db.open(path, engine=engine, capacity_bytes=64 << 20, codec="none") as store:
        store.put(NS, keys, [bytes([tag]) * BLOCK_BYTES for _ in keys])
    return keys


@pytest.fixture
def two_engines(tmp_path: Path) -> dict[str, Any]:
    """A directory holding a real LMDB store's ``lmdb/`` (3 blocks) and a
    real RocksDB store's ``rocksdb/`` (5 other blocks), and nothing else."""
    lmdb_keys = _write_store(tmp_path / "a", "lmdb", 1, 3)
    rocks_keys = _write_store(tmp_path / "b", "rocksdb", 2, 5)
    both = tmp_path / "both"
    both.mkdir(mode=0o700)
    shutil.move(str(tmp_path / "a" / "lmdb"), str(both / "lmdb"))
    shutil.move(str(tmp_path / "b" / "rocksdb"), str(both / "rocksdb"))
    return {"path": both, "lmdb": lmdb_keys, "rocksdb": rocks_keys}


def _tree(path: Path) -> dict[str, tuple[int, int, int]]:
    """Every name under ``path`` with its mode, size and mtime (ns)."""
    out = {}
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            st = os.lstat(os.path.join(root, name))
            out[os.path.relpath(os.path.join(root, name), path)] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return out


def _moved_by_hint(hint: str, path: Path) -> str:
    """The engine directory the hint's command moves out (it names one)."""
    moved = [name for name in ("lmdb", "rocksdb") if f"`mkdir {path}.{name} && mv {path / name} {path}.{name}/`" in hint]
    assert len(moved) == 1, hint
    return moved[0]


def _assert_names_both(text: str, path: Path) -> None:
    assert f"{path / 'lmdb'}/" in text and f"{path / 'rocksdb'}/" in text, text
    assert "two engine directories" in text, text


OPENS = {
    "writable": {},
    "read_only": {"read_only": True},
    "writable, engine=lmdb": {"engine": "lmdb"},
    "writable, engine=rocksdb": {"engine": "rocksdb"},
    "read_only, engine=lmdb": {"read_only": True, "engine": "lmdb"},
    "read_only, engine=rocksdb": {"read_only": True, "engine": "rocksdb"},
}


@pytest.mark.parametrize("options", OPENS.values(), ids=list(OPENS))
def test_store_open_of_a_directory_with_both_engines_is_refused_and_changes_nothing(
        two_engines: dict[str, Any], options: dict[str, Any]) -> None:
    path = two_engines["path"]
    before = _tree(path)
    with pytest.raises(ConfigError) as caught:
        ucm_db.open(path, **options)
    _assert_names_both(str(caught.value), path)
    moved = _moved_by_hint(caught.value.hint, path)
    assert f"ucm-db inspect {path}.{moved}" in caught.value.hint
    assert _tree(path) == before  # no lock file, no engine file, no snapshot record: nothing


@pytest.mark.parametrize("command", [["inspect"], ["verify"], ["verify", "--fix"], ["compact"], ["events"], ["migrate"],
                                     ["migrate", "--dry-run"]])
def test_cli_opens_of_a_directory_with_both_engines_are_refused_and_change_nothing(
        two_engines: dict[str, Any], tmp_path: Path, command: list[str]) -> None:
    path = two_engines["path"]
    before = _tree(path)
    result = CliRunner().invoke(cli, [*command, str(path)], catch_exceptions=False)
    assert result.exit_code == 2, (result.exit_code, result.stdout, result.stderr)  # a usage error: the user must act
    _assert_names_both(result.stderr, path)
    assert "mkdir" in result.stderr and "mv " in result.stderr
    assert _tree(path) == before


def test_export_and_conversion_of_a_directory_with_both_engines_are_refused(two_engines: dict[str, Any], tmp_path: Path) -> None:
    path = two_engines["path"]
    before = _tree(path)
    for args in (["export", str(path), str(tmp_path / "out.tar")],
                 ["migrate", "--to-engine", "lmdb", str(path), str(tmp_path / "converted")]):
        result = CliRunner().invoke(cli, args, catch_exceptions=False)
        assert result.exit_code == 2, (args, result.stdout, result.stderr)
        _assert_names_both(result.stderr, path)
    assert not (tmp_path / "out.tar").exists() and not (tmp_path / "converted").exists()
    with pytest.raises(ConfigError, match="two engine directories"):
        with maintenance.open_view(path):
            pass
    assert _tree(path) == before


def test_the_hint_moves_one_out_and_each_store_then_opens_with_its_blocks(two_engines: dict[str, Any]) -> None:
    """Following the hint: its command, run by a shell as a user would, moves
    one engine directory out into a directory of its own; both stores then
    open (the moved one through ``ucm-db inspect`` too, as the hint says),
    each with its own blocks and none of the other's."""
    path = two_engines["path"]
    with pytest.raises(ConfigError) as caught:
        ucm_db.open(path)
    hint = caught.value.hint
    moved = _moved_by_hint(hint, path)
    command = hint.split("`")[1]
    subprocess.run(["sh", "-c", command], check=True)
    kept = "lmdb" if moved == "rocksdb" else "rocksdb"
    aside = Path(f"{path}.{moved}")
    for where, engine in ((path, kept), (aside, moved)):
        with ucm_db.open(where, read_only=True) as store:
            assert store.config.engine == engine
            other = "lmdb" if engine == "rocksdb" else "rocksdb"
            assert store.lookup(NS, two_engines[engine]) == len(two_engines[engine])
            assert store.lookup(NS, two_engines[other]) == 0
    result = CliRunner().invoke(cli, ["inspect", str(aside)], catch_exceptions=False)
    assert result.exit_code == 0 and moved in result.stdout
    # The hint's way to keep the moved store's blocks too: export it, import the archive into the kept one.
    archive = path.with_name("moved.tar")
    for args in (["export", str(aside), str(archive)], ["import", str(archive), str(path)]):
        result = CliRunner().invoke(cli, args, catch_exceptions=False)
        assert result.exit_code == 0, (args, result.stdout, result.stderr)
    with ucm_db.open(path, read_only=True) as store:
        assert store.config.engine == kept
        assert [store.lookup(NS, two_engines[name]) for name in ("lmdb", "rocksdb")] == [3, 5]


@pytest.mark.parametrize("empty", ["lmdb", "rocksdb"])
def test_an_empty_engine_directory_beside_a_store_is_refused_with_rmdir_as_the_fix(tmp_path: Path, empty: str) -> None:
    """The failed-creation case: one engine directory holds no file at all.
    Still refused (ucm_db.migrations reads the first engine directory, so
    ignoring an empty lmdb/ here would leave migrate to create a second
    store in it); the hint is the one rmdir that makes it one store."""
    kept = "rocksdb" if empty == "lmdb" else "lmdb"
    path = tmp_path / "s"
    keys = _write_store(path, kept, 3, 4)
    (path / empty).mkdir()
    before = _tree(path)
    for options in ({}, {"read_only": True}, {"engine": kept}):
        with pytest.raises(ConfigError) as caught:
            ucm_db.open(path, **options)
        assert f"{path / empty}/ (empty)" in str(caught.value)
        assert caught.value.hint.endswith(f"rmdir {path / empty}"), caught.value.hint
    assert _tree(path) == before
    os.rmdir(path / empty)
    with ucm_db.open(path) as store:
        assert store.config.engine == kept and store.lookup(NS, keys) == 4
