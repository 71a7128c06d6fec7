"""README: "a prefix lookup is a binary search (~13 reads for 8192 blocks)",
"O(log n) reads". Held on a real LMDB store by counting the index reads of
the lookup's own function in a real read transaction (the transaction is
wrapped only to count its ``get`` calls)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import ucm_db
from ucm_db.index.reads import count_in

CHAIN_BLOCKS = 8192


class _CountingTxn:
    """A read transaction whose ``get`` calls are counted."""

    def __init__(self, txn: Any) -> None:
        self._txn, self.gets = txn, 0

    def get(self, table: str, key: bytes) -> Any:
        self.gets += 1
        return self._txn.get(table, key)


def _reads(store: ucm_db.Store, keys: list[bytes], namespace_id: bytes) -> tuple[int, int]:
    def run(txn: Any) -> tuple[int, int]:
        counting = _CountingTxn(txn)
        return count_in(counting, keys, namespace_id), counting.gets  # type: ignore[arg-type]
    return store._tier.engine.read(run)  # type: ignore[no-any-return]


def test_a_lookup_of_8192_blocks_reads_the_index_about_log2_times(tmp_path: Path) -> None:
    ns = ucm_db.Namespace(model="lookup-reads", kv_dtype="bfloat16", block_size=1)
    keys = ns.block_keys(list(range(CHAIN_BLOCKS)))
    stored = 5000
    with ucm_db.open(tmp_path / "s", codec="none") as store:
        store.put(ns, keys[:stored], [b"kv"] * stored)
        assert store.lookup(ns, keys) == stored
        found, reads = _reads(store, keys, ns.id)
        assert found == stored and reads <= 2 + math.ceil(math.log2(CHAIN_BLOCKS))  # 15: "~13 reads"
        assert _reads(store, keys[:stored], ns.id) == (stored, 2)  # stored whole: its first and last key
        other = ucm_db.Namespace(model="other", kv_dtype="bfloat16", block_size=1).block_keys(list(range(64)))
        assert _reads(store, other, ns.id) == (0, 1)  # nothing stored: one read
