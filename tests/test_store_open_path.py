"""What ``ucm_db.open`` refuses about its path, before creating anything
(issue 26, items 14 and 15): an empty path (it created a store in the
current directory), a path inside another store (``open(STORE/lmdb)``
nested a store among the first one's files), bytes or None (raw
TypeError), a name over the file system's limit (raw OSError), and an
unreadable store, writable or read-only (raw PermissionError)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import ucm_db
from ucm_db import ConfigError, Namespace

from other_user import NOBODY, error_outcome, run_as_nobody, unreadable as unreadable_for_a_while

NS = Namespace(model="open-path", kv_dtype="bfloat16", block_size=4)
KEYS = NS.block_keys(list(range(8)))
PAYLOADS = [b"a" * 300, b"b" * 300]


def files_under(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    with ucm_db.open(tmp_path / "s") as store:
        store.put(NS, KEYS, PAYLOADS)
    return tmp_path / "s"


def test_an_empty_path_creates_nothing_in_the_current_directory(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="empty") as raised:
        ucm_db.open("")
    assert "'.'" in raised.value.hint
    assert files_under(tmp_path) == []


@pytest.mark.parametrize("path", [b"/tmp/ucm-db-bytes-path", None, 5])
def test_a_path_that_is_not_str_or_pathlike_is_a_config_error(path) -> None:
    with pytest.raises(ConfigError, match="str or os.PathLike") as raised:
        ucm_db.open(path)
    assert raised.value.hint


@pytest.mark.parametrize("inner", ["lmdb", "lmdb/deeper", "other/dir", "ucm-db.lock/x"])
def test_a_path_inside_another_store_is_refused(store_dir: Path, inner: str) -> None:
    before = files_under(store_dir)
    with pytest.raises(ConfigError, match="inside the ucm-db store") as raised:
        ucm_db.open(store_dir / inner)
    assert str(store_dir) in raised.value.hint
    assert files_under(store_dir) == before, "nothing created inside the store"
    with ucm_db.open(store_dir) as store:
        assert store.get(NS, KEYS) == PAYLOADS


def test_a_symlink_into_a_store_is_refused(store_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "link").symlink_to(store_dir / "lmdb")
    with pytest.raises(ConfigError, match="inside the ucm-db store"):
        ucm_db.open(tmp_path / "link", read_only=True)


def test_beside_a_store_or_under_an_unrelated_lmdb_directory_is_fine(store_dir: Path, tmp_path: Path) -> None:
    # A directory that merely has an "lmdb" subdirectory is no store.
    (tmp_path / "app" / "lmdb").mkdir(parents=True)
    for path in (tmp_path / "s2", tmp_path / "app" / "cache"):
        with ucm_db.open(path) as store:
            store.put(NS, KEYS, PAYLOADS)


def test_a_name_over_the_length_limit_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="300 bytes") as raised:
        ucm_db.open(tmp_path / ("x" * 300) / "store")
    assert "255" in raised.value.hint
    assert files_under(tmp_path) == []


def as_other_user(store_dir: Path, unreadable_path: Path, fn: Callable[[], object]) -> dict[str, str]:
    """Runs ``fn`` as a user without access to ``unreadable_path``: as root
    (who reads everything), as ``nobody`` after the store is handed to that
    user (other_user.run_as_nobody); else here. Returns the error fn raised
    (other_user.error_outcome), or type "skip" where permissions cannot be
    taken away here."""
    def outcome() -> dict[str, str]:
        try:
            os.listdir(unreadable_path) if unreadable_path.is_dir() else unreadable_path.open("rb").close()
            return {"type": "skip", "text": f"{unreadable_path} stays readable (permissions not enforced here)"}
        except PermissionError:
            return error_outcome(fn)

    if os.geteuid() == 0:
        for path in [store_dir, *store_dir.rglob("*")]:
            os.chown(path, NOBODY, NOBODY)
    return run_as_nobody(outcome)


@pytest.fixture
def shared_store_dir() -> Iterator[Path]:
    """A store in a directory of its own that another user can traverse
    (pytest's tmp_path lies under a directory only its owner enters)."""
    parent = Path(tempfile.mkdtemp(prefix="ucm-db-perm-"))
    parent.chmod(0o711)
    try:
        with ucm_db.open(parent / "s") as store:
            store.put(NS, KEYS, PAYLOADS)
        yield parent / "s"
    finally:
        shutil.rmtree(parent)


@pytest.mark.parametrize("read_only", [False, True], ids=["writable", "read_only"])
@pytest.mark.parametrize("unreadable", [".", "lmdb", "lmdb/data.mdb", "ucm-db.lock"])
def test_an_unreadable_store_is_a_tier_error_with_a_hint(shared_store_dir: Path, unreadable: str, read_only: bool) -> None:
    store_dir = shared_store_dir
    with unreadable_for_a_while(store_dir / unreadable) as target:
        error = as_other_user(store_dir, target, lambda: ucm_db.open(store_dir, read_only=read_only).close())
    if error["type"] == "skip":
        pytest.skip(error["text"])
    assert error["tier"] == "True", error
    assert "ermission denied" in error["text"] and "access" in error["hint"], error
    assert str(target if unreadable != "." else store_dir / "lmdb") in error["text"], "names what it cannot read"
    assert "aside" not in error["hint"], "a permission problem is not damage: never suggest moving the store away"
    with ucm_db.open(store_dir) as store:  # nothing lost
        assert store.get(NS, KEYS) == PAYLOADS


@pytest.mark.parametrize("call", ["namespaces", "lookup", "import_archive"])
def test_an_unreadable_store_path_in_a_maintenance_call_is_a_tier_error_with_a_hint(shared_store_dir: Path, call: str) -> None:
    """The CLI's commands (pin, lookup, events, export, import ...) checked the path with calls that raised
    PermissionError past every handler: a traceback, and no JSON document under --json."""
    from ucm_db import maintenance

    calls: dict[str, Callable[[], object]] = {
        "namespaces": lambda: maintenance.namespaces(shared_store_dir),
        "lookup": lambda: maintenance.lookup(shared_store_dir, NS.model, [list(range(16))]),
        "import_archive": lambda: maintenance.import_archive(shared_store_dir.parent / "none.tar", shared_store_dir / "sub"),
    }
    with unreadable_for_a_while(shared_store_dir):
        error = as_other_user(shared_store_dir, shared_store_dir, calls[call])
    if error["type"] == "skip":
        pytest.skip(error["text"])
    assert error["tier"] == "True", error
    assert "ermission denied" in error["text"] and "access" in error["hint"], error


NS_SECOND_OPEN = Namespace(model="test/second-open", kv_dtype="bfloat16", block_size=4)


@pytest.mark.parametrize("engine", ["lmdb", "rocksdb"])
def test_a_second_open_in_one_process_is_a_tier_error_saying_to_share_the_store(tmp_path: Path, engine: str) -> None:
    """docs/api.md: open each store once per process; a second open there is a TierError that says so (and leaves
    the first open working)."""
    with ucm_db.open(tmp_path / "s", engine=engine) as store:
        with pytest.raises(ucm_db.TierError) as second:
            ucm_db.open(tmp_path / "s", engine=engine)
        assert "once per process" in second.value.hint or "already open" in str(second.value)
        keys = NS_SECOND_OPEN.block_keys(list(range(8)))
        store.put(NS_SECOND_OPEN, keys, [b"x" * 64, b"y" * 64])
        assert store.lookup(NS_SECOND_OPEN, keys, remote=False) == 2
