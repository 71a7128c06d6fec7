"""Audit of the store lock (``ucm_db.storelock``) with real processes and
SIGKILL: the lock is the kernel's ``flock``, so nothing stale outlives its
holders, and the processes named as holders are the ones holding it.

Found: ``/proc/locks`` names the process that *took* a lock. A store opened
by a process that then forked (vLLM's workers, a pool) and was killed stays
held by the child -- correctly -- but ``holders()`` named the dead parent
(``pid N (?)``, and once N is reused, an unrelated program), so ``compact``
and the LockedError of a waiting open pointed at the wrong process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import ucm_db
from ucm_db.storelock import StoreLock, holders

HOLD = """
import os, sys, time, ucm_db
store = ucm_db.open(sys.argv[1])
child = os.fork() if sys.argv[2] == "fork" else 0
if child == 0 and sys.argv[2] == "fork":
    time.sleep(120); os._exit(0)
print(os.getpid(), child, flush=True)
time.sleep(120)
"""


def _hold(path: Path, mode: str) -> tuple[subprocess.Popen[str], int, int]:
    process = subprocess.Popen([sys.executable, "-c", HOLD, str(path), mode], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    parent, child = map(int, process.stdout.readline().split())
    return process, parent, child


def _exclusive_possible(path: Path) -> bool:
    with StoreLock(path) as lock:
        return lock.try_exclusive()


def test_a_killed_holder_leaves_no_stale_lock(tmp_path: Path) -> None:
    store = tmp_path / "s"
    process, parent, _ = _hold(store, "plain")
    try:
        assert holders(store) == [parent]
        assert not _exclusive_possible(store)
    finally:
        process.kill()
        process.wait()
    assert holders(store) == []
    assert _exclusive_possible(store)  # compact/migrate may run at once: the kernel dropped the lock
    with ucm_db.open(store) as again:
        assert again.config.engine == "lmdb"


def test_the_holder_named_is_the_forked_child_that_holds_the_lock_after_its_parent_died(tmp_path: Path) -> None:
    store = tmp_path / "s"
    process, parent, child = _hold(store, "fork")
    try:
        assert holders(store) == [parent]
        os.kill(parent, signal.SIGKILL)
        process.wait()
        assert not _exclusive_possible(store), "the child still holds the store"
        assert holders(store) == [child]  # was [parent]: a dead pid, or another program's once reused
    finally:
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 10
    while not _exclusive_possible(store):
        assert time.monotonic() < deadline, "the lock outlived its last holder"
        time.sleep(0.05)


def test_the_lock_holds_on_a_fuse_file_system(tmp_path: Path) -> None:
    """A store on FUSE (the power-cut file system, tests/reliability/powercut):
    the kernel keeps ``flock`` locally for a FUSE file system that does not
    implement it, so on one host the lock works as on a local disk: a
    holder keeps compact out, is named, and its death frees the store.
    (NFS could not be mounted here; nothing in ucm-db detects it.)"""
    from tests.reliability.powercut import PowerCutMount

    with PowerCutMount(tmp_path / "mnt", tmp_path) as mount:
        store = mount.mountpoint / "s"
        process, parent, _ = _hold(store, "plain")
        try:
            assert not _exclusive_possible(store)
            assert holders(store) == [parent]
        finally:
            process.kill()
            process.wait()
        assert _exclusive_possible(store)
