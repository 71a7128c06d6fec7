"""A lookup of a chain stored whole reads two index records, the last key's
and the first key's (the prefix invariant makes the last one enough; the
first guards the namespace); a chain stored in part is still counted exactly
by the binary search. Real LMDB and RocksDB stores; the engine's ``read`` is
wrapped only to count the records each lookup reads."""

from __future__ import annotations

import pytest

import ucm_db
from ucm_db import Namespace

NS = Namespace(model="lookup-reads", kv_dtype="bfloat16", block_size=4)
OTHER = Namespace(model="lookup-reads-other", kv_dtype="bfloat16", block_size=4)


class _CountingTxn:
    def __init__(self, txn, counts: list[int]) -> None:
        self._txn, self._counts = txn, counts

    def get(self, db, key):
        self._counts[0] += 1
        return self._txn.get(db, key)

    def __getattr__(self, name):
        return getattr(self._txn, name)


def count_reads(store) -> list[int]:
    counts = [0]
    engine = store._engine
    real = engine.read
    engine.read = lambda fn: real(lambda txn: fn(_CountingTxn(txn, counts)))
    return counts


@pytest.fixture(params=["lmdb", "rocksdb"])
def store(tmp_path, request):
    with ucm_db.open(tmp_path / "s", codec="none", engine=request.param) as s:
        yield s


@pytest.mark.parametrize("blocks", [1, 2, 65, 512])
def test_a_chain_stored_whole_is_counted_from_its_last_and_first_keys(store, blocks: int) -> None:
    keys = NS.block_keys(list(range(4 * blocks)))
    store.put(NS, keys, [bytes([i % 251]) * 32 for i in range(blocks)])
    reads = count_reads(store)
    assert store.lookup(NS, keys) == blocks
    assert reads[0] == min(blocks, 2)


@pytest.mark.parametrize("stored", [0, 1, 17, 64])
def test_a_chain_stored_in_part_is_counted_exactly(store, stored: int) -> None:
    keys = NS.block_keys(list(range(4 * 65)))
    if stored:
        store.put(NS, keys[:stored], [b"x" * 32] * stored)
    assert store.lookup(NS, keys) == stored
    assert store.lookup(NS, keys[: stored + 1]) == stored
    assert store.lookup(NS, keys[:stored]) == stored
    assert store.lookup(OTHER, OTHER.block_keys(list(range(4 * 65)))) == 0
