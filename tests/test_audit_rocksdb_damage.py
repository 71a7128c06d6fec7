"""A damaged payload on disk: "a miss, never a wedge" (docs/api.md) on the
RocksDB engine as on LMDB.

The bytes are flipped in the engine's own files (LMDB's ``data.mdb``,
RocksDB's ``*.blob`` blob files), not rewritten through the engine: RocksDB
checks its blob records' CRCs itself and, before the audit, failed every
read of the block (``TierError``, so ``get`` of any batch holding it failed
for good, and ``verify``, ``verify --fix`` and ``export`` failed too), and
a scan stopped at the damaged value as if the table ended there."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import ucm_db
from ucm_db import Namespace, ScatterSlabs, TierError, maintenance
from ucm_db.engines import rocksdb
from ucm_db.engines.rocksdb import RocksDbEngine

NS = Namespace(model="audit-rocksdb-damage", kv_dtype="bfloat16", block_size=4)
BLOCK_BYTES = 64 << 10  # blob files (>= 4 KiB)
BLOCKS = 4


def payload(i: int) -> bytes:
    return bytes([0x30 + i]) * BLOCK_BYTES


def flip_in_files(root: Path, marker: bytes) -> Path:
    """Flips one byte in the middle of ``marker``'s run in the one file
    under ``root`` holding it (as bit rot would) and returns that file."""
    for name in sorted(os.listdir(root)):
        path = root / name
        data = path.read_bytes() if path.is_file() else b""
        at = data.find(marker)
        if at >= 0:
            with open(path, "r+b") as f:
                f.seek(at + len(marker) // 2)
                f.write(bytes([data[at + len(marker) // 2] ^ 0x10]))
            return path
    raise AssertionError(f"no file under {root} holds the payload")


@pytest.fixture(params=["lmdb", "rocksdb"])
def damaged(tmp_path: Path, request: pytest.FixtureRequest) -> tuple[Path, ucm_db.BlockKeys]:
    """A store of one 4-block chain whose third payload has a flipped byte on disk."""
    path = tmp_path / "s"
    keys = NS.block_keys(list(range(4 * BLOCKS)))
    with ucm_db.open(path, engine=request.param, codec="none") as store:
        store.put(NS, keys, [payload(i) for i in range(BLOCKS)])
    flip_in_files(path / request.param, payload(2)[:8192])
    return path, keys


def test_a_damaged_payload_reads_as_a_miss_and_is_quarantined(damaged: tuple[Path, ucm_db.BlockKeys]) -> None:
    path, keys = damaged
    with ucm_db.open(path) as store:
        got = store.get(NS, keys)
        assert got[:3] == [payload(0), payload(1), None]
        flags = store.get_into(NS, keys, [bytearray(BLOCK_BYTES) for _ in keys])
        assert flags[:3] == [True, True, False]
        slabs = bytearray(BLOCKS * BLOCK_BYTES)  # the connector's load path (one C call per batch)
        flags = store.get_into(NS, keys, ScatterSlabs([memoryview(slabs)], [BLOCK_BYTES], list(range(BLOCKS))))
        assert flags[:3] == [True, True, False] and slabs[:BLOCK_BYTES] == payload(0)
        other = NS.block_keys([7] * 4)
        store.put(NS, other, [payload(9)])  # the next write quarantines it, with its descendant
        assert store.lookup(NS, keys) == 2
        assert store.stats().quarantined == 1 and store.stats().blocks == 3  # the descendant went with it
        store.put(NS, keys[2:], [payload(2), payload(3)])  # stored again, whole
        assert store.get(NS, keys) == [payload(i) for i in range(BLOCKS)]
        assert store._tier.check() == []


def test_verify_names_a_damaged_payload_and_fix_repairs_the_store(damaged: tuple[Path, ucm_db.BlockKeys],
                                                                   tmp_path: Path) -> None:
    path, keys = damaged
    report = maintenance.verify(path)
    assert [c["key"] for c in report.to_dict()["corrupt"]] == [keys[2].hex()]
    maintenance.verify(path, fix=True)
    assert not maintenance.verify(path).problems
    maintenance.export_archive(path, tmp_path / "a.tar")
    with ucm_db.open(path) as store:
        assert store.lookup(NS, keys) == 2 and store.get(NS, keys[:2]) == [payload(0), payload(1)]


def test_an_unreadable_blob_file_is_misses_and_a_scan_of_it_raises_instead_of_ending(tmp_path: Path) -> None:
    """A blob file whose header is damaged fails every read of its values:
    each is a miss (quarantined by the next write), and a scan must say so,
    not end there (a table that looks empty or short is a wrong answer: the
    index audit, a conversion)."""
    path = tmp_path / "s"
    keys = NS.block_keys(list(range(4 * BLOCKS)))
    with ucm_db.open(path, engine="rocksdb", codec="none") as store:
        store.put(NS, keys, [payload(i) for i in range(BLOCKS)])
    (blob,) = (path / "rocksdb").glob("*.blob")
    with open(blob, "r+b") as f:
        f.write(b"\0\0\0\0")  # the blob file's magic number
    engine = RocksDbEngine(path / "rocksdb", sync=True)
    try:
        with pytest.raises(TierError, match="blocks"):
            engine.read(lambda txn: [k for k, _ in txn.scan("blocks")])
    finally:
        engine.close()
    with ucm_db.open(path) as store:
        assert store.get(NS, keys) == [None] * BLOCKS
        store.put(NS, NS.block_keys([7] * 4), [payload(9)])  # quarantines the chain
        assert store.lookup(NS, keys) == 0
        store.put(NS, keys, [payload(i) for i in range(BLOCKS)])
        assert store.get(NS, keys) == [payload(i) for i in range(BLOCKS)]


def test_compact_of_a_damaged_store_names_the_fix_and_succeeds_after_it(tmp_path: Path) -> None:
    """RocksDB's blob garbage collection reads every live blob it moves, with
    its checksum: a damaged one fails the compaction. Before the audit that
    surfaced as "closing ...: Corruption" with a full-disk hint, and still
    failed after ``verify --fix`` had quarantined the block (a compaction
    moving blobs of one table file met the deleted entry's older copy)."""
    path = tmp_path / "s"
    keys = NS.block_keys(list(range(4 * BLOCKS)))
    with ucm_db.open(path, engine="rocksdb", codec="none") as store:
        store.put(NS, keys, [payload(i) for i in range(BLOCKS)])
    flip_in_files(path / "rocksdb", payload(2)[:8192])
    with pytest.raises(TierError, match="verify --fix"):
        maintenance.compact(path)
    with ucm_db.open(path) as store:  # still writes
        store.put(NS, NS.block_keys([7] * 4), [payload(9)])
    maintenance.verify(path, fix=True)
    report = maintenance.compact(path)
    assert report["rewrite"] == "rocksdb compaction"
    assert not maintenance.verify(path).problems
    with ucm_db.open(path) as store:
        assert store.lookup(NS, keys) == 2
        store.put(NS, keys[2:], [payload(2), payload(3)])
        assert store.get(NS, keys) == [payload(i) for i in range(BLOCKS)]


def test_background_blob_collection_meeting_a_damaged_payload_fails_one_put_not_one_in_four(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """RocksDB's blob garbage collection (in its background compactions)
    checks each blob it moves; meeting a damaged one still stored, it
    stopped every write until the engine reopened the database, and met it
    again soon after: 20 of 60 puts failed here, each after a second's wait
    (a full-disk hint), until the block was read. Now the first failure turns
    the collection off for the process: one put fails, naming the fix."""
    monkeypatch.setattr(rocksdb, "WRITE_BUFFER_BYTES", 256 << 10)  # a flush every few puts: compactions soon
    path = tmp_path / "s"
    cold = NS.block_keys(list(range(8)))
    with ucm_db.open(path, engine="rocksdb", codec="none", capacity_bytes=8 << 20) as store:
        store.put(NS, cold, [payload(1), payload(2)])
    flip_in_files(path / "rocksdb", payload(2)[:8192])
    failures = []
    with ucm_db.open(path) as store:
        for i in range(60):
            try:
                store.put(NS, NS.block_keys([1000 + i] * 8), [bytes([i]) * (32 << 10)] * 2)
            except TierError as exc:
                failures.append(exc)
        assert len(failures) <= 1, [str(f) for f in failures]
        assert all("verify --fix" in str(f) for f in failures)
        assert store.get(NS, cold) == [payload(1), None]  # the damaged block is a miss
