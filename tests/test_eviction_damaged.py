"""A put into a full store over a damaged index keeps the chain it
continues: a damaged metadata record above its blocks is not quarantined by
its eviction (which would take the put's own blocks with it), and a lost
child link just above its stored parent is restored before the eviction
could take the grandparent as a tail. Real LMDB and RocksDB stores and the
in-memory reference engine; the damage is written into the engine's tables
(no store API writes it)."""

from __future__ import annotations

import struct
import time

import numpy as np
import pytest

import ucm_db
from ucm_db import Namespace

NS = Namespace(model="eviction-damaged", kv_dtype="bfloat16", block_size=4)
BLOCK_BYTES = 128 << 10
#: Offset of ``stored_bytes`` in a metadata record (entries.META: namespace id, parent, depth, raw bytes).
STORED_AT = 16 + 32 + 4 + 8


def chain(seed: int, blocks: int) -> ucm_db.BlockKeys:
    return NS.block_keys([seed * 1000 + t for t in range(4 * blocks)])


def block(i: int) -> bytes:
    return bytes([i % 251]) * BLOCK_BYTES


@pytest.fixture(params=["lmdb", "rocksdb", "memory"])
def full_store(tmp_path, request):
    """A store of 8 blocks holding a chain ``a`` of 2 (the oldest) and 6
    single-block chains: the next put evicts."""
    with ucm_db.open(tmp_path / "s", codec="none", capacity_bytes=8 * BLOCK_BYTES + 4000, engine=request.param) as s:
        a = chain(1, 3)
        s.put(NS, a[:2], [block(0), block(1)])
        others = [chain(10 + j, 1) for j in range(6)]
        for j, keys in enumerate(others):
            time.sleep(0.002)
            s.put(NS, keys, [block(10 + j)])
        yield s, a, others


def test_a_damaged_record_above_the_put_is_not_quarantined_with_the_put_s_blocks(full_store) -> None:
    store, a, others = full_store

    def damage_root(txn) -> None:
        record = bytes(txn.get("meta", a[0]))
        txn.put("meta", a[0], record[:STORED_AT] + struct.pack("<Q", 2**63) + record[STORED_AT + 8:])

    store._tier.engine.write(damage_root)
    result = store.put(NS, a[2:3], [block(2)])
    assert result.stored == 1 and result.evicted == 1
    assert store._tier.reads.exists(list(a)) == [True, True, True]  # the put's block and its ancestors stay
    assert [store.lookup(NS, keys) for keys in others] == [0] + [1] * 5  # the oldest other tail went
    assert any("damaged" in problem for problem in store._tier.check())  # left for verify to name


def test_a_lost_link_above_the_put_s_parent_is_restored_before_its_eviction(full_store) -> None:
    store, a, others = full_store
    store._tier.engine.write(lambda txn: txn.delete("children", a[0] + a[1]))
    assert any("child link from its parent missing" in problem for problem in store._tier.check())
    result = store.put(NS, a[2:3], [block(2)])
    assert result.stored == 1 and result.evicted == 1
    assert store.lookup(NS, a) == 3  # the grandparent did not go as a tail
    assert [store.lookup(NS, keys) for keys in others] == [0] + [1] * 5
    assert store._tier.check() == []


@pytest.mark.parametrize("engine", ["lmdb", "rocksdb", "memory"])
def test_a_damaged_record_above_the_call_s_stored_blocks_stays_with_them(tmp_path, engine) -> None:
    """A put whose first blocks were stored already (they are protected,
    not put again) over a damaged ancestor of theirs: the eviction leaves
    the damaged record, so the call's blocks and the new one stay."""
    with ucm_db.open(tmp_path / "s", codec="zstd", capacity_bytes=8 * BLOCK_BYTES + 8000, engine=engine) as store:
        a = chain(1, 4)
        payloads = [np.random.default_rng(i).integers(0, 256, BLOCK_BYTES, dtype=np.uint8).tobytes() for i in range(9)]
        store.put(NS, a[:3], payloads[:3])  # incompressible: each fills a block's share of the capacity
        others = [chain(10 + j, 1) for j in range(5)]
        for j, keys in enumerate(others):
            time.sleep(0.002)
            store.put(NS, keys, [payloads[4 + j]])

        def damage_root(txn) -> None:
            record = bytes(txn.get("meta", a[0]))
            txn.put("meta", a[0], record[:STORED_AT] + struct.pack("<Q", 2**63) + record[STORED_AT + 8:])

        store._tier.engine.write(damage_root)
        result = store.put(NS, a[1:4], payloads[1:4], parent=a[0])  # a[1], a[2] stored already
        assert (result.stored, result.already_present, result.evicted) == (1, 2, 1)
        assert store._tier.reads.exists(list(a)) == [True, True, True, True]
