"""A read-only open of a RocksDB store writes nothing in the store's
directory (rocksdict rewrote its ``rocksdict-config.json`` on every open,
read-only ones included, so a store on a read-only volume could not be
opened at all): the engine opens a private shadow directory of links to the
store's files instead (ucm_db.engines.rocksdb), removed when it closes."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Sequence
from pathlib import Path

import pytest
from readonly_mount import read_only_view, tree

import ucm_db
from ucm_db import maintenance

NS = ucm_db.Namespace(model="ro/rocks", kv_dtype="bfloat16", block_size=16)
TOKENS = list(range(6 * 16))


def _populate(path: Path) -> tuple[Sequence[bytes], list[bytes]]:
    keys = NS.block_keys(TOKENS)
    payloads = [bytes([i]) * 8192 for i in range(len(keys))]  # large enough for blob files
    with ucm_db.open(path, engine="rocksdb", capacity_bytes=1 << 24) as store:
        store.put(NS, keys, payloads)
    return keys, payloads


def _exactly(path: Path) -> dict[str, tuple[int, int, int, int, str]]:
    """Every entry under ``path``: inode, mode, size, mtime and a digest of
    its bytes: what a read-only open must leave as it was (no file replaced,
    rewritten, touched, added or removed)."""
    out = {}
    for entry in sorted(path.rglob("*")):
        st = entry.lstat()
        digest = hashlib.sha256(entry.read_bytes()).hexdigest() if entry.is_file() else ""
        out[str(entry.relative_to(path))] = (st.st_ino, st.st_mode, st.st_size, st.st_mtime_ns, digest)
    return out


@pytest.fixture
def private_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This process's temp directory (where shadow directories go), empty."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    return tmp


def test_a_read_only_open_leaves_every_file_of_the_store_as_it_was(tmp_path: Path, private_tmp: Path) -> None:
    keys, payloads = _populate(tmp_path / "store")
    assert (tmp_path / "store" / "rocksdb" / "rocksdict-config.json").exists()
    before = _exactly(tmp_path / "store")
    with ucm_db.open(tmp_path / "store", read_only=True) as store:
        assert store.config.engine == "rocksdb" and store.config.read_only
        assert store.lookup(NS, keys) == len(keys)
        assert [bytes(b) for b in store.get(NS, keys)] == payloads  # type: ignore[arg-type]
        shadows = list(private_tmp.iterdir())
    assert _exactly(tmp_path / "store") == before
    assert len(shadows) == 1, "one shadow directory while open"
    assert list(private_tmp.iterdir()) == [], "the shadow directory goes with the close"


def test_inspect_and_verify_leave_a_rocksdb_store_as_it_was(tmp_path: Path, private_tmp: Path) -> None:
    keys, _ = _populate(tmp_path / "store")
    before = _exactly(tmp_path / "store")
    assert maintenance.inspect(tmp_path / "store")["blocks"] == len(keys)
    assert not maintenance.verify(tmp_path / "store").problems
    assert _exactly(tmp_path / "store") == before
    assert list(private_tmp.iterdir()) == []


def test_a_rocksdb_store_on_a_read_only_volume_is_served_and_left_untouched(tmp_path: Path, private_tmp: Path) -> None:
    keys, payloads = _populate(tmp_path / "src" / "store")
    before = tree(tmp_path / "src")
    with read_only_view(tmp_path / "src", tmp_path / "ro") as ro:
        with ucm_db.open(ro / "store", read_only=True) as store:
            assert store.lookup(NS, keys) == len(keys)
            assert [bytes(b) for b in store.get(NS, keys)] == payloads  # type: ignore[arg-type]
            with pytest.raises(ucm_db.TierError, match="open read-only"):
                store.put(NS, keys, payloads)
        assert maintenance.inspect(ro / "store")["blocks"] == len(keys)
    assert tree(tmp_path / "src") == before
    assert list(private_tmp.iterdir()) == []


def test_commits_only_in_the_log_are_read_and_the_log_is_left_alone(tmp_path: Path) -> None:
    """A writer killed before any flush leaves its puts in RocksDB's write-ahead
    log only: a read-only open replays it in memory, and writes nothing."""
    path = tmp_path / "store"
    script = textwrap.dedent("""
        import os, sys, ucm_db
        ns = ucm_db.Namespace(model="ro/rocks", kv_dtype="bfloat16", block_size=16)
        keys = ns.block_keys(list(range(6 * 16)))
        store = ucm_db.open(sys.argv[1], engine="rocksdb", capacity_bytes=1 << 24, durability="sync")
        store.put(ns, keys, [bytes([i]) * 8192 for i in range(len(keys))])
        os._exit(0)  # no close, no flush: the blocks are in the log only
    """)
    done = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert not list((path / "rocksdb").glob("*.blob")), "nothing flushed yet"
    before = _exactly(path)
    with ucm_db.open(path, read_only=True) as store:
        assert store.lookup(NS, NS.block_keys(TOKENS)) == 6
    assert _exactly(path) == before


def test_a_store_left_open_removes_its_shadow_directory_at_exit(tmp_path: Path) -> None:
    _populate(tmp_path / "store")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    script = "import sys, ucm_db\nstore = ucm_db.open(sys.argv[1], read_only=True)\nprint(store.stats().blocks)\n"
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "store")], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "TMPDIR": str(tmp)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "6"
    assert list(tmp.iterdir()) == []



def test_a_forked_child_exiting_leaves_its_parents_shadow_directory(tmp_path: Path) -> None:
    _populate(tmp_path / "store")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    script = textwrap.dedent("""
        import os, sys, ucm_db
        ns = ucm_db.Namespace(model="ro/rocks", kv_dtype="bfloat16", block_size=16)
        keys = ns.block_keys(list(range(6 * 16)))
        store = ucm_db.open(sys.argv[1], read_only=True)
        if os.fork() == 0:
            sys.exit(0)  # a normal exit: the child's exit handlers run
        assert os.wait()[1] == 0
        assert len(os.listdir(sys.argv[2])) == 1, "the parent's shadow directory is still there"
        print(store.lookup(ns, keys))
        store.close()
    """)
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "store"), str(tmp)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "TMPDIR": str(tmp)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "6"
    assert list(tmp.iterdir()) == []
