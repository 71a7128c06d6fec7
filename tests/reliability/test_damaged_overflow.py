"""A zeroed LMDB overflow page under one block's body (issue 26, item 5).

The damage is made for real: a store of 64 KiB blocks (each body on its own
run of overflow pages) is closed, the first page of one body's run is found
in data.mdb by searching for the body's bytes, and zeroed. LMDB then reads
the value as zeros (the codec finds it corrupt) but refuses to free its
pages: every delete of it failed with MDB_CORRUPTED, so the block could not
be quarantined, deleted, repaired or compacted away, and every get of its
chain raised TierError while lookup claimed it.

The reads do not crash the process here (LMDB 0.9 reads an overflow value
without checking its page header), so they run in-process."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

import ucm_db
from ucm_db.errors import TierError
from ucm_db.maintenance import compact, verify

from .harness import NS

PAGE = 4096
BLOCKS = 8
DAMAGED = 3
BODY_BYTES = 64 << 10


def _keys() -> list[bytes]:
    return NS.block_keys(list(range(BLOCKS * NS.block_size)))


def _payload(i: int) -> bytes:
    return hashlib.shake_256(b"overflow/%d" % i).digest(BODY_BYTES)


@pytest.fixture
def damaged(tmp_path: Path) -> Path:
    return _damaged_store(tmp_path / "s")


def _damaged_store(path: Path, **options: object) -> Path:
    with ucm_db.open(path, codec="none", **options) as store:
        store.put(NS, _keys(), [_payload(i) for i in range(BLOCKS)])
    data = path / "lmdb" / "data.mdb"
    raw = bytearray(data.read_bytes())
    at = raw.find(_payload(DAMAGED)[:256])
    assert at > 0, "the body is stored as it is (codec none)"
    page = at // PAGE
    while int.from_bytes(raw[page * PAGE + 10:page * PAGE + 12], "little") != 0x04:  # P_OVERFLOW: the run's first page
        page -= 1
    raw[page * PAGE:(page + 1) * PAGE] = bytes(PAGE)
    data.write_bytes(raw)
    return path


def test_an_unreadable_body_is_a_miss_and_the_read_quarantines_it(damaged: Path) -> None:
    keys = _keys()
    with ucm_db.open(damaged) as store:
        buffers = [bytearray(BODY_BYTES) for _ in keys]
        flags = store.get_into(NS, keys, buffers)
        assert flags == [i != DAMAGED for i in range(BLOCKS)]
        assert store.lookup(NS, keys) == DAMAGED, "the read quarantined the block and its descendants"
        got = store.get(NS, keys)
        assert got[:DAMAGED] == [_payload(i) for i in range(DAMAGED)] and got[DAMAGED:] == [None] * (BLOCKS - DAMAGED)
        assert keys[DAMAGED] in store._tier.quarantine_records()
        # Writes go on; storing that very key again needs the rewrite (its old page cannot be freed).
        other = NS.block_keys(list(range(1000, 1000 + 2 * NS.block_size)))
        assert store.put(NS, other, [b"a" * 100, b"b" * 100]).stored == 2
        with pytest.raises(TierError, match="damaged page") as info:
            store.put(NS, keys[DAMAGED:DAMAGED + 1], [_payload(DAMAGED)], parent=keys[DAMAGED - 1])
        assert "ucm-db compact" in info.value.hint
    assert not verify(damaged).problems
    report = compact(damaged)
    assert report["rewrite"] == "rewritten" and report["index_problems"] == []
    assert not verify(damaged).problems
    with ucm_db.open(damaged) as store:
        store.put(NS, keys, [_payload(i) for i in range(BLOCKS)])
        assert store.get(NS, keys) == [_payload(i) for i in range(BLOCKS)]


def test_delete_removes_a_block_with_an_unreadable_body(damaged: Path) -> None:
    keys = _keys()
    with ucm_db.open(damaged) as store:
        assert store.delete(NS, keys[DAMAGED - 1:DAMAGED]) == BLOCKS - DAMAGED + 1
        assert store.lookup(NS, keys) == DAMAGED - 1
    assert not verify(damaged).problems


def test_verify_fix_quarantines_a_block_with_an_unreadable_body(damaged: Path) -> None:
    keys = _keys()
    report = verify(damaged, isolated=True)
    assert list(report.corrupt) == [keys[DAMAGED]]
    report = verify(damaged, fix=True)
    assert report.quarantined_blocks == BLOCKS - DAMAGED
    assert not verify(damaged).problems
    with ucm_db.open(damaged) as store:
        assert store.lookup(NS, keys) == DAMAGED


def test_compact_carries_on_over_an_unreadable_body(damaged: Path) -> None:
    """compact died with a raw lmdb.IncompatibleError in LMDB's compacting
    copy; it now copies table by table, and the block is an ordinary corrupt
    block afterwards (verify --fix removes it)."""
    keys = _keys()
    report = compact(damaged)
    assert report["rewrite"] == "rewritten"
    assert list(verify(damaged).corrupt) == [keys[DAMAGED]]
    assert verify(damaged, fix=True).quarantined_blocks == BLOCKS - DAMAGED
    assert not verify(damaged).problems
    with ucm_db.open(damaged) as store:
        assert store.get(NS, keys[:DAMAGED]) == [_payload(i) for i in range(DAMAGED)]
        store.put(NS, keys, [_payload(i) for i in range(BLOCKS)])
        assert store.lookup(NS, keys) == BLOCKS


def test_a_put_whose_eviction_reaches_the_block_goes_through(tmp_path: Path) -> None:
    """Every put whose eviction reached the damaged block failed with DamagedPageError, 3 tries of 3, until
    something read that block or `verify --fix` ran: the cache stopped taking saves. The eviction now sets
    the block aside (quarantined, its payload stuck) and the put goes through."""
    keys = _keys()
    damaged = _damaged_store(tmp_path / "s", capacity_bytes=1 << 20)
    blocks = (1 << 20) // BODY_BYTES - 1  # a chain filling most of the capacity: every block before it must go
    with ucm_db.open(damaged) as store:
        other = NS.block_keys(list(range(5000, 5000 + blocks * NS.block_size)))
        result = store.put(NS, other, [_payload(100 + i) for i in range(blocks)])
        assert result.stored == blocks and result.evicted >= DAMAGED
        assert store.get(NS, other) == [_payload(100 + i) for i in range(blocks)]
        assert store.lookup(NS, keys) == 0
        assert keys[DAMAGED] in store._tier.quarantine_records()
        assert store._tier.check() == []


def test_evict_to_bytes_sets_the_block_aside_and_carries_on(damaged: Path) -> None:
    from ucm_db.maintenance import evict_to_bytes

    assert evict_to_bytes(damaged, 0) >= DAMAGED  # the blocks above the damaged one; it went to quarantine with its subtree
    with ucm_db.open(damaged) as store:
        assert store.lookup(NS, _keys()) == 0 and store._tier.check() == []
