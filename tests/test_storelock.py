"""The store directory lock: shared by every open store, exclusive for
maintenance, never released for a parent by a forked child."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import ucm_db
from ucm_db.errors import LockedError
from ucm_db.storelock import StoreLock, hold_shared, holders


def test_open_store_blocks_exclusive_and_is_named(tmp_path: Path) -> None:
    with ucm_db.open(tmp_path / "s", capacity_bytes=1 << 20):
        with StoreLock(tmp_path / "s") as lock:
            assert not lock.try_exclusive()
        assert os.getpid() in holders(tmp_path / "s")
    with StoreLock(tmp_path / "s") as lock:
        assert lock.try_exclusive()  # released by close()
        with pytest.raises(LockedError, match="held exclusively"):
            hold_shared(tmp_path / "s", timeout_s=0.1)  # a store opening meanwhile waits, then says why


def test_forked_child_closing_does_not_release_the_parent(tmp_path: Path) -> None:
    tmp_path.mkdir(exist_ok=True)
    lock = hold_shared(tmp_path)
    try:
        pid = os.fork()
        if pid == 0:
            lock.release()  # closes the child's copy only
            os._exit(0)
        os.waitpid(pid, 0)
        with StoreLock(tmp_path) as other:
            assert not other.try_exclusive()
    finally:
        lock.release()


def test_a_store_is_created_in_a_directory_its_user_may_write_but_not_read() -> None:
    """A drop directory (mode 0733: write and enter, no listing) cannot be
    opened to fsync the new store's name into it; the first open raised a
    TierError ("permission denied") after creating the store directory."""
    import shutil
    import tempfile

    from tests.other_user import error_outcome, run_as_nobody

    parent = Path(tempfile.mkdtemp(prefix="ucm-db-drop-"))  # pytest's tmp_path: only its owner enters
    try:
        parent.chmod(0o711)
        drop = parent / "drop"
        drop.mkdir(mode=0o733)
        drop.chmod(0o733)
        outcome = run_as_nobody(lambda: error_outcome(lambda: ucm_db.open(drop / "store", capacity_bytes=1 << 30).close()))
        assert outcome["type"] == "none", outcome
    finally:
        shutil.rmtree(parent)
