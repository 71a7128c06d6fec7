"""A RocksDB recovery after a failed write (a full disk) swaps the failed
database the way the read-only follower swaps an open
(ucm_db.engines.rocksdb_swap, rocksdb_follow's ``Lease``): a read that
starts during the recovery goes to the read-only stand-in at once, never
waiting for a long read in flight on the failed database, and the writable
reopen runs only once that long read has ended (the failed database holds
RocksDB's ``LOCK`` until its last read closes it).

The disk is full for real: a small tmpfs mounted by the test (root only;
skipped otherwise), filled by a filler file, so RocksDB fails a write and
then refuses every write. The long read is a real read whose function
blocks on an event the test controls. The test wraps the engine's writable
opener on the instance only to record when it runs (the open itself is the
real one), and watches the bound database only to know when the recovery
has reached its swap. Where no stand-in opens, the shadow's temp directory
is gone for real (``tempfile.tempdir`` pointed at a missing directory).

Before the change the recovery swapped under the reads' gate, taken
exclusively: the read started during the recovery was still blocked after
5 s, behind the long read.
"""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ucm_db.engines.rocksdb import RocksDbEngine
from ucm_db.errors import TierError
from tests.reliability.harness import mounted_tmpfs
from tests.reliability.test_faults import fill_leaving

KEY = b"acknowledged"
VALUE = bytes(range(256)) * 1024  # 256 KiB: a blob file's value, as a KV block is
#: Bounded waits for a step that takes milliseconds when it happens at all.
STEP_S = 5.0


@pytest.fixture
def mount(tmp_path: Path) -> Iterator[Path]:
    with mounted_tmpfs(tmp_path / "tmpfs", 40) as mount_point:
        yield mount_point


def _wait_for(check: Callable[[], bool], limit_s: float = STEP_S) -> bool:
    end = time.monotonic() + limit_s
    while not check():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def _failed_engine(mount: Path, keys: tuple[bytes, ...] = (KEY,)) -> tuple[RocksDbEngine, Path]:
    """An engine holding ``keys`` whose write then failed on the full disk, and the filler file."""
    engine = RocksDbEngine(mount / "rocksdb", sync=True)
    for key in keys:
        engine.write(lambda txn, key=key: txn.put("blocks", key, VALUE))  # type: ignore[misc]
    filler = fill_leaving(mount, 0)
    for n in range(40):
        try:
            engine.write(lambda txn, n=n: txn.put("blocks", b"full-%d" % n, VALUE))  # type: ignore[misc]
        except TierError:
            return engine, filler
    engine.close()
    raise AssertionError("no write failed on the full disk")


class LongRead:
    """A read on its own thread whose function blocks until :meth:`end`, then reads ``KEY``."""

    def __init__(self, engine: RocksDbEngine) -> None:
        self.began, self.returned, self._end = threading.Event(), threading.Event(), threading.Event()
        self.got: list[bytes] = []
        self.thread = threading.Thread(target=engine.read, args=(self._fn,), daemon=True)
        self.thread.start()
        assert self.began.wait(STEP_S), "the long read did not begin"

    def _fn(self, txn: object) -> None:
        self.began.set()
        self._end.wait(30)
        self.got.append(bytes(txn.get("blocks", KEY)))  # type: ignore[attr-defined]
        self.returned.set()

    def end(self) -> None:
        self._end.set()
        self.thread.join(30)


def _watch_writable_opens(engine: RocksDbEngine, long: LongRead) -> list[bool]:
    """Per writable open of ``engine``: whether the long read had returned by then (the open is the real one)."""
    real_open, opens = engine._open, []

    def watched_open():  # type: ignore[no-untyped-def]
        opens.append(long.returned.is_set())
        return real_open()
    engine._open = watched_open  # type: ignore[method-assign]
    return opens


def _in_thread(fn: Callable[[], object], out: list[object]) -> threading.Thread:
    def run() -> None:
        try:
            out.append(fn())
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            out.append(exc)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _write_after(engine: RocksDbEngine) -> Callable[[], object]:
    return lambda: engine.write(lambda txn: txn.put("blocks", b"after", VALUE))


def _read_key(engine: RocksDbEngine, key: bytes = KEY) -> Callable[[], object]:
    return lambda: engine.read(lambda txn: bytes(txn.get("blocks", key)))


def test_a_read_during_a_recovery_does_not_wait_for_a_long_read_on_the_failed_database(mount: Path) -> None:
    engine, filler = _failed_engine(mount)
    failed_db = engine._db
    long = LongRead(engine)  # on the failed database: a failed one still reads
    opens = _watch_writable_opens(engine, long)
    wrote: list[object] = []
    got: list[object] = []
    writer = _in_thread(_write_after(engine), wrote)  # the write after a failed one recovers first
    try:
        _wait_for(lambda: engine._db is not failed_db)  # the stand-in bound (before the change: not while `long` ran)
        short = _in_thread(_read_key(engine), got)
        short.join(STEP_S)
        assert got == [VALUE], "a read started during the recovery waited for a long read on the failed database"
        assert not long.returned.is_set() and opens == []  # the writable open waits for the long read's end
        filler.unlink()  # room again: the writable open, once due, succeeds
    finally:
        filler.unlink(missing_ok=True)
        long.end()
        writer.join(30)
        try:
            assert long.got == [VALUE]  # the failed database stayed open for its last read
            assert opens == [True]  # one writable open, after the long read ended
            assert wrote == [None], wrote
            assert _read_key(engine, b"after")() == VALUE
        finally:
            engine.close()


def test_without_a_stand_in_reads_wait_for_the_recovery_that_waits_for_the_long_read(
        mount: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine, filler = _failed_engine(mount)
    long = LongRead(engine)
    opens = _watch_writable_opens(engine, long)
    monkeypatch.setattr(tempfile, "tempdir", str(mount / "gone"))  # no stand-in: its shadow has no directory
    wrote: list[object] = []
    got: list[object] = []
    filler.unlink()
    writer = _in_thread(_write_after(engine), wrote)
    short: threading.Thread | None = None
    try:
        _wait_for(lambda: engine._db is None)  # the failed database taken off (before the change: once `long` ended)
        short = _in_thread(_read_key(engine), got)
        short.join(1.0)
        assert short.is_alive() and opens == []  # as before: a read waits for the recovery, which waits for `long`
    finally:
        long.end()
        writer.join(30)
        try:
            if short is not None:
                short.join(30)
            assert got == [VALUE] and long.got == [VALUE] and opens == [True] and wrote == [None], (got, opens, wrote)
        finally:
            engine.close()


def test_a_read_whose_open_is_swapped_out_after_its_check_waits_for_the_reopen(tmp_path: Path) -> None:
    """The narrow race left by the gate's removal: a read checks for a bound
    open, then a swap with no stand-in (a recovery whose read-only open
    failed) unbinds it before the read takes it. The read checks again under
    the commit lock and waits for the reopen; it never reads emptied tables
    (``KeyError('blocks')``). The race is forced by doing the swap right
    after the check on the read's own thread (the instance's check wrapped;
    the swap is the engine's real one)."""
    engine = RocksDbEngine(tmp_path / "rocksdb", sync=False)
    try:
        engine.write(lambda txn: txn.put("blocks", KEY, VALUE))
        real_check, raced = engine._recover_if_failed, []

        def check_then_swap_out(**kwargs):  # type: ignore[no-untyped-def]
            real_check(**kwargs)
            if not raced:
                raced.append(True)
                with engine._write_lock:
                    engine._swap(None, failed=False).released.wait(STEP_S)  # nothing bound, as with no stand-in
        engine._recover_if_failed = check_then_swap_out  # type: ignore[method-assign]
        assert _read_key(engine)() == VALUE
        assert raced and engine._db is not None  # the read reopened the store, then read it
        assert _read_key(engine)() == VALUE
    finally:
        engine.close()
