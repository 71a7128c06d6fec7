"""A read-only RocksDB store follows its writer: a later commit, a
``bump_epoch`` (``ucm-db invalidate``, a reset) included, is seen within
:data:`~ucm_db.engines.rocksdb_follow.FOLLOW_S` (ucm_db.engines.rocksdb_follow).

Before, a read-only RocksDB store stayed at the moment it opened: a
``kv_consumer`` on a read-only volume beside its writer kept deriving keys
at the epoch before an invalidation and served the invalidated KV for the
life of the engine.
"""

from __future__ import annotations

import logging
import tempfile
import threading
import time
from pathlib import Path

import pytest

import ucm_db
from ucm_db.engines import rocksdb_follow

NS = ucm_db.Namespace(model="follow/rocks", kv_dtype="bfloat16", block_size=16)


def _chain(epoch: int, first: int, blocks: int) -> list[bytes]:
    return NS.block_keys([first + i for i in range(blocks * NS.block_size)], epoch=epoch)


def _payloads(keys: list[bytes], fill: int) -> list[bytes]:
    return [bytes([fill]) * 8192 for _ in keys]  # large enough for blob files


def _wait_for(check: object, limit_s: float) -> float:
    started = time.monotonic()
    while not check():  # type: ignore[operator]
        assert time.monotonic() - started < limit_s, "not seen in time"
        time.sleep(0.02)
    return time.monotonic() - started


def test_a_read_only_store_sees_a_bump_and_new_blocks_of_its_writer(tmp_path: Path) -> None:
    with ucm_db.open(tmp_path / "s", engine="rocksdb", capacity_bytes=1 << 26) as writer:
        epoch = writer.epoch(NS)
        old = _chain(epoch, 0, 4)
        writer.put(NS, old, _payloads(old, 1))
        writer.flush()
        with ucm_db.open(tmp_path / "s", read_only=True) as reader:
            assert reader.epoch(NS) == epoch and reader.lookup(NS, old) == 4
            bumped = writer.bump_epoch(NS)  # an invalidation: the old keys must stop being derived
            writer.flush()
            _wait_for(lambda: reader.epoch(NS) == bumped, 4 * rocksdb_follow.FOLLOW_S + 2)
            assert reader.lookup(NS, _chain(reader.epoch(NS), 0, 4)) == 0
            new = _chain(bumped, 0, 3)
            writer.put(NS, new, _payloads(new, 2))
            writer.flush()
            _wait_for(lambda: reader.lookup(NS, new) == 3, 4 * rocksdb_follow.FOLLOW_S + 2)
            assert reader.get(NS, new) == _payloads(new, 2)


def test_reads_go_on_whole_while_the_reader_follows_a_busy_writer(tmp_path: Path) -> None:
    """Readers in threads beside a writer putting: every read answers whole
    (a payload read is one of the stored ones), none raises, and the reader
    moves on as the writer puts."""
    with ucm_db.open(tmp_path / "s", engine="rocksdb", capacity_bytes=1 << 28) as writer:
        epoch = writer.epoch(NS)
        base = _chain(epoch, 0, 2)
        writer.put(NS, base, _payloads(base, 7))
        writer.flush()
        errors: list[BaseException] = []
        stop = threading.Event()
        with ucm_db.open(tmp_path / "s", read_only=True) as reader:
            def read() -> None:
                try:
                    while not stop.is_set():
                        assert reader.get(NS, base) == _payloads(base, 7)
                except BaseException as exc:  # noqa: BLE001 - reported below
                    errors.append(exc)
            threads = [threading.Thread(target=read) for _ in range(2)]
            for thread in threads:
                thread.start()
            last: list[bytes] = []
            for i in range(30):
                last = _chain(epoch, 1000 * (i + 1), 2)
                writer.put(NS, last, _payloads(last, i))
                time.sleep(0.05)
            writer.flush()
            _wait_for(lambda: reader.lookup(NS, last) == 2, 4 * rocksdb_follow.FOLLOW_S + 2)
            stop.set()
            for thread in threads:
                thread.join()
        assert not errors, errors[:3]


def _shadows(tmp: Path) -> list[str]:
    return sorted(p.name for p in tmp.glob("ucm-db-rocksdb-ro-*"))


def test_an_unchanged_store_is_not_opened_again_and_a_failed_reopen_keeps_reading(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The shadow directory a read-only open makes (in the temp directory)
    names each open: the same one while the writer writes nothing, a new one
    after a commit; with no temp directory left, the reopen fails, is logged
    once, and reads go on from the open they had."""
    monkeypatch.setattr(rocksdb_follow, "FOLLOW_S", 0.25)  # the reader's checks, 4 a second: the same steps, sooner
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    with ucm_db.open(tmp_path / "s", engine="rocksdb", capacity_bytes=1 << 26) as writer:
        epoch = writer.epoch(NS)
        first = _chain(epoch, 0, 2)
        writer.put(NS, first, _payloads(first, 1))
        writer.flush()
        with ucm_db.open(tmp_path / "s", read_only=True) as reader:
            opened = _shadows(tmp)
            assert len(opened) == 1
            deadline = time.monotonic() + 3 * rocksdb_follow.FOLLOW_S
            while time.monotonic() < deadline:
                assert reader.lookup(NS, first) == 2
                time.sleep(0.05)
            assert _shadows(tmp) == opened  # nothing committed: never opened again
            second = _chain(epoch, 500, 2)
            writer.put(NS, second, _payloads(second, 2))
            writer.flush()
            _wait_for(lambda: reader.lookup(NS, second) == 2, 4 * rocksdb_follow.FOLLOW_S + 2)
            assert len(_shadows(tmp)) == 1 and _shadows(tmp) != opened  # the old one removed with its open
            monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "gone"))
            third = _chain(epoch, 900, 2)
            writer.put(NS, third, _payloads(third, 3))
            writer.flush()
            caplog.set_level(logging.DEBUG, logger="ucm_db")
            deadline = time.monotonic() + 3 * rocksdb_follow.FOLLOW_S
            while time.monotonic() < deadline:
                assert reader.get(NS, second) == _payloads(second, 2) and reader.lookup(NS, third) == 0
                time.sleep(0.05)
            failures = [r for r in caplog.records if "cannot be opened again" in r.getMessage()]
            assert [r.levelno for r in failures][:1] == [logging.WARNING] and len(failures) >= 2
            assert all(r.levelno == logging.DEBUG for r in failures[1:])
            monkeypatch.setattr(tempfile, "tempdir", str(tmp))
            _wait_for(lambda: reader.lookup(NS, third) == 2, 4 * rocksdb_follow.FOLLOW_S + 2)
