"""Pinning (issue 49 item 3): a pinned chain and its ancestors are never
evicted; pins survive reopen and compact, stay within max_pinned_bytes,
leave with unpin, delete, quarantine and invalidation, and the index's
check stays clean throughout (real LMDB and RocksDB stores)."""

from __future__ import annotations

import pytest

import ucm_db
from ucm_db import Namespace, StoreFullError, TierError, maintenance
from ucm_db.index.entries import PIN_PREFIX

NS = Namespace(model="pinning", kv_dtype="bfloat16", block_size=16)
OTHER = Namespace(model="pinning-other", kv_dtype="bfloat16", block_size=16)
BLOCK_BYTES = 4096
CAPACITY = 2 << 20
SYSTEM = list(range(2048))  # a 2k-token system prompt: 128 blocks, 512 KiB


def payload(seed: int) -> bytes:
    return bytes([seed % 251]) * BLOCK_BYTES


def put_tokens(store: ucm_db.Store, ns: Namespace, tokens: list[int]) -> ucm_db.BlockKeys:
    keys = ns.block_keys(tokens, epoch=store.epoch(ns))
    have = store.lookup(ns, keys)
    if have < len(keys):
        store.put(ns, keys[have:], [payload(i) for i in range(have, len(keys))])
    return keys


def workload(store: ucm_db.Store, total_bytes: int, *, base: int = 10**6, shared: bool = True) -> None:
    """Conversations continuing the system prompt (unless not ``shared``)
    and unrelated prompts, 8 new blocks each, until ``total_bytes`` were put."""
    written = 0
    i = 0
    while written < total_bytes:
        start = base + i * 1000
        tail = list(range(start, start + 8 * NS.block_size))
        put_tokens(store, NS, SYSTEM + tail if i % 2 and shared else tail)
        written += 8 * BLOCK_BYTES
        i += 1


def assert_clean(store: ucm_db.Store) -> None:
    assert store._tier.check() == []


@pytest.fixture(params=["lmdb", "rocksdb"])
def engine(request: pytest.FixtureRequest) -> str:
    return request.param


def test_a_pinned_system_prompt_survives_a_workload_ten_times_the_capacity(tmp_path, engine) -> None:
    with ucm_db.open(tmp_path / "s", codec="none", capacity_bytes=CAPACITY, engine=engine) as store:
        system = put_tokens(store, NS, SYSTEM)
        report = store.pin(NS, system)
        assert report.chains == (128,) and report.changed_blocks == 128 == report.namespace_blocks
        assert report.namespace_bytes == report.store_bytes == store.stats().pinned_bytes > 128 * BLOCK_BYTES
        workload(store, 10 * CAPACITY)
        stats = store.stats()
        assert stats.evictions > 1000 and stats.stored_bytes <= CAPACITY
        assert store.lookup(NS, system) == 128  # a hit after it, every block
        assert store.get(NS, system[-1:]) == [bytearray(payload(127))]
        assert stats.namespaces[NS.digest[:16].hex()].pinned_blocks == 128
        assert_clean(store)


def test_unpin_makes_the_chain_evictable_again(tmp_path, engine) -> None:
    with ucm_db.open(tmp_path / "s", codec="none", capacity_bytes=CAPACITY, engine=engine) as store:
        system = put_tokens(store, NS, SYSTEM)
        store.pin(NS, system)
        workload(store, 2 * CAPACITY)
        report = store.unpin(NS, system)
        assert report.chains == (0,) and report.changed_blocks == 128 and report.namespace_bytes == 0
        assert store.stats().pinned_bytes == 0
        workload(store, 3 * CAPACITY, base=5 * 10**6, shared=False)  # the system prompt unused: LRU takes it
        assert store.lookup(NS, system) == 0
        assert store.unpin(NS, system).changed_blocks == 0  # nothing left to unpin: a no-op
        assert_clean(store)


def test_pins_survive_reopen_and_compact(tmp_path) -> None:
    path = tmp_path / "s"
    with ucm_db.open(path, codec="none", capacity_bytes=CAPACITY) as store:
        system = put_tokens(store, NS, SYSTEM)
        store.pin(NS, system)
        workload(store, CAPACITY // 2)
        pinned = store.stats().pinned_bytes
    with ucm_db.open(path) as store:
        assert store.stats().pinned_bytes == pinned
        workload(store, 3 * CAPACITY, base=7 * 10**6)
        assert store.lookup(NS, system) == 128
    report = maintenance.compact(path, target_bytes=0)
    assert report["rewrite"] == "rewritten" and report["index_problems"] == []
    assert report["pinned_bytes_after"] == pinned == report["stored_bytes_after"]  # everything else went
    assert report["blocks_after"] == 128
    assert maintenance.verify(path).problems is False
    with ucm_db.open(path) as store:
        assert store.lookup(NS, system) == 128 and store.stats().pinned_bytes == pinned
        assert store.unpin(NS, system).changed_blocks == 128
    maintenance.compact(path, target_bytes=0)
    with ucm_db.open(path) as store:
        assert store.lookup(NS, system) == 0


def test_a_pin_over_max_pinned_bytes_is_refused_and_pins_nothing(tmp_path) -> None:
    with ucm_db.open(tmp_path / "s", codec="none", capacity_bytes=CAPACITY, max_pinned_bytes=600_000) as store:
        system = put_tokens(store, NS, SYSTEM)
        assert store.pin(NS, system).store_bytes <= 600_000
        more = put_tokens(store, NS, list(range(5000, 5000 + 64 * 16)))
        with pytest.raises(StoreFullError, match="max_pinned_bytes=600000") as caught:
            store.pin(NS, [system, more])
        assert "max_pinned_bytes" in caught.value.hint
        stats = store.stats()
        assert stats.pinned_bytes < 600_000 and stats.max_pinned_bytes == 600_000
        assert store.pin(NS, system).changed_blocks == 0  # pinning what is pinned adds nothing: never refused
        assert_clean(store)
    with ucm_db.open(tmp_path / "s", max_pinned_bytes=0) as store:
        with pytest.raises(StoreFullError, match="max_pinned_bytes=0"):
            store.pin(NS, more)
    with ucm_db.open(tmp_path / "s") as store:
        assert store.stats().max_pinned_bytes == CAPACITY // 2  # the default: half the capacity
        assert store.pin(NS, more).changed_blocks == 64


def test_a_put_that_needs_pinned_room_raises_store_full(tmp_path) -> None:
    with ucm_db.open(tmp_path / "s", codec="none", capacity_bytes=1 << 20, max_pinned_bytes=1 << 20) as store:
        chain = put_tokens(store, NS, list(range(16 * 200)))  # 200 blocks, ~80% of the capacity
        store.pin(NS, chain)
        keys = NS.block_keys(list(range(10**6, 10**6 + 16 * 60)))
        with pytest.raises(StoreFullError, match="bytes are pinned") as caught:
            store.put(NS, keys, [payload(i) for i in range(60)])
        assert "unpin" in caught.value.hint
        assert store.lookup(NS, keys) == 0 and store.lookup(NS, chain) == 200
        store.put(NS, keys[:30], [payload(i) for i in range(30)])  # what fits beside the pins still goes in
        assert_clean(store)


def test_a_block_stays_pinned_while_another_chain_s_pin_holds_it(tmp_path) -> None:
    with ucm_db.open(tmp_path / "s", codec="none", capacity_bytes=CAPACITY) as store:
        a = put_tokens(store, NS, SYSTEM + list(range(9000, 9000 + 64)))  # 132 blocks
        b = put_tokens(store, NS, SYSTEM + list(range(8000, 8000 + 32)))  # 130 blocks, sharing 128
        first = store.pin(NS, [a, b])
        assert first.chains == (132, 130) and first.namespace_blocks == 134
        assert store.pin(NS, a[:100]).changed_blocks == 0  # inside a pinned chain: nothing new
        released = store.unpin(NS, a)
        assert released.chains == (128,)  # b's pin holds the shared system prompt
        assert released.changed_blocks == 4 and released.namespace_blocks == 130
        assert_clean(store)
        assert store.unpin(NS, b).namespace_blocks == 100  # a[:100] is a chain pinned on its own: its pin stays
        assert store.unpin(NS, a[:100]).namespace_blocks == 0
        assert_clean(store)


def test_pin_covers_what_is_stored_now_and_only_in_its_namespace(tmp_path) -> None:
    with ucm_db.open(tmp_path / "s", codec="none", capacity_bytes=CAPACITY) as store:
        keys = NS.block_keys(list(range(16 * 10)))
        store.put(NS, keys[:6], [payload(i) for i in range(6)])
        assert store.pin(NS, keys).chains == (6,)
        store.put(NS, keys[6:], [payload(i) for i in range(6, 10)])
        assert store.stats().pinned_bytes == sum(m.stored_bytes for m in store._tier.metas(keys[:6]))
        assert store.pin(OTHER, keys).chains == (0,)  # keys of another namespace: nothing
        assert store.pin(NS, []).chains == (0,)
        assert_clean(store)


def test_delete_and_quarantine_take_pins_with_the_blocks(tmp_path, engine) -> None:
    with ucm_db.open(tmp_path / "s", codec="none", capacity_bytes=CAPACITY, engine=engine) as store:
        keys = put_tokens(store, NS, list(range(16 * 20)))
        other = put_tokens(store, NS, list(range(16 * 10)) + list(range(7000, 7000 + 16 * 5)))  # shares 10 blocks
        store.pin(NS, [keys, other])
        assert store.delete(NS, keys[12:]) == 8  # the pin at keys[-1] goes with its block
        assert store.stats().pinned_bytes == sum(m.stored_bytes for m in store._tier.metas([*keys[:10], *other[10:]]))
        assert_clean(store)
        store._tier.quarantine(other[10], "test", lambda _head, _body: True)  # other's pin went with its tail
        assert store.stats().pinned_bytes == 0
        assert_clean(store)
        workload(store, 2 * CAPACITY, shared=False)
        assert store.lookup(NS, keys) == 0


def test_invalidating_a_namespace_releases_its_pins(tmp_path) -> None:
    path = tmp_path / "s"
    with ucm_db.open(path, codec="none", capacity_bytes=CAPACITY) as store:
        system = put_tokens(store, NS, SYSTEM)
        kept = put_tokens(store, OTHER, SYSTEM[:160])
        store.pin(NS, system)
        store.pin(OTHER, kept)
    assert [row["model"] for row in maintenance.invalidate(path, ("pinning",))] == ["pinning"]
    with ucm_db.open(path) as store:
        stats = store.stats()
        assert stats.namespaces[NS.digest[:16].hex()].pinned_bytes == 0  # stale is stale
        assert stats.pinned_bytes == stats.namespaces[OTHER.digest[:16].hex()].pinned_bytes > 0
        workload(store, 3 * CAPACITY, shared=False)
        assert store._tier.count_prefix(system) == 0  # the old epoch's blocks aged out
        assert store.lookup(OTHER, kept) == 10
        assert_clean(store)


def test_damaged_pin_records_are_found_and_rebuilt_by_verify_fix(tmp_path) -> None:
    path = tmp_path / "s"
    with ucm_db.open(path, codec="none", capacity_bytes=CAPACITY) as store:
        keys = put_tokens(store, NS, list(range(16 * 8)))
        store.pin(NS, keys)
        pinned = store.stats().pinned_bytes
        store._engine.write(lambda txn: txn.delete("info", PIN_PREFIX + keys[3]))  # an ancestor's record lost
    report = maintenance.verify(path)
    assert any(p.startswith("info record 'pin/") for p in report.index_problems)
    fixed = maintenance.verify(path, fix=True)
    assert fixed.totals_recomputed
    assert maintenance.verify(path).index_problems == []
    with ucm_db.open(path) as store:
        assert store.stats().pinned_bytes == pinned


def test_a_read_only_store_refuses_pins(tmp_path) -> None:
    with ucm_db.open(tmp_path / "s", codec="none") as store:
        keys = put_tokens(store, NS, list(range(64)))
    with ucm_db.open(tmp_path / "s", read_only=True) as store:
        with pytest.raises(TierError, match="read-only"):
            store.pin(NS, keys)
        with pytest.raises(TierError, match="read-only"):
            store.unpin(NS, keys)


def test_max_pinned_bytes_is_checked_like_every_option() -> None:
    from ucm_db import ConfigError, StoreConfig

    with pytest.raises(ConfigError, match="max_pinned_bytes"):
        StoreConfig(max_pinned_bytes=-1)
    with pytest.raises(ConfigError, match="max_pinned_bytes"):
        StoreConfig(max_pinned_bytes="1GiB")  # type: ignore[arg-type]
    assert StoreConfig(capacity_bytes=1 << 30, max_pinned_bytes=1 << 40).pinned_limit_bytes == 1 << 30


def test_a_damaged_pinned_counter_is_recounted_by_the_next_change(tmp_path) -> None:
    from ucm_db.index.accounting import PIN_COUNTS_PREFIX

    with ucm_db.open(tmp_path / "s", codec="none", capacity_bytes=CAPACITY) as store:
        keys = put_tokens(store, NS, list(range(16 * 12)))
        store.pin(NS, [keys, keys[:8]])  # a second pin at keys[7]
        store._engine.write(lambda txn: txn.put("info", PIN_COUNTS_PREFIX + NS.digest[:16], bytes(16)))  # checksum fails
        assert any("pincount" in p for p in store._tier.check())
        assert store.stats().namespaces[NS.digest[:16].hex()].pinned_blocks == 12  # read: recounted
        store.delete(NS, keys[8:])  # 4 pinned blocks go, the counter recounted once; keys[7]'s pin holds the rest
        assert store.stats().namespaces[NS.digest[:16].hex()].pinned_blocks == 8
        assert_clean(store)
