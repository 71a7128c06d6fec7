"""Review of the RocksDB engine's open swapping (engines/rocksdb.py ``_swap``,
``_recover``, ``_recover_if_failed``, ``read``/``write``/``close``;
engines/rocksdb_swap.py ``Recovery``): two defects a review found, each
failing here before its fix (2026-12-06).

1. A call racing ``close()`` reopens the closed store. ``write``, ``read``
   and ``sync`` check ``_closed`` once, at their start; a close that lands
   after that check unbinds the database, and the call then finds no open
   bound and runs a failed-write recovery (``write``: ``self._db is None``;
   ``read``/``sync``: ``_recover_if_failed``), which opens the store again on
   the closed engine: a writable open holding RocksDB's ``LOCK`` (and, for
   ``write``, a commit acknowledged after the close), a read-only one holding
   a shadow directory in the temp directory. Nothing releases them: every
   later ``close()`` returns at once. Measured without any forced
   interleaving (4 threads putting in a loop, the main thread closing after
   10 ms): 105 of 200 closes left a database open behind them. The tests
   force the interleaving by wrapping one method on the instance (the real
   check or recovery check runs; a complete ``close()`` runs on another
   thread right after it, as a preemption there does). Fixed: the recovery
   checks the engine is open under the write lock, which close holds too.

2. The recovery's writable reopen waits for the failed open's ``released``
   event, set once its last read has called ``db.close()``; but a RocksDB
   database stays open, ``LOCK`` held, while any iterator or snapshot of it
   is alive. A read on the failed open whose function held a scan in a
   variable and raised keeps that iterator alive through its traceback (a
   ``concurrent.futures.Future`` keeps the exception), so the writable reopen
   fails with ``LockedError`` ("already open in another process") on a disk
   with room again, and every write is refused with it until the exception
   is dropped and ``REOPEN_RETRY_S`` has passed. Fixed: a read transaction
   closes its scans when it ends, and drops its snapshots before it leaves
   its open's lease.

Real parts: real RocksDB stores, a real full disk (a tmpfs mounted by the
test, root only, skipped otherwise), real threads with bounded joins.
"""

from __future__ import annotations

import concurrent.futures
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ucm_db.engines.rocksdb import RocksDbEngine
from ucm_db.errors import ClosedError, LockedError, TierError
from tests.reliability.test_faults import fill_leaving
from tests.test_rocksdb_recovery_lease import _failed_engine, _in_thread, mount  # noqa: F401 - mount: the fixture

KEY = b"acknowledged"
VALUE = bytes(range(256)) * 1024  # 256 KiB: a blob file's value, as a KV block is
STEP_S = 10.0  # bounded waits for steps that take milliseconds


def _close_on_another_thread(engine: RocksDbEngine) -> None:
    """``engine.close()`` run to its end on another thread (as a close by another thread that lands here)."""
    closer = threading.Thread(target=engine.close, daemon=True)
    closer.start()
    closer.join(STEP_S)
    assert not closer.is_alive(), "close() did not end"


def _drop_leaked_open(engine: RocksDbEngine) -> None:
    """Releases an open a regression would leave bound after the close (so one test's LOCK does not outlive it)."""
    if engine._db is not None:
        engine._release()


def _close_after_first_check(engine: RocksDbEngine) -> list[bool]:
    """Wraps the instance's ``_recover_if_failed``: the first call closes the
    engine on another thread, then runs the real check (a read passed its
    ``_check``; the close lands before its next step). Returns the marker
    list (one entry once the close ran)."""
    real_recover_if_failed, raced = engine._recover_if_failed, []

    def closed_then_check(**kwargs):  # type: ignore[no-untyped-def]
        if not raced:
            raced.append(True)
            _close_on_another_thread(engine)
        return real_recover_if_failed(**kwargs)
    engine._recover_if_failed = closed_then_check  # type: ignore[method-assign]
    return raced


def test_a_write_racing_close_does_not_reopen_the_closed_store(tmp_path: Path) -> None:
    path = tmp_path / "rocksdb"
    engine = RocksDbEngine(path, sync=False)
    engine.write(lambda txn: txn.put("blocks", KEY, VALUE))
    real_check, raced = engine._check, []

    def check_then_closed() -> None:
        real_check()
        if not raced:  # the write passed its check; the close lands before it takes the write lock
            raced.append(True)
            _close_on_another_thread(engine)
    engine._check = check_then_closed  # type: ignore[method-assign]
    outcome: list[object] = []
    try:
        try:
            outcome.append(engine.write(lambda txn: txn.put("blocks", b"after-close", VALUE)))
        except ClosedError as exc:
            outcome.append(exc)
        leaked = engine._db is not None
    finally:
        _drop_leaked_open(engine)
    assert raced
    assert not leaked, "the closed engine holds a database it opened after its close"
    assert isinstance(outcome[0], ClosedError), f"a write after close() returned {outcome[0]!r}"


def test_a_read_racing_close_leaves_the_store_free_to_open_again(tmp_path: Path) -> None:
    path = tmp_path / "rocksdb"
    engine = RocksDbEngine(path, sync=False)
    engine.write(lambda txn: txn.put("blocks", KEY, VALUE))
    _close_after_first_check(engine)
    with pytest.raises(ClosedError):
        engine.read(lambda txn: txn.get("blocks", KEY))
    try:
        again = RocksDbEngine(path, sync=False)  # the engine is closed: its LOCK is free
    except LockedError:
        _drop_leaked_open(engine)
        raise
    again.close()


def test_a_read_racing_close_of_a_read_only_store_leaves_no_shadow(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "rocksdb"
    writer = RocksDbEngine(path, sync=False)
    writer.write(lambda txn: txn.put("blocks", KEY, VALUE))
    writer.close()
    shadows = tmp_path / "temp"
    shadows.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(shadows))  # this test's shadows only
    engine = RocksDbEngine(path, sync=False, read_only=True)
    _close_after_first_check(engine)
    with pytest.raises(ClosedError):
        engine.read(lambda txn: txn.get("blocks", KEY))
    left = sorted(p.name for p in shadows.glob("ucm-db-rocksdb-ro-*"))
    _drop_leaked_open(engine)
    assert left == [], f"shadow directories left after close(): {left}"


def test_the_reopen_after_a_failed_write_is_not_locked_out_by_a_failed_reads_kept_scan(mount: Path) -> None:
    engine, filler = _failed_engine(mount)
    began, end = threading.Event(), threading.Event()

    def walk_then_fail(txn):  # type: ignore[no-untyped-def]
        walk = txn.scan("blocks")  # a scan kept in a variable (as index/audit.py's _LinkWalk keeps one)
        next(walk)
        began.set()
        end.wait(STEP_S)
        raise ValueError("a damaged record met mid-walk")

    wrote: list[object] = []
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        read = pool.submit(engine.read, walk_then_fail)  # on the failed database: a failed one still reads
        assert began.wait(STEP_S), "the read did not begin"
        writer = _in_thread(lambda: engine.write(lambda txn: txn.put("blocks", b"after", VALUE)), wrote)
        try:
            filler.unlink()  # room again: the writable reopen, once the read has ended, has what it needs
            end.set()
            assert isinstance(read.exception(STEP_S), ValueError)  # the future keeps it, as futures do
            writer.join(STEP_S)
            assert not writer.is_alive(), "the write did not end"
        finally:
            end.set()
            filler.unlink(missing_ok=True)
    try:
        assert wrote == [None], f"the write after the failed one was refused: {wrote!r}"
    finally:
        del read
        engine.close()
