"""Eviction takes chain tails, least recently used first, and a put that
continues a chain makes the chain as new as its blocks: the newest block of
a chain never goes with an old ancestor (real LMDB and RocksDB stores)."""

from __future__ import annotations

import time

import pytest

import ucm_db
from ucm_db import Namespace
from ucm_db.tiers.local import TOUCH_SLACK_NS

NS = Namespace(model="eviction-order", kv_dtype="bfloat16", block_size=4)
BLOCK_BYTES = 128 << 10


def chain(seed: int, blocks: int) -> ucm_db.BlockKeys:
    return NS.block_keys([seed * 1000 + t for t in range(4 * blocks)])  # slices know their parent


def block(i: int) -> bytes:
    return bytes([i % 251]) * BLOCK_BYTES


@pytest.fixture(params=["lmdb", "rocksdb"])
def store(tmp_path, request):
    with ucm_db.open(tmp_path / "s", codec="none", capacity_bytes=8 * BLOCK_BYTES + 4000, engine=request.param) as s:
        yield s


def test_the_newest_block_does_not_go_with_its_old_parent(store) -> None:
    a = chain(1, 2)
    store.put(NS, a[:1], [block(0)])  # the oldest block ...
    others = [chain(10 + j, 1) for j in range(6)]
    for j, keys in enumerate(others):
        time.sleep(0.002)
        store.put(NS, keys, [block(10 + j)])
    time.sleep(0.002)
    store.put(NS, a[1:], [block(1)])  # ... gains the newest child
    store.put(NS, chain(99, 1), [block(99)])  # one more block: one must go
    assert store.lookup(NS, a) == 2
    assert sum(store.lookup(NS, keys) for keys in others) == 5  # the oldest other block went


def test_a_block_with_children_is_never_the_victim_while_a_tail_is_older(store) -> None:
    """Within the touch slack the parent stays older than its child; the
    eviction still skips it and takes the least recently used tail."""
    assert TOUCH_SLACK_NS >= 10**8  # the puts below run well within it
    a = chain(1, 3)
    store.put(NS, a, [block(0), block(1), block(2)])
    others = [chain(10 + j, 1) for j in range(5)]
    for j, keys in enumerate(others):
        store.put(NS, keys, [block(10 + j)])
    store.put(NS, chain(99, 1), [block(99)])
    # a's tail is the least recently used tail; its ancestors stay with it until it goes.
    assert store.lookup(NS, a) == 2
    assert all(store.lookup(NS, keys) == 1 for keys in others)


def test_maintenance_eviction_takes_tails_too(tmp_path) -> None:
    from ucm_db import maintenance

    path = tmp_path / "s"
    a = chain(1, 2)
    with ucm_db.open(path, codec="none") as s:
        s.put(NS, a[:1], [block(0)])
        others = [chain(10 + j, 1) for j in range(4)]
        for j, keys in enumerate(others):
            time.sleep(0.002)
            s.put(NS, keys, [block(10 + j)])
        time.sleep(0.002)
        s.put(NS, a[1:], [block(1)])
    assert maintenance.evict_to_bytes(path, 5 * BLOCK_BYTES + 4000) == 1
    with ucm_db.open(path) as s:
        assert s.lookup(NS, a) == 2
        assert sum(s.lookup(NS, keys) for keys in others) == 3
