"""A process stopped or killed while it records its synced snapshot holds up no other.

Every group process used to record into one shared file, ``synced-snapshot``,
under an ``flock`` held across a ``pwrite`` and an ``fdatasync``. A process
stopped (SIGSTOP, Ctrl-Z) while it held it made every other process's syncs
fail after 2 s: flushes, epoch bumps and closes raised, and once two sync
budgets were committed puts were refused (the audit caught a put+flush loop
holding it at 76 of 200 random stops). A sync writer's commit (``verify
--fix``, ``compact``'s evictions, a migration) whose record was kept out
only logged a warning, and an OS crash's rollback would undo it. Now each
process records into its own file (``ucm_db.engines.lmdb.records``), no
lock is shared, and a sync writer's commit whose record fails raises.

Real processes and real SIGSTOPs. A process is never stopped inside a
commit here: LMDB's writer lock (and the walk ledger's ``flock`` around it,
``ucm_db.engines.lmdb.custody``) is held there, which stops every writer
whatever the records do; the test stops it again elsewhere.
"""

from __future__ import annotations

import errno
import fcntl
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

import ucm_db
from ucm_db.engines.lmdb import records
from ucm_db.engines.lmdb.groupsync import RECORD_FILE, read_record
from ucm_db.engines.lmdb.meta import read_meta_pages
from ucm_db.engines.lmdb.recovery import BOOT_ID_ENV
from ucm_db.store.view import open_view

from .harness import NS, chain_tokens, fork_call, kill_and_reap, payload_for, tail, wait_counter, wait_pid

pytestmark = [pytest.mark.multiprocess]

BUDGET_BYTES = 1 << 20
BLOCK_BYTES = 128 << 10
OPTIONS = {"codec": "none", "durability": "group", "sync_bytes": BUDGET_BYTES, "sync_interval_s": 0.05,
           "capacity_bytes": 64 << 20}
STOPS = 12

#: A put+flush loop (a producer's step, a pin- or bump-heavy tool). argv: path, ready file.
FLUSHER = """
import os, sys
import ucm_db
from ucm_db.keys import Namespace
ns = Namespace(model="reliability-suite", kv_dtype="bfloat16", block_size=4)
with ucm_db.open(sys.argv[1], sync_interval_s=0.05) as store:
    open(sys.argv[2] + ".new", "w").write("1"); os.replace(sys.argv[2] + ".new", sys.argv[2])
    i = 0
    while True:
        store.put(ns, ns.block_keys(list(range(10**8 + i, 10**8 + i + 4))), [b"f" * 4096])
        store.flush()
        i += 4
"""

#: The audit's hold_record.py: takes the shared record file's lock, as a process of the old design
#: stopped while it recorded, and stops. argv: path of the lock file, ready file.
HOLDER = """
import fcntl, os, signal, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
open(sys.argv[2] + ".new", "w").write("1"); os.replace(sys.argv[2] + ".new", sys.argv[2])
os.kill(os.getpid(), signal.SIGSTOP)
"""


#: A sync writer (``verify --fix``, ``compact``'s evictions, a migration: a writable maintenance view)
#: committing once. argv: the store's path.
SYNC_WRITER = """
import sys
from ucm_db.store.view import open_view
with open_view(sys.argv[1], writable=True) as view:
    view.engine.write(lambda txn: txn.put("info", b"test-sync-writer", b"1"))
"""


@contextmanager
def _process(tmp_path: Path, script: str, arg: Path) -> Iterator[int]:
    ready = tmp_path / "ready"
    ready.unlink(missing_ok=True)
    with open(tmp_path / "other.log", "wb") as log:
        other = subprocess.Popen([sys.executable, "-c", script, str(arg), str(ready)], stdout=log, stderr=log)
    try:
        assert wait_counter(ready, 1, timeout_s=60) == 1, tail(tmp_path / "other.log")
        yield other.pid
    finally:
        os.kill(other.pid, signal.SIGCONT)
        kill_and_reap(other.pid)
        other.wait()


def _stop_outside_a_commit(pid: int, env_dir: Path) -> None:
    """SIGSTOPs ``pid`` at a random instant that is not inside a commit (module doc)."""
    fd = os.open(env_dir / "walked-clean", os.O_RDONLY)
    try:
        while True:
            time.sleep(random.uniform(0.0, 0.05))
            os.kill(pid, signal.SIGSTOP)
            time.sleep(0.01)  # the stop lands
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.kill(pid, signal.SIGCONT)
                continue
            fcntl.flock(fd, fcntl.LOCK_UN)
            return
    finally:
        os.close(fd)


def _newest_txnid(env_dir: Path) -> int:
    return max(m.txnid for m in read_meta_pages(env_dir / "data.mdb")[0])


def _put_budgets(store: ucm_db.Store, label: str, budgets: int) -> None:
    """Puts ``budgets`` sync budgets one block at a time (each put acknowledged or raising)."""
    keys = NS.block_keys(chain_tokens(label, budgets * BUDGET_BYTES // BLOCK_BYTES))
    for i, key in enumerate(keys):
        store.put(NS, [key], [payload_for(key, BLOCK_BYTES)], parent=keys[i - 1] if i else None)


def test_a_process_stopped_anywhere_in_its_put_flush_loop_holds_up_no_writer(tmp_path: Path) -> None:
    """The flusher stopped at random instants, STOPS times: beside it, three
    sync budgets of puts are acknowledged and a flush records them, every
    time. Before: a stop that caught it recording (about 2 in 5) made the
    flush raise "another process has held its sync record's lock"."""
    store_path = tmp_path / "store"
    env_dir = store_path / "lmdb"
    with ucm_db.open(store_path, **OPTIONS) as store:
        with _process(tmp_path, FLUSHER, store_path) as flusher:
            for stop in range(STOPS):
                _stop_outside_a_commit(flusher, env_dir)
                _put_budgets(store, f"stop-{stop}", 3)
                store.flush()
                record = read_record(env_dir)
                assert record is not None and record.txnid == _newest_txnid(env_dir), "the flush is recorded"
                os.kill(flusher, signal.SIGCONT)


def test_a_process_stopped_holding_the_old_record_lock_holds_up_nothing(tmp_path: Path) -> None:
    """The audit's reproduction: a process holding the shared record file's
    lock, stopped. Puts beyond two budgets, a flush, an epoch bump, a sync
    writer's commit and a close all go through and are recorded. Before:
    puts were refused ("its syncs fail"), and the others raised, or (the
    sync writer) reported success its record did not cover."""
    store_path = tmp_path / "store"
    env_dir = store_path / "lmdb"
    store = ucm_db.open(store_path, **OPTIONS)
    try:
        _put_budgets(store, "before", 1)
        store.flush()
        with _process(tmp_path, HOLDER, env_dir / RECORD_FILE):
            _put_budgets(store, "held", 4)
            store.flush()
            assert read_record(env_dir).txnid == _newest_txnid(env_dir)  # type: ignore[union-attr]
            store.bump_epoch(NS)
            assert read_record(env_dir).txnid == _newest_txnid(env_dir)  # type: ignore[union-attr]
            subprocess.run([sys.executable, "-c", SYNC_WRITER, str(store_path)], check=True, timeout=120)
            assert read_record(env_dir).txnid == _newest_txnid(env_dir), "the sync writer's commit is recorded"  # type: ignore[union-attr]
            _put_budgets(store, "closing", 1)
            store.close()
            assert read_record(env_dir).txnid == _newest_txnid(env_dir)  # type: ignore[union-attr]
    finally:
        store.close()


def test_a_sync_writers_commit_whose_record_fails_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A record that cannot be written: a fault no real disk here produces
    for the record alone (a full disk stops the commit first; records are
    written in place), so ``records.write_own`` is made to fail with
    ENOSPC. The sync writer's commit stands, but the caller is told: a
    rollback after an OS crash would undo it (before: a logged warning)."""
    store_path = tmp_path / "store"
    with ucm_db.open(store_path, **OPTIONS) as store:
        _put_budgets(store, "before", 1)
    recorded = read_record(store_path / "lmdb")

    def full_disk(env_dir: Path, record: records.SyncRecord) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    with open_view(store_path, writable=True) as view:
        monkeypatch.setattr(records, "write_own", full_disk)
        with pytest.raises(ucm_db.TierError, match="synced snapshot was not recorded") as raised:
            view.engine.write(lambda txn: txn.put("info", b"test-sync-writer", b"1"))
        assert raised.value.hint and "synced-snapshot" in raised.value.hint
        monkeypatch.undo()
        assert read_record(store_path / "lmdb") == recorded
        view.engine.write(lambda txn: txn.put("info", b"test-sync-writer", b"2"))  # recorded again once it can
        assert read_record(store_path / "lmdb").txnid == _newest_txnid(store_path / "lmdb")  # type: ignore[union-attr]


# -- crash cases ------------------------------------------------------------------
GROUP = {"codec": "none", "durability": "group", "sync_interval_s": 0.05, "sync_bytes": 1 << 20}


def _flush_loop(store_path: Path, name: str, log: Path) -> None:
    """Child: puts a 2-block chain and flushes, again and again, logging each label once its flush returned."""
    os.environ[BOOT_ID_ENV] = "boot-a"
    with ucm_db.open(store_path, **GROUP) as store:
        for i in range(10_000):
            label = f"{name}-{i}"
            keys = NS.block_keys(chain_tokens(label, 2))
            store.put(NS, keys, [payload_for(k, 32 << 10) for k in keys])
            store.flush()
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            os.write(fd, f"{label}\n".encode())
            os.close(fd)


def test_two_processes_recording_at_once_roll_back_to_the_newest_record_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two put+flush loops, each recording into its own file, SIGKILLed at a
    random instant; the reopen after a reboot rolls back to the newest
    record of the two, every flushed chain there and whole, nothing damaged."""
    store_path = tmp_path / "store"
    flushed: list[str] = []
    for cycle in range(3):
        logs = [tmp_path / f"log-{cycle}-{n}" for n in "ab"]
        pids = [fork_call(_flush_loop, store_path, f"{n}{cycle}", log, log_path=tmp_path / f"child-{n}.log")
                for n, log in zip("ab", logs)]
        try:
            deadline = time.monotonic() + 60
            while not all(log.exists() for log in logs) and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(random.uniform(0.05, 0.3))
        finally:
            for pid in pids:
                kill_and_reap(pid)
        assert all(log.exists() for log in logs), tail(tmp_path / "child-a.log") + tail(tmp_path / "child-b.log")
        flushed += [line for log in logs for line in log.read_text().split()]
        newest = read_record(store_path / "lmdb")
        assert newest is not None
        monkeypatch.setenv(BOOT_ID_ENV, f"boot-{cycle}")  # the machine rebooted
        with ucm_db.open(store_path, **GROUP) as store:
            rollback = store._tier.engine.rollback  # type: ignore[attr-defined]
            assert rollback is None or rollback.to_txnid == newest.txnid
            for label in flushed:
                keys = NS.block_keys(chain_tokens(label, 2))
                assert store.get(NS, keys) == [payload_for(k, 32 << 10) for k in keys], label
            assert store._tier.check() == [] and store.stats().quarantined == 0


def _put_flush_exit(store_path: Path, label: str) -> None:
    with ucm_db.open(store_path, **GROUP) as store:
        keys = NS.block_keys(chain_tokens(label, 2))
        store.put(NS, keys, [payload_for(k, 32 << 10) for k in keys])
        store.flush()


def test_the_record_files_of_gone_processes_are_removed(tmp_path: Path) -> None:
    """Each process that records keeps a file; once a newer record is
    durable in its own, a process removes the files of the gone ones."""
    store_path = tmp_path / "store"
    for n in range(4):
        pid = fork_call(_put_flush_exit, store_path, f"gone-{n}", log_path=tmp_path / "child.log")
        assert wait_pid(pid, 120) == 0, tail(tmp_path / "child.log")
    env_dir = store_path / "lmdb"
    left = [n for n in os.listdir(env_dir) if n.startswith(RECORD_FILE)]
    assert len(left) == 1, f"each process's record removed the gone one's before it: {left}"
    with ucm_db.open(store_path, **GROUP) as store:
        keys = NS.block_keys(chain_tokens("here", 2))
        store.put(NS, keys, [payload_for(k, 32 << 10) for k in keys])
        store.flush()
        left = sorted(n for n in os.listdir(env_dir) if n.startswith(RECORD_FILE))
        assert left == [records.own_file(env_dir).name], left
