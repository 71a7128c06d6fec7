"""Eviction takes chain tails, least recently used first; a block with
children is passed over (and filed as used now), so the newest block of a
chain never goes with an old ancestor, and the eviction cost stays flat
however long the chains (real LMDB and RocksDB stores, and the in-memory reference engine)."""

from __future__ import annotations

import time

import pytest

import ucm_db
from ucm_db import Namespace

NS = Namespace(model="eviction-order", kv_dtype="bfloat16", block_size=4)
BLOCK_BYTES = 128 << 10


def chain(seed: int, blocks: int) -> ucm_db.BlockKeys:
    return NS.block_keys([seed * 1000 + t for t in range(4 * blocks)])  # slices know their parent


def block(i: int) -> bytes:
    return bytes([i % 251]) * BLOCK_BYTES


@pytest.fixture(params=["lmdb", "rocksdb", "memory"])
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


def test_eviction_passes_over_a_long_chain_s_inner_blocks_once(tmp_path) -> None:
    """A chain saved in many puts leaves its inner blocks older than its
    tail, at the front of the LRU order. Evicting must not rescan them for
    every victim: after the first eviction they are filed as used, so the
    next puts' evictions find a tail at once (counted as LRU entries read)."""
    block_bytes = 64 << 10
    with ucm_db.open(tmp_path / "s", codec="none", capacity_bytes=1200 * block_bytes) as s:
        long_chain = chain(1, 1024)
        for i in range(0, 1024, 32):
            s.put(NS, long_chain[i : i + 32], [bytes([i % 251]) * block_bytes] * 32)
        for j in range(12):
            s.put(NS, chain(100 + j, 32), [bytes([j]) * block_bytes] * 32)
        evictions = s.stats().evictions
        assert evictions >= 200
        assert 1024 - 32 <= s.lookup(NS, long_chain) < 1024  # it lost tail blocks only
        # Every inner block of the long chain was passed over once: about
        # 1000 entries read in all, where rescanning per victim reads ~200k.
        assert s._tier.eviction_entries_scanned <= 1024 + 4 * evictions


def test_reading_a_long_prefix_again_rewrites_the_read_block_not_its_ancestors(tmp_path, monkeypatch) -> None:
    """A touch walks up only to the first ancestor within the slack of the
    touch (the scheduler touches a 512-block prefix each time a request
    loads it); one older than that is brought up to date, the walk with it."""
    from ucm_db.index import writes

    with ucm_db.open(tmp_path / "s", codec="none") as s:
        keys = chain(1, 6)
        s.put(NS, keys, [block(i) for i in range(6)])
        put_ns = [m.access_ns for m in s._tier.metas(list(keys))]
        s.touch(NS, [keys[-1]])
        s._state.activity.flush_activity()
        after = [m.access_ns for m in s._tier.metas(list(keys))]
        assert after[:-1] == put_ns[:-1]  # put a moment ago: within the slack, not rewritten
        assert after[-1] > put_ns[-1]  # the touched block itself: exact
        monkeypatch.setattr(writes, "ANCESTOR_RECENCY_SLACK_NS", 0)
        s.touch(NS, [keys[3]])
        s._state.activity.flush_activity()
        latest = [m.access_ns for m in s._tier.metas(list(keys))]
        assert all(latest[i] > after[i] for i in range(4)) and latest[4:] == after[4:]  # older than the slack: walked


def test_an_ancestor_left_within_the_slack_still_goes_after_its_tail_and_older_tails(store) -> None:
    """The slack never moves an ancestor before what the touch promises to
    outlive: a block with children is filed again as used when the scan
    meets it, so it goes only after its (touched) tail, and after every
    block read or written before the touch."""
    a = chain(1, 2)
    store.put(NS, a, [block(0), block(1)])
    others = [chain(10 + j, 1) for j in range(6)]
    for j, keys in enumerate(others):
        time.sleep(0.002)
        store.put(NS, keys, [block(10 + j)])
    time.sleep(0.002)
    store.touch(NS, [a[-1]])  # a's head stays at its put time (within the slack)
    store._state.activity.flush_activity()
    for j in range(6):  # each put evicts one block: the other blocks first, oldest first
        store.put(NS, chain(200 + j, 1), [block(200 + j)])
        assert store.lookup(NS, a) == 2
        assert sum(store.lookup(NS, keys) for keys in others) == 5 - j
    store.put(NS, chain(300, 1), [block(300)])
    assert store.lookup(NS, a) == 1  # then a's tail, the touched block, before its head


def test_a_chain_continued_in_a_full_store_costs_its_batch_not_its_depth(tmp_path, monkeypatch) -> None:
    """A request's chain saved a few blocks a put while the store is full:
    each put evicts without walking the chain to its root (the ancestors of
    a stored block have live children, so they are never tails) and without
    rescanning the chain's inner blocks for every victim; the chain stays
    whole and the oldest other chains go."""
    from ucm_db.index import damage

    block_bytes = 16 << 10
    meta_reads = 0
    stored_meta = damage.stored_meta

    def counting(txn, key):
        nonlocal meta_reads
        meta_reads += 1
        return stored_meta(txn, key)

    with ucm_db.open(tmp_path / "s", codec="none", capacity_bytes=300 * block_bytes) as s:
        others = [chain(5000 + j, 1) for j in range(280)]
        for j, keys in enumerate(others):
            s.put(NS, keys, [bytes([j % 251]) * block_bytes])
        long_chain = chain(1, 256)
        monkeypatch.setattr(damage, "stored_meta", counting)
        scanned_before, puts = s._tier.eviction_entries_scanned, 0
        for i in range(0, 256, 4):
            s.put(NS, long_chain[i : i + 4], [bytes([i % 251]) * block_bytes] * 4)
            puts += 1
        evictions = s.stats().evictions
        assert evictions >= 230
        assert s.lookup(NS, long_chain) == 256  # every ancestor stayed
        assert sum(s.lookup(NS, keys) for keys in others) <= 50  # the others went, oldest first
        assert all(s.lookup(NS, keys) == 1 for keys in others[-10:])
        # About one metadata read a put (its parent's depth), not the chain's
        # depth (a root walk a put reads ~8,000), and about one LRU entry
        # read a victim plus each inner block of the chain once.
        assert meta_reads <= 4 * puts
        assert s._tier.eviction_entries_scanned - scanned_before <= 256 + 4 * evictions


def test_a_put_that_evicts_keeps_its_own_parent_when_that_is_the_oldest_tail(store) -> None:
    """The put's own children link makes its parent a non-tail inside the
    put's transaction (each engine reads its own writes), so the eviction
    that put sets off takes the oldest other tail, never the parent."""
    a = chain(1, 2)
    store.put(NS, a[:1], [block(0)])  # the oldest block, a tail until the put below
    others = [chain(10 + j, 1) for j in range(7)]
    for j, keys in enumerate(others):
        time.sleep(0.002)
        store.put(NS, keys, [block(10 + j)])  # the store is full: 8 blocks
    store.put(NS, a[1:], [block(1)])  # continues the oldest block and must evict one
    assert store.lookup(NS, a) == 2
    assert [store.lookup(NS, keys) for keys in others] == [0] + [1] * 6
