"""A put folds the reads buffered before it into its transaction only when
it evicts (the eviction must see them); otherwise, or when it fails, they
stay buffered for the maintenance thread, so repeated reads of a block
between its rounds cost one recency write (real LMDB and RocksDB stores;
the maintenance thread's interval is an hour, so nothing else writes them).
A read with ``touch=False`` counts its hit but leaves recency alone, and
``Store.touch`` sets recency as a read would, without reading."""

from __future__ import annotations

import time

import pytest

import ucm_db
from ucm_db import Namespace

NS = Namespace(model="reads-for-eviction", kv_dtype="bfloat16", block_size=4)
BLOCK_BYTES = 256 << 10


def chain(seed: int, blocks: int) -> ucm_db.BlockKeys:
    return NS.block_keys([seed * 1000 + t for t in range(4 * blocks)])


def block(i: int) -> bytes:
    return bytes([i % 251]) * BLOCK_BYTES


@pytest.fixture(params=["lmdb", "rocksdb"])
def store(tmp_path, request):
    options = dict(codec="none", capacity_bytes=6 * BLOCK_BYTES + 4000, engine=request.param, sync_interval_s=3600.0)
    with ucm_db.open(tmp_path / "s", **options) as s:
        yield s


def hits_in_index(store, keys) -> list[int]:
    return [meta.hits for meta in store._tier.metas(list(keys))]


def test_a_put_that_evicts_nothing_leaves_the_reads_buffered_and_repeats_cost_one_write(store) -> None:
    a = chain(1, 2)
    store.put(NS, a, [block(0), block(1)])
    for _ in range(3):
        assert all(b is not None for b in store.get(NS, a))
        store.put(NS, chain(10 + _, 1), [block(10 + _)])  # room left: evicts nothing
    assert hits_in_index(store, a) == [0, 0]  # not folded into any of the three puts
    assert store.stats().hits == 6  # yet counted: stats() adds the buffered reads
    store._activity.flush_activity()  # the maintenance thread's round
    assert hits_in_index(store, a) == [1, 1]  # three reads between rounds: one recency write each
    assert store.stats().hits == 6


def _oldest_then_others(store) -> tuple[ucm_db.BlockKeys, list[ucm_db.BlockKeys]]:
    """Six one-block chains put 2 ms apart, ``old`` first: the store is full."""
    old = chain(1, 1)
    store.put(NS, old, [block(0)])
    others = [chain(10 + j, 1) for j in range(5)]
    for j, keys in enumerate(others):
        time.sleep(0.002)
        store.put(NS, keys, [block(10 + j)])
    time.sleep(0.002)
    return old, others


def test_a_put_that_evicts_applies_the_reads_first_so_a_block_just_read_stays(store) -> None:
    old, others = _oldest_then_others(store)
    assert store.get(NS, old)[0] is not None  # the oldest block, read now
    store.put(NS, chain(99, 1), [block(99)])  # full: one block must go
    assert store.lookup(NS, old) == 1  # the read reached the index before the eviction
    assert [store.lookup(NS, keys) for keys in others] == [0, 1, 1, 1, 1]  # the next oldest went
    assert hits_in_index(store, old) == [1]


def test_a_put_that_fails_while_evicting_gives_the_reads_back(store) -> None:
    a = chain(1, 1)
    store.put(NS, a, [block(0)])
    assert store.get(NS, a)[0] is not None
    with pytest.raises(ucm_db.StoreFullError):
        store.put(NS, chain(2, 8), [block(i) for i in range(8)])  # larger than the store: nothing stored
    assert hits_in_index(store, a) == [0]
    assert store.stats().hits == 1  # still buffered, not lost
    store._activity.flush_activity()
    assert hits_in_index(store, a) == [1]


def test_a_read_without_touch_counts_the_hit_but_leaves_the_block_oldest(store) -> None:
    old, others = _oldest_then_others(store)
    into = bytearray(BLOCK_BYTES)
    assert store.get_into(NS, old, [into], touch=False) == [True] and into == block(0)
    assert store.stats().hits == 1
    store.put(NS, chain(99, 1), [block(99)])  # full: one block must go
    assert store.lookup(NS, old) == 0  # still the least recently used: the read did not touch it
    assert [store.lookup(NS, keys) for keys in others] == [1] * 5


def test_a_touch_without_a_read_keeps_a_block_as_a_read_would(store) -> None:
    old, others = _oldest_then_others(store)
    store.touch(NS, old)  # another process read it (the connector's workers)
    store.touch(NS, chain(77, 1))  # never stored: skipped when written
    assert store.stats().hits == 0  # a touch is no read
    store.put(NS, chain(99, 1), [block(99)])
    assert store.lookup(NS, old) == 1
    assert [store.lookup(NS, keys) for keys in others] == [0, 1, 1, 1, 1]
    assert hits_in_index(store, old) == [1]


def test_touch_checks_its_arguments_and_a_read_only_store_keeps_no_touch(store, tmp_path) -> None:
    with pytest.raises(ucm_db.ConfigError, match="touch takes a sequence of block keys"):
        store.touch(NS, b"\0" * 32)
    with pytest.raises(ucm_db.ConfigError):
        store.touch("not a namespace", chain(1, 1))  # type: ignore[arg-type]
    old = chain(1, 1)
    store.put(NS, old, [block(0)])
    store.close()
    with ucm_db.open(tmp_path / "s", read_only=True, engine=store.config.engine) as reader:
        reader.touch(NS, old)
        assert reader._activity.take().touched == {}
