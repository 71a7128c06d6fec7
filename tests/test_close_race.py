"""``Store.close()`` while other threads use the store (real threads, a real
store, both engines).

* close waits for the operations in flight and refuses those that start
  after it began with ``ClosedError``: every read returns the stored bytes
  or raises ``ClosedError``, never a ``TierError`` about a closed
  environment, a ``RuntimeError`` from the codec pool or RocksDB's
  "Already mutably borrowed", and never a crash (LMDB's map was unmapped
  under a reader's copy: SIGSEGV). The race runs in a child process
  (tests/close_race_child.py), so a crash fails the test instead of
  killing pytest.
* close twice, at once from two threads, is one close.
* close from inside an operation (a callback on the caller's thread) or from
  one of the store's own threads returns without deadlocking; the store is
  released once the operations in flight have ended.
* Beneath the store: the engines' gate closes once its transactions have
  ended and refuses later ones with ``ClosedError``; a shut codec pool
  raises ``ClosedError``, not the executor's ``RuntimeError``.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

import ucm_db
from ucm_db import ClosedError, Namespace

CHILD = Path(__file__).with_name("close_race_child.py")
NS = Namespace(model="close-inside", kv_dtype="bfloat16", block_size=4)
RACE_S = 7.0


@pytest.mark.parametrize("engine", ["lmdb", "rocksdb"])
def test_close_beside_readers_and_writers(tmp_path: Path, engine: str) -> None:
    proc = subprocess.run([sys.executable, str(CHILD), str(tmp_path / "s"), engine, str(RACE_S), "7"],
                          capture_output=True, text=True, timeout=120)
    if proc.returncode < 0:
        pytest.fail(f"the child died of {signal.Signals(-proc.returncode).name}:\n{proc.stderr[-3000:]}")
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0 and not summary["failures"], (summary["failures"], proc.stderr[-3000:])
    assert summary["iterations"] >= 1 and summary["ok"] > 0 and summary["refused"] > 0, summary


def _filled(path: Path, engine: str) -> tuple[ucm_db.Store, Sequence[bytes]]:
    store = ucm_db.open(path, engine=engine, codec="none", capacity_bytes=1 << 28, check_on_open="none")
    keys = NS.block_keys(list(range(16)))
    store.put(NS, keys, [bytes([i]) * 4096 for i in range(len(keys))])
    return store, keys


def _reopen_when_released(path: Path, engine: str) -> ucm_db.Store:
    """The store opened again once the close handed off has released it."""
    for thread in threading.enumerate():
        if thread.name == "ucm-db-close":
            thread.join(30)
            assert not thread.is_alive(), "the handed-off close never released the store"
    return ucm_db.open(path, engine=engine, check_on_open="none")


@pytest.mark.parametrize("engine", ["lmdb", "rocksdb"])
def test_close_from_inside_an_operation_does_not_deadlock(tmp_path: Path, engine: str) -> None:
    store, keys = _filled(tmp_path / "s", engine)
    activity = store._state.activity
    record_reads = activity.record_reads
    closed_inside: list[bool] = []

    def close_then_record(*args: object, **kwargs: object) -> None:
        store.close()  # on the reader's own thread, inside its get_into
        closed_inside.append(True)
        record_reads(*args, **kwargs)

    activity.record_reads = close_then_record  # type: ignore[method-assign]
    buffers = [bytearray(4096) for _ in keys]
    flags: list[bool] = []
    reader = threading.Thread(target=lambda: flags.extend(store.get_into(NS, keys, buffers)))
    reader.start()
    reader.join(30)
    assert not reader.is_alive(), "close() inside get_into deadlocked"
    assert flags == [True] * len(keys)  # the read in flight finished on a store still open
    assert closed_inside and all(b == bytes([i]) * 4096 for i, b in enumerate(buffers))
    with pytest.raises(ClosedError):
        store.get(NS, keys)
    with _reopen_when_released(tmp_path / "s", engine) as again:
        assert again.lookup(NS, keys) == len(keys)


@pytest.mark.parametrize("engine", ["lmdb", "rocksdb"])
def test_close_from_a_store_thread_does_not_deadlock(tmp_path: Path, engine: str) -> None:
    store, keys = _filled(tmp_path / "s", engine)
    pool = store._state.codecs._pool
    assert pool is not None
    pool.submit(store.close).result(timeout=30)  # close() on one of the store's codec threads
    with pytest.raises(ClosedError):
        store.lookup(NS, keys)
    with _reopen_when_released(tmp_path / "s", engine) as again:
        assert again.get(NS, keys[:1]) == [bytearray(bytes([0]) * 4096)]


def test_every_call_on_a_closed_store_raises_closed_error(tmp_path: Path) -> None:
    store, keys = _filled(tmp_path / "s", "lmdb")
    store.close()
    store.close()  # a second close does nothing
    calls = [
        lambda: store.lookup(NS, keys), lambda: store.get(NS, keys), lambda: store.touch(NS, keys),
        lambda: store.get_into(NS, keys[:1], [np.zeros(4096, np.uint8)]), lambda: store.put(NS, keys, [b"x"] * len(keys)),
        lambda: store.delete(NS, keys), lambda: store.stats(), lambda: store.flush(), lambda: store.feed_position(),
        lambda: store.lookup_many(NS, [keys]),
    ]
    for call in calls:
        with pytest.raises(ClosedError):
            call()


def test_the_gate_closes_after_its_transactions_and_refuses_the_later_ones() -> None:
    from ucm_db.engines.gate import SharedExclusiveGate

    gate = SharedExclusiveGate()
    events: list[str] = []
    inside, release = threading.Event(), threading.Event()

    def reader() -> None:
        with gate.shared():
            inside.set()
            release.wait(5)
            events.append("read ended")

    def closer() -> None:
        with gate.closing("test engine is closed"):
            events.append("closed")

    def late_reader() -> None:
        try:
            with gate.shared():
                events.append("late read ran")
        except ClosedError:
            events.append("late read refused")

    first = threading.Thread(target=reader)
    first.start()
    inside.wait(5)
    closing = threading.Thread(target=closer)
    closing.start()
    deadline = time.monotonic() + 5
    while not gate._exclusive and time.monotonic() < deadline:  # the close is waiting for the read
        time.sleep(0.001)
    late = threading.Thread(target=late_reader)
    late.start()
    time.sleep(0.05)
    assert events == []  # the close waits for the read, the late read for the close
    release.set()
    for thread in (first, closing, late):
        thread.join(5)
    assert events == ["read ended", "closed", "late read refused"]
    with pytest.raises(ClosedError, match="test engine is closed"):
        with gate.exclusive():
            pass
    with gate.closing("again"):  # a second close holds nothing and waits for nothing
        pass


def test_work_handed_to_a_shut_codec_pool_raises_closed_error() -> None:
    from ucm_db.codec.pool import CodecPool

    pool = CodecPool(1)
    pool.shutdown()
    with pytest.raises(ClosedError):
        pool.beside(lambda: None)
