"""Damaged LMDB files and unusable store paths: reported, never crashed on.

Every damage is made for real on a real store: a truncated ``data.mdb`` (a
SIGBUS for any process mapping it), only its last page cut, one zeroed leaf
page (an LMDB assertion, SIGABRT, for an in-process page walk), a file that
is not LMDB, ``data.mdb`` a directory, ``lmdb/`` a file, a store path on a
read-only tmpfs mounted by the test. Each must give a ``TierError`` whose
hint names its own fix, leave the files as they were, and release the store.
Reads that could crash run in forked children, so a regression fails the
test instead of killing pytest.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

import ucm_db
from ucm_db.errors import TierError
from ucm_db.storelock import StoreLock, ensure_store_dir
from ucm_db.engines.lmdb import LmdbEngine
from ucm_db.engines.lmdb.checks import diagnose
from ucm_db.engines.lmdb.meta import check_file

from .harness import NS, chain_tokens, payload_for, run_child, tail

BLOCKS = 24
BLOCK_BYTES = 20 << 10
PAGE = 4096
DISK_HINT = "local, writable disk"


def _keys() -> list[bytes]:
    return NS.block_keys(chain_tokens("damaged-files", BLOCKS))


def _store(tmp_path: Path) -> tuple[Path, Path]:
    path = tmp_path / "store"
    keys = _keys()
    with ucm_db.open(path, durability="sync", capacity_bytes=64 << 20) as store:
        store.put(NS, keys, [payload_for(k, BLOCK_BYTES) for k in keys])
    return path, path / "lmdb" / "data.mdb"


def _assert_released(path: Path) -> None:
    with StoreLock(path) as lock:
        assert lock.try_exclusive(), "a refused open must not keep holding the store"


def _open_refused(path: Path, match: str) -> TierError:
    with pytest.raises(TierError, match=match) as info:
        ucm_db.open(path)
    assert DISK_HINT not in info.value.hint, f"generic hint for a specific failure: {info.value.hint}"
    _assert_released(path)
    return info.value


@pytest.mark.parametrize("cut", ["half", "last_page"])
def test_truncated_data_file_is_a_clear_error_not_a_sigbus(tmp_path: Path, cut: str) -> None:
    path, data = _store(tmp_path)
    size = data.stat().st_size
    new_size = size // 2 if cut == "half" else size - PAGE
    os.truncate(data, new_size)
    error = _open_refused(path, "truncated")
    assert f"ucm-db verify {path}" in error.hint and "aside" in error.hint
    assert data.stat().st_size == new_size, "a refused open changes nothing"
    problem = diagnose(path)
    assert problem is not None and "truncated" in problem
    assert not check_file(data).ok


def _zero_leaf_page_holding(data: Path, needle: bytes) -> int:
    raw = bytearray(data.read_bytes())
    for page in range(2, len(raw) // PAGE):
        start = page * PAGE
        flags = int.from_bytes(raw[start + 10:start + 12], "little")
        if flags == 0x02 and needle in raw[start:start + PAGE]:  # P_LEAF
            raw[start:start + PAGE] = bytes(PAGE)
            data.write_bytes(raw)
            return page
    raise AssertionError("no leaf page holds the key")


def _read_in_child(path: str, result: Path) -> None:
    outcome: dict[str, str] = {}
    try:
        with ucm_db.open(path) as store:
            got = store.get(NS, _keys())
            outcome["got"] = "wrong" if any(g is not None and g != payload_for(k, BLOCK_BYTES) for k, g in zip(_keys(), got)) else "ok"
    except TierError as exc:
        outcome["error"], outcome["hint"] = str(exc), exc.hint
    result.write_text(json.dumps(outcome))


def test_zeroed_leaf_page_is_found_by_a_child_walk_and_never_served(tmp_path: Path) -> None:
    path, data = _store(tmp_path)
    _zero_leaf_page_holding(data, _keys()[BLOCKS // 2])
    assert check_file(data).ok, "the meta pages are intact: only a page walk can find this"
    problem = diagnose(path)
    assert problem is not None, "the walk must report the zeroed page"
    assert "signal" in problem or "MDB_" in problem or "Error" in problem, problem
    result = tmp_path / "result.json"
    code = run_child(_read_in_child, str(path), result, log_path=tmp_path / "child.log", timeout_s=60)
    assert code == 0, f"the Store API crashed on a damaged page:\n{tail(tmp_path / 'child.log')}"
    outcome = json.loads(result.read_text())
    assert outcome.get("got") != "wrong", "damaged bytes were served"
    if "error" in outcome:
        assert f"ucm-db verify {path}" in outcome["hint"], outcome


def test_intact_store_diagnoses_clean_and_diagnose_creates_nothing(tmp_path: Path) -> None:
    path, _ = _store(tmp_path)
    assert diagnose(path) is None
    empty = tmp_path / "empty"
    (empty / "lmdb").mkdir(parents=True)
    assert diagnose(empty) is None
    assert sorted(os.listdir(empty / "lmdb")) == [], "diagnose must not create data.mdb or lock.mdb"


def test_not_an_lmdb_file_has_its_own_hint(tmp_path: Path) -> None:
    path, data = _store(tmp_path)
    data.write_bytes(b"this is not LMDB " * 1000)
    error = _open_refused(path, "not an LMDB data file")
    assert "aside" in error.hint


def test_data_file_that_is_a_directory(tmp_path: Path) -> None:
    path, data = _store(tmp_path)
    data.unlink()
    data.mkdir()
    error = _open_refused(path, "not a regular file")
    assert f"move {data} away" in error.hint


def test_lmdb_dir_that_is_a_file(tmp_path: Path) -> None:
    path = tmp_path / "store"
    path.mkdir()
    (path / "lmdb").write_text("not a directory")
    with pytest.raises(TierError, match="is a file") as info:
        ucm_db.open(path, engine="lmdb")
    assert f"move {path / 'lmdb'} away" in info.value.hint
    assert (path / "lmdb").read_text() == "not a directory"
    _assert_released(path)


def test_store_path_that_is_a_file(tmp_path: Path) -> None:
    target = tmp_path / "file"
    target.write_text("x")
    for path in (target, target / "store"):
        with pytest.raises(TierError, match="is a file, not a directory") as info:
            ensure_store_dir(path)
        assert f"move {target} away" in info.value.hint
        with pytest.raises(TierError, match="is a file") as info:
            LmdbEngine(path / "lmdb", map_size_bytes=1 << 26, sync=True).read(lambda txn: None)
        assert f"move {target} away" in info.value.hint
    assert target.read_text() == "x"


def test_same_store_twice_in_one_process_has_its_own_hint(tmp_path: Path) -> None:
    path, _ = _store(tmp_path)
    with ucm_db.open(path) as store:
        with pytest.raises(TierError, match="already open") as info:
            ucm_db.open(path)
        assert "once per process" in info.value.hint
        assert len(store.get(NS, _keys()[:1])) == 1


@pytest.fixture
def tmpfs_dir(tmp_path: Path) -> Iterator[Path]:
    mount_point = tmp_path / "tmpfs"
    mount_point.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount_point)],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, f"mounting a tmpfs needs root: {proc.stderr.strip()}"
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def test_store_on_a_read_only_file_system(tmpfs_dir: Path) -> None:
    old = tmpfs_dir / "old"
    with ucm_db.open(old, durability="sync") as store:
        store.put(NS, _keys()[:2], [b"a", b"b"])
    subprocess.run(["mount", "-o", "remount,ro", str(tmpfs_dir)], check=True)
    with pytest.raises(TierError, match="read-only") as info:
        ensure_store_dir(tmpfs_dir / "new")
    assert "writable" in info.value.hint and "read-write" in info.value.hint
    with pytest.raises(TierError, match="read-only"):
        LmdbEngine(tmpfs_dir / "new" / "lmdb", map_size_bytes=1 << 26, sync=True).read(lambda txn: None)
    with pytest.raises(TierError, match="read-only") as info:
        ucm_db.open(old)  # an existing store: its lock file cannot be opened for writing
    assert "read-write" in info.value.hint
