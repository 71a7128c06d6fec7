"""The local index's parts, each built alone over an engine with only the
dependencies its constructor names (no :class:`LocalTier` facade): the
writer and the reader over the same tables, the damage owner's quarantine,
the upkeep's checks and repairs, pins and the upload queue; and the facade
binding the parts' methods and sharing one :class:`TierLimits`."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ucm_db.engines.base import Engine, Txn
from ucm_db.engines.lmdb import LmdbEngine
from ucm_db.engines.memory import MemoryEngine
from ucm_db.errors import StoreFullError
from ucm_db.index.accounting import Changes
from ucm_db.index.damage import Damage
from ucm_db.index.entries import BlockEntry, PendingActivity, TierLimits, lru_key
from ucm_db.index.local import LocalTier
from ucm_db.index.pinning import IndexPins
from ucm_db.index.reads import IndexReader
from ucm_db.index.upkeep import IndexUpkeep
from ucm_db.index.upload_queue import UploadQueue
from ucm_db.index.writes import IndexWriter

NS_ID = b"p" * 16
ENGINES: dict[str, Callable[[Path], Engine]] = {
    "memory": lambda _path: MemoryEngine(),
    "lmdb": lambda path: LmdbEngine(path / "lmdb", map_size_bytes=1 << 20, sync=False),
}


@pytest.fixture(params=sorted(ENGINES))
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Engine]:
    eng = ENGINES[request.param](tmp_path)
    yield eng
    eng.close()


def chain(n: int, size: int = 100, tag: bytes = b"") -> list[BlockEntry]:
    keys = [(tag + b"c%05d" % i).ljust(32, b".") for i in range(n)]
    return [BlockEntry(k, keys[i - 1] if i else None, b"hd", bytes([i]) * size, 2 * size, NS_ID) for i, k in enumerate(keys)]


def writer_over(engine: Engine, capacity_bytes: int = 1 << 30) -> IndexWriter:
    limits = TierLimits(capacity_bytes)
    return IndexWriter(engine, limits, Damage(engine, limits))


def test_the_reader_reads_what_the_writer_wrote(engine: Engine) -> None:
    entries = chain(6)
    writer, reader = writer_over(engine), IndexReader(engine)
    assert writer.put_blocks(entries).stored == 6
    keys = [e.key for e in entries]
    assert reader.count_prefix(keys) == 6
    assert reader.count_prefix(keys, namespace_id=b"q" * 16) == 0
    assert reader.read_blobs(keys[:2]) == [b"hd" + bytes([0]) * 100, b"hd" + bytes([1]) * 100]
    assert [m.depth for m in reader.metas(keys) if m is not None] == list(range(6))
    assert (reader.totals().blocks, reader.totals().stored_bytes) == (6, 6 * 102)
    assert writer.delete([keys[3]]) == 3
    assert reader.exists(keys) == [True] * 3 + [False] * 3
    assert IndexUpkeep(engine).check() == []


def test_the_writer_reads_the_shared_limits_at_each_put() -> None:
    engine = MemoryEngine()
    limits = TierLimits(1 << 30)
    writer = IndexWriter(engine, limits, Damage(engine, limits))
    writer.put_blocks(chain(5, tag=b"a"))
    limits.capacity_bytes = 5 * 102  # lowered after the writer was built: the next put evicts
    assert writer.put_blocks(chain(2, tag=b"b")).evicted == 2
    assert writer.eviction_entries_scanned > 0
    limits.capacity_bytes = 100
    with pytest.raises(StoreFullError):
        writer.put_blocks(chain(2, tag=b"c"))


def test_the_damage_owner_quarantines_a_block_with_its_descendants(engine: Engine) -> None:
    entries = chain(4)
    writer_over(engine).put_blocks(entries)
    damage = Damage(engine, TierLimits(1 << 30))
    keys = [e.key for e in entries]
    assert not damage.quarantine(keys[0], "healthy on recheck", lambda _head, _body: False)
    assert damage.quarantine(keys[1], "checksum mismatch", lambda _head, _body: True)
    reader = IndexReader(engine)
    assert reader.exists(keys) == [True, False, False, False]
    assert damage.records()[keys[1]]["reason"] == "checksum mismatch"
    assert reader.totals().quarantined == 1
    assert IndexUpkeep(engine).check() == []


def test_the_damage_owner_clears_a_damaged_record_read_in_a_write(engine: Engine) -> None:
    entries = chain(3)
    writer_over(engine).put_blocks(entries)
    engine.write(lambda txn: txn.put("meta", entries[1].key, b"short"))
    damage = Damage(engine, TierLimits(1 << 30))

    def read(txn: Txn) -> object:
        changes = Changes(txn)
        metas = [damage.meta_or_clear(txn, changes, e.key) for e in entries]
        changes.commit()
        return [m is not None for m in metas]

    assert engine.write(read) == [True, False, False]  # the damaged block and its child are quarantined
    assert set(damage.records()) == {entries[1].key}
    assert IndexReader(engine).totals().blocks == 1
    assert IndexUpkeep(engine).check() == []


def test_upkeep_restores_links_and_finds_what_it_repairs(engine: Engine) -> None:
    entries = chain(3)
    writer_over(engine).put_blocks(entries)
    meta = IndexReader(engine).metas([entries[2].key])[0]
    assert meta is not None
    engine.write(lambda txn: txn.delete("lru", lru_key(meta.access_ns, meta.depth, entries[2].key)))
    upkeep = IndexUpkeep(engine)
    assert upkeep.check()
    assert upkeep.restore_links() == {"lru": 1, "children": 0}
    assert upkeep.check() == []


def test_pins_and_the_upload_queue_over_the_writer_s_blocks(engine: Engine) -> None:
    entries = chain(4)
    writer = writer_over(engine, capacity_bytes=6 * 102)
    writer.put_blocks(entries, enqueue_upload=True)
    keys = [e.key for e in entries]
    pinning = IndexPins(engine)
    report = pinning.pin_chains([keys], NS_ID, limit_bytes=1 << 20)
    assert report.chains == (4,) and pinning.pin_counts() == {NS_ID: (4, 4 * 102)}
    with pytest.raises(StoreFullError):  # the pinned chain is never evicted
        writer.put_blocks(chain(3, tag=b"x"))
    queue = UploadQueue(engine)
    assert queue.pending_uploads() == sorted(keys)
    queue.mark_uploaded(keys[:3])
    assert queue.queued(keys) == {keys[3]}


def test_the_facade_binds_the_parts_and_shares_one_limits_object() -> None:
    tier = LocalTier(MemoryEngine(), capacity_bytes=1 << 30)
    assert tier.writes.limits is tier.limits and tier.damage.limits is tier.limits
    tier.put_blocks(chain(3, tag=b"a"))
    tier.feed_max_records = 3
    tier.capacity_bytes = 4 * 102
    assert (tier.limits.feed_max_records, tier.limits.capacity_bytes) == (3, 4 * 102)
    assert tier.put_blocks(chain(2, tag=b"b")).evicted == 1
    assert tier.eviction_entries_scanned == tier.writes.eviction_entries_scanned > 0
    tier.apply_activity(PendingActivity(hits=2))
    assert tier.totals().hits == 2 and tier.check() == []
    assert tier.count_prefix.__self__ is tier.reads  # type: ignore[attr-defined]


class _PutCounting:
    """A transaction that counts the puts made through it (issue 50 item 3)."""

    def __init__(self, txn: Txn) -> None:
        self.txn, self.puts = txn, 0

    def put(self, table: str, key: bytes, value: bytes) -> None:
        self.puts += 1
        self.txn.put(table, key, value)

    def __getattr__(self, name: str) -> object:
        return getattr(self.txn, name)


def test_the_writer_finds_presence_in_its_own_transaction(engine: Engine) -> None:
    """One write transaction: the guard runs first (what it raises writes
    nothing), the blocks stored already are counted and left as they are,
    ``stored`` gets only the entries this put wrote."""
    writer, entries = writer_over(engine), chain(6)
    writer.put_blocks(entries[:2])

    def refuse(_txn: Txn) -> None:
        raise StoreFullError("refused by the guard")
    with pytest.raises(StoreFullError, match="guard"):
        writer.put_blocks(entries, guard=refuse)
    assert IndexReader(engine).count_prefix([e.key for e in entries]) == 2
    seen: list[Txn] = []
    stored: list[BlockEntry] = []
    again = [BlockEntry(e.key, e.parent, b"hd", b"other", 10, NS_ID) for e in entries[:2]] + entries[2:]
    result = writer.put_blocks(again, guard=seen.append, stored=stored)
    assert len(seen) == 1 and (result.stored, result.already_present) == (4, 2)
    assert stored == entries[2:]
    assert IndexReader(engine).read_blobs([entries[0].key]) == [b"hd" + bytes([0]) * 100]  # kept as it was


def test_counters_unchanged_by_a_transaction_are_not_written(engine: Engine) -> None:
    """A put of blocks all stored already changes no counter: its
    transaction writes no record (an LMDB commit then writes no page)."""
    writer, entries = writer_over(engine), chain(3)
    writer.put_blocks(entries)

    def commit_unchanged(txn: Txn) -> int:
        counting = _PutCounting(txn)
        changes = Changes(counting)  # type: ignore[arg-type]
        changes.ns(NS_ID)
        changes.commit()
        return counting.puts

    def commit_changed(txn: Txn) -> int:
        counting = _PutCounting(txn)
        changes = Changes(counting)  # type: ignore[arg-type]
        changes.totals.hits += 1
        changes.ns(NS_ID)[3] += 1
        changes.commit()
        return counting.puts

    assert engine.write(commit_unchanged) == 0
    assert engine.write(commit_changed) == 4  # both records, each with its checksum
    assert writer.put_blocks(entries).already_present == 3
    tier = LocalTier(engine, capacity_bytes=1 << 30)
    assert tier.check() == [] and tier.totals().hits == 1 and tier.totals().blocks == 3
