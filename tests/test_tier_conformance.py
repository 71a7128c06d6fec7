"""Conformance suite every local engine passes (memory, LMDB, RocksDB).

Add an engine by adding a factory to ENGINE_FACTORIES.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ucm_db.errors import MissingAncestorError, StoreFullError
from ucm_db.engines.base import Engine
from ucm_db.index.local import BlockEntry, LocalTier, PendingActivity
from ucm_db.engines.lmdb import LmdbEngine
from ucm_db.engines.memory import MemoryEngine


def _memory(_: Path) -> Engine:
    return MemoryEngine()


def _lmdb(path: Path) -> Engine:
    return LmdbEngine(path / "lmdb", map_size_bytes=1 << 20, sync=False)


def _rocksdb(path: Path) -> Engine:
    from ucm_db.engines.rocksdb import RocksDbEngine

    return RocksDbEngine(path / "rocksdb", sync=False)


ENGINE_FACTORIES: dict[str, Callable[[Path], Engine]] = {"memory": _memory, "lmdb": _lmdb, "rocksdb": _rocksdb}


@pytest.fixture(params=sorted(ENGINE_FACTORIES))
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Engine]:
    eng = ENGINE_FACTORIES[request.param](tmp_path)
    yield eng
    eng.close()


@pytest.fixture
def tier(engine: Engine) -> LocalTier:
    return LocalTier(engine, capacity_bytes=1 << 30)


NS_ID = b"n" * 16


def chain(n: int, size: int = 100, tag: bytes = b"") -> list[BlockEntry]:
    keys = [(tag + b"k%05d" % i).ljust(32, b".") for i in range(n)]
    return [
        BlockEntry(k, keys[i - 1] if i else None, b"", bytes([i % 251]) * size, size * 2, NS_ID)
        for i, k in enumerate(keys)
    ]


# -- engine level -------------------------------------------------------------
def test_write_is_atomic_on_exception(engine: Engine) -> None:
    def failing(txn: object) -> None:
        txn.put("info", b"a", b"1")  # type: ignore[attr-defined]
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        engine.write(failing)
    assert engine.read(lambda txn: txn.get("info", b"a")) is None


def test_scan_is_sorted_and_prefix_bounded_with_read_your_writes(engine: Engine) -> None:
    def fill(txn: object) -> list[bytes]:
        for key in (b"b2", b"a1", b"b1", b"c1"):
            txn.put("info", key, key)  # type: ignore[attr-defined]
        txn.delete("info", b"c1")  # type: ignore[attr-defined]
        return [k for k, _ in txn.scan("info", b"b")]  # type: ignore[attr-defined]

    assert engine.write(fill) == [b"b1", b"b2"]
    assert engine.read(lambda txn: [k for k, _ in txn.scan("info")]) == [b"a1", b"b1", b"b2"]


def test_map_or_space_growth_is_transparent(engine: Engine) -> None:
    big = os.urandom(256 * 1024)
    for i in range(12):  # 3 MiB into an LMDB map that starts at 1 MiB
        engine.write(lambda txn, i=i: txn.put("blocks", b"%d" % i, big))
    assert engine.read(lambda txn: sum(1 for _ in txn.scan("blocks"))) == 12


# -- tier level ----------------------------------------------------------------
def test_put_get_exists_delete_iterate(tier: LocalTier) -> None:
    entries = chain(5)
    result = tier.put_blocks(entries)
    assert result.stored == 5
    keys = [e.key for e in entries]
    assert tier.get_batch(keys) == [bytes(e.head) + bytes(e.body) for e in entries]
    assert tier.exists(keys + [b"x" * 32]) == [True] * 5 + [False]
    assert sorted(tier.iterate()) == sorted(keys)
    assert tier.capabilities.transactional
    assert tier.delete([keys[2]]) == 3  # it and its two descendants
    assert tier.exists(keys) == [True, True, False, False, False]
    assert tier.check() == []


def test_second_put_of_same_blocks_is_idempotent(tier: LocalTier) -> None:
    entries = chain(3)
    tier.put_blocks(entries)
    again = tier.put_blocks(entries)
    assert (again.stored, again.already_present) == (0, 3)
    assert tier.totals().blocks == 3


def test_missing_parent_refuses_whole_batch(tier: LocalTier) -> None:
    entries = chain(4)
    with pytest.raises(MissingAncestorError):
        tier.put_blocks(entries[2:])
    assert tier.totals().blocks == 0
    tier.put_blocks(entries[:2])
    assert tier.put_blocks(entries[2:]).stored == 2


def test_count_prefix_is_binary_search_correct(tier: LocalTier) -> None:
    entries = chain(37)
    tier.put_blocks(entries[:20])
    keys = [e.key for e in entries]
    assert tier.count_prefix(keys) == 20
    assert tier.count_prefix(keys[:7]) == 7
    assert tier.count_prefix([e.key for e in chain(5, tag=b"q")]) == 0
    assert tier.count_prefix([]) == 0


def test_accounting_matches_metadata(tier: LocalTier) -> None:
    tier.put_blocks(chain(6, size=10))
    tier.put_blocks(chain(4, size=7, tag=b"o"))
    totals = tier.totals()
    assert (totals.blocks, totals.stored_bytes, totals.raw_bytes) == (10, 6 * 10 + 4 * 7, 2 * (60 + 28))
    assert tier.namespace_counts()[NS_ID][:3] == (10, 2 * 88, 88)
    assert tier.check() == []


def test_eviction_lru_tails_first_keeps_invariant(engine: Engine) -> None:
    tier = LocalTier(engine, capacity_bytes=1000)
    a = chain(5, size=100, tag=b"a")
    b = chain(5, size=100, tag=b"b")
    tier.put_blocks(a)
    tier.put_blocks(b)  # 1000 bytes: exactly at capacity
    activity = PendingActivity(touched={a[4].key: 2**62})  # touching a4 touches a0..a3 too
    tier.apply_activity(activity)
    result = tier.put_blocks(chain(3, size=100, tag=b"c"))
    assert result.evicted == 3
    # Oldest untouched: b's chain, evicted tail first -> b0, b1 survive.
    assert tier.exists([e.key for e in b]) == [True, True, False, False, False]
    assert tier.exists([e.key for e in a]) == [True] * 5
    assert tier.check() == []
    assert tier.totals().evictions == 3


def test_batch_larger_than_capacity_is_refused(engine: Engine) -> None:
    tier = LocalTier(engine, capacity_bytes=250)
    with pytest.raises(StoreFullError):
        tier.put_blocks(chain(3, size=100))
    assert tier.totals().blocks == 0


def test_quarantine_removes_descendants_and_records(tier: LocalTier) -> None:
    entries = chain(4)
    tier.put_blocks(entries)
    assert tier.quarantine(entries[1].key, "checksum mismatch", lambda head, body: True)
    assert tier.exists([e.key for e in entries]) == [True, False, False, False]
    assert tier.quarantine_records()[entries[1].key]["reason"] == "checksum mismatch"
    assert tier.totals().quarantined == 1
    # A block that is healthy when re-checked is left alone.
    assert not tier.quarantine(entries[0].key, "stale", lambda head, body: False)
    assert tier.check() == []


def test_upload_queue_is_written_with_the_batch(tier: LocalTier) -> None:
    entries = chain(3)
    tier.put_blocks(entries, enqueue_upload=True)
    assert tier.pending_uploads() == sorted(e.key for e in entries)
    tier.mark_uploaded([entries[0].key])
    assert len(tier.pending_uploads()) == 2
    tier.delete([entries[1].key])
    assert tier.pending_uploads() == []
