"""Review of af2361b (a read-only RocksDB store follows its writer): the
defects found, each test seen failing on that commit and passing with its
fix (ucm_db.engines.rocksdb_follow, ucm_db.engines.rocksdb).

The writer and the read-only reader are real RocksDB opens of one store in
this process (a read-only open takes no ``LOCK``); the follower is the real
thread. Two tests watch the engine's private state only to know when the
follower has reached a step (a reopen begun or done),
never to change it; one injects an I/O error into the follower's listing (a
fault a local disk cannot produce on demand: a network volume's EIO/ESTALE).
"""

from __future__ import annotations

import errno
import gc
import threading
import time
import weakref
from pathlib import Path

import pytest

import ucm_db
from ucm_db import maintenance
from ucm_db.engines import rocksdb_follow
from ucm_db.engines.rocksdb import RocksDbEngine

NS = ucm_db.Namespace(model="review/follow", kv_dtype="bfloat16", block_size=16)
#: Long enough for a few checks of the follower and one open.
SEEN_S = 4 * rocksdb_follow.FOLLOW_S + 2


def _wait_for(check: object, limit_s: float = SEEN_S) -> bool:
    end = time.monotonic() + limit_s
    while not check():  # type: ignore[operator]
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


def _engines(tmp_path: Path) -> tuple[RocksDbEngine, RocksDbEngine]:
    """A writer holding ``meta`` keys m and n, and a read-only engine of it."""
    path = tmp_path / "rocksdb"
    writer = RocksDbEngine(path, sync=True)
    writer.write(lambda txn: [txn.put("meta", b"m", b"1"), txn.put("meta", b"n", b"2")])
    return writer, RocksDbEngine(path, sync=True, read_only=True)


def _keys(txn: object, prefix: bytes = b"") -> list[bytes]:
    return [bytes(k) for k, _ in txn.scan("meta", prefix)]  # type: ignore[attr-defined]


def test_scans_after_a_reopen_see_keys_put_below_an_earlier_scans_first_key(tmp_path: Path) -> None:
    writer, reader = _engines(tmp_path)
    try:
        assert reader.read(_keys) == [b"m", b"n"]  # a whole-table scan: floor of meta = b"m"
        writer.write(lambda txn: txn.put("meta", b"a", b"0"))
        assert _wait_for(lambda: reader.read(lambda txn: txn.get("meta", b"a")) is not None)  # the reopen is in
        assert reader.read(_keys) == [b"a", b"m", b"n"]  # got [b"m", b"n"]
        assert reader.read(lambda txn: _keys(txn, b"a")) == [b"a"]  # got []
    finally:
        reader.close()
        writer.close()


def _lower_root(epoch: int, below: bytes) -> list[bytes]:
    """A one-block chain whose key sorts below ``below``."""
    first = 1000
    while True:
        keys = NS.block_keys([first + i for i in range(NS.block_size)], epoch=epoch)
        if keys[0] < below:
            return keys
        first += NS.block_size


def test_verify_beside_a_live_writer_reports_no_false_damage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reopened = threading.Event()
    reopen = RocksDbEngine._reopen

    def watched(self: RocksDbEngine) -> None:
        reopen(self)
        reopened.set()
    monkeypatch.setattr(RocksDbEngine, "_reopen", watched)
    with ucm_db.open(tmp_path / "s", engine="rocksdb", capacity_bytes=1 << 26) as writer:
        epoch = writer.epoch(NS)
        chain = NS.block_keys(list(range(4 * NS.block_size)), epoch=epoch)
        writer.put(NS, chain, [bytes([1]) * 8192] * 4)
        writer.flush()
        low = _lower_root(epoch, min(chain))

        def progress(done: int, total: int) -> None:
            if done == total and not reopened.is_set():  # after the blocks were checked, before the index is
                writer.put(NS, low, [bytes([2]) * 8192])  # a new chain, stored whole
                writer.flush()
                assert reopened.wait(SEEN_S)
        report = maintenance.verify(tmp_path / "s", progress=progress)
        assert reopened.is_set()
        assert not report.corrupt and report.index_problems == []  # got orphans and totals "disagreeing"


def test_following_survives_one_failed_listing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    failed = threading.Event()
    real = rocksdb_follow.listing

    def flaky(path: Path) -> rocksdb_follow.Listing:
        if not failed.is_set():
            failed.set()
            raise OSError(errno.EIO, "Input/output error", str(path))  # injected: see the module docs
        return real(path)
    with ucm_db.open(tmp_path / "s", engine="rocksdb", capacity_bytes=1 << 26) as writer:
        epoch = writer.epoch(NS)
        writer.flush()
        with ucm_db.open(tmp_path / "s", read_only=True) as reader:
            assert reader.epoch(NS) == epoch
            monkeypatch.setattr(rocksdb_follow, "listing", flaky)
            assert failed.wait(SEEN_S)
            bumped = writer.bump_epoch(NS)  # ucm-db invalidate beside the reader
            writer.flush()
            assert _wait_for(lambda: reader.epoch(NS) == bumped)  # stays at the old epoch for the life of the store


def test_a_short_read_does_not_wait_for_a_long_one_during_a_reopen(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    entered, returned = threading.Event(), threading.Event()
    reopen = RocksDbEngine._reopen

    def watched(self: RocksDbEngine) -> None:
        entered.set()
        reopen(self)
        returned.set()
    monkeypatch.setattr(RocksDbEngine, "_reopen", watched)
    writer, reader = _engines(tmp_path)
    release, began = threading.Event(), threading.Event()
    got: list[object] = []

    def long_read(txn: object) -> None:  # an inventory walk, a verify's scan, a big load
        began.set()
        release.wait(30)
    long = threading.Thread(target=reader.read, args=(long_read,))
    short = threading.Thread(target=lambda: got.append(reader.read(lambda txn: txn.get("meta", b"m"))))
    try:
        long.start()
        assert began.wait(5)
        writer.write(lambda txn: txn.put("meta", b"o", b"3"))  # the follower reopens
        assert entered.wait(SEEN_S)
        returned.wait(3)  # done, or (now) waiting for the long read with the reads' gate taken
        short.start()
        short.join(3)
        assert got == [b"1"]  # got []: the lookup is held until the long read ends
    finally:
        release.set()
        long.join()
        short.join()
        reader.close()
        writer.close()


def test_a_read_only_engine_left_open_is_collected(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    writer, reader = _engines(tmp_path)
    writer.close()
    checks: list[int] = []
    check = rocksdb_follow.Follower.check

    def counted(self: rocksdb_follow.Follower, reopen: object) -> bool:
        went_on = check(self, reopen)  # type: ignore[arg-type]
        checks.append(1)
        return went_on
    monkeypatch.setattr(rocksdb_follow.Follower, "check", counted)
    ref = weakref.ref(reader)
    try:
        assert _wait_for(lambda: len(checks) >= 1)  # the thread has looked at the store once
        time.sleep(0.2)  # and is back waiting for the next check (1 s away)
        del reader
        gc.collect()
        assert ref() is None  # the docstring's promise: "a store never closed is still collected"
    finally:
        left = ref()
        if left is not None:
            left.close()
