"""RocksDB after a full disk (issue 26 item 10), as LMDB: puts resume once
space is freed, ``close()`` always releases the store, errors are ucm_db's.

The disk is full for real: a small tmpfs mounted by the test and filled by a
filler file (the LMDB test's :func:`small_tmpfs` / :func:`fill_leaving`).
Before the fix every put failed after space was freed, ``close()`` raised a
raw ``Exception: Writer has previous error`` and the store stayed locked.
"""

from __future__ import annotations

from pathlib import Path

import ucm_db
from ucm_db.errors import TierError, UcmDbError

from .test_faults import assert_readable, fill_leaving, put_until_error, small_tmpfs  # noqa: F401 - small_tmpfs is a fixture


def _open(path: Path) -> ucm_db.Store:
    return ucm_db.open(path, engine="rocksdb", capacity_bytes=1 << 30, durability="sync")


def test_rocksdb_puts_resume_after_space_is_freed(small_tmpfs: Path) -> None:  # noqa: F811
    store = _open(small_tmpfs / "store")
    try:
        filler = fill_leaving(small_tmpfs, 2 << 20)
        acked, error = put_until_error(store, "full")
        assert isinstance(error, TierError) and "free space" in error.hint, repr(error)
        _, error = put_until_error(store, "still-full", limit=2)
        assert isinstance(error, TierError), repr(error)
        assert_readable(store, acked)  # readable while the disk is still full
        filler.unlink()
        more, error = put_until_error(store, "after", limit=3)
        assert error is None, f"no recovery after freeing space: {error!r}"
        assert_readable(store, acked + more)
    finally:
        store.close()
    with _open(small_tmpfs / "store") as store:
        assert_readable(store, acked + more)


def test_rocksdb_close_on_a_full_disk_releases_the_store(small_tmpfs: Path) -> None:  # noqa: F811
    store = _open(small_tmpfs / "store")
    filler = fill_leaving(small_tmpfs, 2 << 20)
    acked, error = put_until_error(store, "full")
    assert isinstance(error, TierError), repr(error)
    try:
        store.close()  # the disk is still full
    except UcmDbError:
        pass  # a failed final sync is reported as a ucm_db error, after the release
    filler.unlink()
    with _open(small_tmpfs / "store") as again:  # not LockedError: the LOCK file was released
        assert_readable(again, acked)
        more, error = put_until_error(again, "reopened", limit=2)
        assert error is None and len(more) == 2, repr(error)


def test_a_reopen_after_a_full_disk_needs_little_room(tmp_path: Path) -> None:
    """Issue 46 finding 12: after freeing 20 MiB the reopen still failed with
    ENOSPC: it replayed a 29 MiB write-ahead log into blob files. The WAL is
    bounded (memtables flush every few MiB), so the replay needs little room."""
    import os
    import subprocess
    import sys

    from .harness import mounted_tmpfs

    with mounted_tmpfs(tmp_path / "tmpfs", 96) as mount:
        path = mount / "store"
        store = ucm_db.open(path, engine="rocksdb", capacity_bytes=1 << 30, durability="group")
        ns = ucm_db.Namespace(model="wal", kv_dtype="bfloat16", block_size=4)
        for i in range(30):  # 30 MiB in 1 MiB blocks, acknowledged
            store.put(ns, ns.block_keys(list(range(i * 100, i * 100 + 4))), [os.urandom(1 << 20)], parent=None)
        store.flush()
        filler = fill_leaving(mount, 1 << 20)
        put_until_error(store, "full", limit=3)  # the disk is full: the close cannot flush the memtable
        try:
            store.close()
        except UcmDbError:
            pass
        filler.unlink()
        fill_leaving(mount, 20 << 20)  # 20 MiB free: less than the 30 MiB written
        script = (
            "import sys, ucm_db\n"
            "with ucm_db.open(sys.argv[1]) as s:\n"
            "    print(s.stats().blocks)\n"
        )
        done = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        assert int(done.stdout.strip()) >= 30
