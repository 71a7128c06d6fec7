"""Review 3 of f22d71a: the creation lock is an ``flock`` on the store
directory itself, which other tools lock too.

``flock DIR command`` (util-linux) is the common way to run one job at a
time on a directory: it locks DIR and runs the command with that
descriptor. A service started so on its (new, empty) store directory, e.g.
``flock /var/cache/ucm-db/modelC vllm serve ...``, now waits
``SHARED_WAIT_S`` (600 s) for its own wrapper's lock and fails with
"another process has been creating the store"; before f22d71a it opened at
once (measured: 0.29 s before, killed at 15 s after). Real processes, a
real ``flock`` on the directory, as the wrapper takes it: no mock.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)


def test_new_store_opens_under_a_flock_wrapper(tmp_path: Path) -> None:
    store = tmp_path / "modelC"
    store.mkdir()
    fd = os.open(store, os.O_RDONLY | os.O_DIRECTORY)  # what `flock DIR cmd` holds while cmd runs
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            child = subprocess.run([sys.executable, "-c", f"import ucm_db; ucm_db.open({str(store)!r}).close(); print('opened')"],
                                   pass_fds=[fd], capture_output=True, text=True, timeout=15, check=False)
        except subprocess.TimeoutExpired:
            pytest.fail("opening a new store under a flock(1) wrapper of its directory still waits after 15 s")
        assert child.returncode == 0 and "opened" in child.stdout, child.stderr[-400:]
    finally:
        os.close(fd)


HOLDER = """
import sys, time
from ucm_db.storelock import hold_creation
lock = hold_creation(sys.argv[1])
print("holding", flush=True)
time.sleep(120)
"""


def test_a_creation_lock_timeout_names_the_process_creating_the_store(tmp_path: Path) -> None:
    """A real process holds the creation lock; the waiter's LockedError
    names it by pid (before: "another process", no pid)."""
    from ucm_db.errors import LockedError
    from ucm_db.storelock import hold_creation

    store = tmp_path / "s"
    store.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(store)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
        with pytest.raises(LockedError) as raised:
            hold_creation(store, timeout_s=0.2)
        assert f"pid {holder.pid} (" in str(raised.value), str(raised.value)
    finally:
        holder.kill()
        holder.wait()


def test_the_creation_lock_leaves_no_file_behind(tmp_path: Path) -> None:
    """Its file lives only while held: a directory that does not become a
    store (here: nothing created under the lock) is left as it was, and a
    new store holds no ``.ucm-db.creating``."""
    import ucm_db
    from ucm_db.storelock import CREATION_FILE, hold_creation

    empty = tmp_path / "empty"
    empty.mkdir()
    lock = hold_creation(empty)
    assert (empty / CREATION_FILE).exists()
    lock.release()
    lock.release()  # idempotent
    assert list(empty.iterdir()) == []
    ucm_db.open(tmp_path / "new").close()
    assert not (tmp_path / "new" / CREATION_FILE).exists()
    assert (tmp_path / "new" / "lmdb").is_dir()


def test_a_waiter_that_locks_the_removed_file_locks_the_new_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each release removes the file under the lock. A waiter that opened
    the file just before that removal, and locks it just after, holds a
    lock on a file nobody else will open: it must go on to lock the file
    at the path, or a third creator would run beside it. That interleaving
    is microseconds wide, so the test makes it: ``flock`` is wrapped to
    release the first holder just before the waiter's first lock attempt
    (a patch for an ordering the OS cannot be made to produce on demand;
    the files and locks are real)."""
    from ucm_db import storelock
    from ucm_db.errors import LockedError

    first = storelock.hold_creation(tmp_path)
    real_flock = fcntl.flock
    calls: list[int] = []

    def flock_after_the_release(fd: int, operation: int) -> None:
        calls.append(fd)
        if len(calls) == 1:
            first.release()  # removes the file this waiter has open, then unlocks it
        real_flock(fd, operation)

    monkeypatch.setattr(storelock.fcntl, "flock", flock_after_the_release)
    waiter = storelock.hold_creation(tmp_path, timeout_s=5)
    monkeypatch.setattr(storelock.fcntl, "flock", real_flock)
    try:
        assert len(calls) >= 2, "the waiter kept its lock on the removed file"
        with pytest.raises(LockedError):
            storelock.hold_creation(tmp_path, timeout_s=0.2)  # a third creator waits for the waiter
    finally:
        waiter.release()
    assert list(tmp_path.iterdir()) == []
