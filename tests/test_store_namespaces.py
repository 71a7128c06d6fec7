"""Namespaces never mix through the block index (issue 26, item 3).

The index is keyed by the block key alone, so keys built for namespace NS
but passed with NS2 used to slip through the parent and presence checks:
``put(NS2, keys[2:4])`` was accepted on NS's ``keys[1]``, after which
``lookup(NS2)`` claimed 4 blocks, ``get(NS2)`` returned two misses then two
hits, and ``delete(NS, keys[1:2])`` removed NS2's blocks. A put whose key or
parent is stored under another namespace is now refused, naming both; the
scenarios below are the issue's, each step commented.
"""

from __future__ import annotations

import pytest

import ucm_db
from ucm_db import ConfigError, Namespace

NS = Namespace(model="ns-guard", kv_dtype="bfloat16", block_size=4)
NS2 = Namespace(model="ns-guard", kv_dtype="bfloat16", block_size=4, tp_rank=1, tp_size=2)
KEYS = NS.block_keys(list(range(16)))  # 4 blocks built for NS
PAYLOADS = [bytes([i + 1]) * 512 for i in range(4)]


@pytest.fixture(params=[("lmdb", "zstd"), ("lmdb", "none"), ("rocksdb", "zstd"), ("rocksdb", "none")],
                ids=lambda p: "-".join(p))
def store(request, tmp_path):
    # zstd reads presence before encoding; codec none finds it inside the
    # write transaction (store/writes.py _put_new): both refuse alike.
    engine, codec = request.param
    with ucm_db.open(tmp_path / "s", engine=engine, codec=codec) as opened:
        yield opened


def assert_names_both(error: ConfigError) -> None:
    text = str(error)
    assert NS.digest[:16].hex() in text and NS2.digest[:16].hex() in text, text
    assert "tp_rank" in text, "the message says how the namespaces differ"
    assert "another namespace" in error.hint


def test_continuing_another_namespaces_chain_is_refused(store) -> None:
    # NS stores the first two blocks of its chain.
    store.put(NS, KEYS[:2], PAYLOADS[:2])
    # NS2 tries to continue that chain: its parent keys[1] is NS's block.
    with pytest.raises(ConfigError) as raised:
        store.put(NS2, KEYS[2:4], PAYLOADS[2:4])
    assert_names_both(raised.value)
    # Nothing of it was stored: NS2 sees no block, NS exactly its two.
    assert store.lookup(NS2, KEYS) == 0
    assert store.get(NS2, KEYS) == [None] * 4
    assert store.lookup(NS, KEYS) == 2
    assert store.stats().blocks == 2 and store._tier.check() == []


def test_put_of_a_key_stored_under_another_namespace_is_refused(store) -> None:
    store.put(NS, KEYS[:1], PAYLOADS[:1])
    # Before: already_present=1 while lookup(NS2) said 0.
    with pytest.raises(ConfigError) as raised:
        store.put(NS2, KEYS[:1], PAYLOADS[:1])
    assert_names_both(raised.value)
    assert store.lookup(NS2, KEYS[:1]) == 0
    # Mixed with new keys in one batch: refused as a whole.
    with pytest.raises(ConfigError):
        store.put(NS2, KEYS[:3], PAYLOADS[:3])
    with pytest.raises(ConfigError):
        store.put_segments(NS2, [(KEYS[:1], PAYLOADS[:1]), (KEYS[1:3], PAYLOADS[1:3])])
    assert store.lookup(NS, KEYS) == 1 and store.lookup(NS2, KEYS) == 0 and store.stats().blocks == 1


def test_a_delete_never_crosses_namespaces(store) -> None:
    keys2 = NS2.block_keys(list(range(16)))  # NS2's own chain of the same tokens
    store.put(NS, KEYS, PAYLOADS)
    store.put(NS2, keys2, PAYLOADS)
    with pytest.raises(ConfigError):
        store.put(NS2, KEYS[2:4], PAYLOADS[2:4])
    # A delete under NS removes NS's block and its (NS) descendants only.
    assert store.delete(NS, KEYS[1:2]) == 3
    assert store.lookup(NS, KEYS) == 1 and store.lookup(NS2, keys2) == 4
    assert store.get(NS2, keys2) == PAYLOADS
    # NS2 deleting NS's keys removes nothing of them (reported as 0 removed).
    assert store.delete(NS2, KEYS) == 0
    assert store.get(NS, KEYS[:1]) == PAYLOADS[:1]
    # ... and NS deleting NS2's keys neither.
    assert store.delete(NS, keys2) == 0
    assert store.lookup(NS2, keys2) == 4 and store._tier.check() == []


def test_a_delete_refuses_a_chain_that_spans_namespaces_from_older_code(store) -> None:
    """A store written before puts were guarded can hold NS2 blocks chained
    under NS's: planted here by rewriting the namespace id in the block
    metadata of keys[2:4] (the state the old put left), counters recounted.
    NS2's lookup claims none of the chain (keys[0] is NS's); deleting NS's
    keys[1] would cascade into NS2's blocks: it is refused and nothing is
    deleted."""
    from ucm_db.index.entries import BlockMeta

    store.put(NS, KEYS, PAYLOADS)

    def plant(txn) -> None:
        for key in KEYS[2:4]:
            meta = BlockMeta.unpack(txn.get("meta", key))
            meta.namespace_id = NS2.digest[:16]
            txn.put("meta", key, meta.pack())
    store._tier.engine.write(plant)
    store._tier.recompute_totals()
    # Reads never count another namespace's block, even in such a store.
    assert store.lookup(NS2, KEYS) == 0 and store.lookup(NS, KEYS) == 2
    assert store.get(NS2, KEYS) == [None, None, *PAYLOADS[2:4]]
    with pytest.raises(ConfigError) as raised:
        store.delete(NS, KEYS[1:2])
    assert NS2.digest[:16].hex() in str(raised.value) and "nothing was deleted" in str(raised.value)
    assert store.get(NS, KEYS[:2]) == PAYLOADS[:2] and store.get(NS2, KEYS[2:4]) == PAYLOADS[2:4]
    # NS2's own blocks (the tail) can go, and then NS's delete proceeds.
    assert store.delete(NS2, KEYS[2:3]) == 2
    assert store.delete(NS, KEYS[1:2]) == 1
    assert store.stats().blocks == 1 and store._tier.check() == []
