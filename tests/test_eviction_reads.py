"""What a put's eviction reads and writes per victim (ucm_db/index/eviction.py,
issue 50 item 3: the in-engine writer's CPU per saved unit): a tail found
by the LRU scan is removed by its own entries alone, with none of the
reads that can only find nothing (its child links, its pin record, read
twice; a second read of its record), and a store without pins, queued
uploads or evented blocks pays no lookup of them per victim
(tests/test_eviction_tails.py: the index ends the same either way).

Real engines (LMDB and the in-memory reference); the one wrapper counts a
transaction's calls and forwards each to the engine's own transaction.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ucm_db.engines.base import Engine, Txn
from ucm_db.engines.lmdb import LmdbEngine
from ucm_db.engines.memory import MemoryEngine
from ucm_db.index.damage import Damage
from ucm_db.index.entries import BlockEntry, TierLimits
from ucm_db.index.upkeep import IndexUpkeep
from ucm_db.index.writes import IndexWriter

NS_ID = b"e" * 16
BODY_BYTES = 1000
ENGINES: dict[str, Callable[[Path], Engine]] = {
    "memory": lambda _path: MemoryEngine(),
    "lmdb": lambda path: LmdbEngine(path / "lmdb", map_size_bytes=64 << 20, sync=False),
}


class CountingTxn:
    """A transaction that counts ``(method, table, what)`` and forwards
    every call (``what``: the first 4 bytes of an ``info`` key, else "")."""

    def __init__(self, txn: Txn, counts: collections.Counter[tuple[str, str, bytes]]) -> None:
        self._txn, self._counts = txn, counts

    def _count(self, method: str, table: str, key: bytes) -> None:
        self._counts[(method, table, bytes(key[:4]) if table == "info" else b"")] += 1

    def get(self, table: str, key: bytes) -> Any:
        self._count("get", table, key)
        return self._txn.get(table, key)

    def get_many(self, table: str, keys: Any) -> Any:
        return [self.get(table, key) for key in keys]

    def put(self, table: str, key: bytes, value: Any) -> None:
        self._count("put", table, key)
        self._txn.put(table, key, value)

    def delete(self, table: str, key: bytes) -> bool:
        self._count("delete", table, key)
        return self._txn.delete(table, key)

    def scan(self, table: str, prefix: bytes = b"") -> Iterator[tuple[bytes, Any]]:
        self._count("scan", table, prefix)
        return self._txn.scan(table, prefix)


class CountingEngine:
    """``engine`` whose write transactions are :class:`CountingTxn` s (reads untouched)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self.counts: collections.Counter[tuple[str, str, bytes]] = collections.Counter()

    def write(self, fn: Callable[[Any], Any]) -> Any:
        return self._engine.write(lambda txn: fn(CountingTxn(txn, self.counts)))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


@pytest.fixture(params=sorted(ENGINES))
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Engine]:
    eng = ENGINES[request.param](tmp_path)
    yield eng
    eng.close()


def _key(chain: int, i: int) -> bytes:
    return (b"k%03d-%05d" % (chain, i)).ljust(32, b".")


def _entry(chain: int, i: int, event_fields: bytes | None = None) -> BlockEntry:
    return BlockEntry(_key(chain, i), _key(chain, i - 1) if i else None, b"hd", bytes([i % 251]) * BODY_BYTES, BODY_BYTES,
                      NS_ID, event_fields)


def _fill(writer: IndexWriter, chains: int, blocks: int, **options: Any) -> None:
    """``chains`` chains of ``blocks`` blocks, grown a block of each chain a put
    (as a server's requests): every block but a chain's newest has a child."""
    for i in range(blocks):
        writer.put_blocks([_entry(c, i) for c in range(chains)], **options)


def _writer(engine: Engine, capacity_bytes: int) -> IndexWriter:
    limits = TierLimits(capacity_bytes)
    return IndexWriter(engine, limits, Damage(engine, limits))  # type: ignore[arg-type]


def test_a_victim_costs_one_read_of_its_record_and_no_pin_upload_or_event_lookup(engine: Engine) -> None:
    counting = CountingEngine(engine)
    writer = _writer(counting, 24 * (BODY_BYTES + 2))  # type: ignore[arg-type]
    _fill(writer, chains=4, blocks=6)  # full: 24 blocks
    counting.counts.clear()
    scanned = writer.eviction_entries_scanned
    victims = 8
    result = writer.put_blocks([_entry(100 + c, 0) for c in range(victims)])  # 8 new roots: 8 tails go
    assert result.evicted == victims
    counts = counting.counts
    assert not [what for what in counts if what[1] == "info" and what[2] in (b"pin/", b"evf/") and what[0] == "get"]
    assert counts[("delete", "uploads", b"")] == 0
    # One scan of a block's child links per LRU entry the scan met: the victims' own (their tails'
    # check), none more to remove them.
    assert counts[("scan", "children", b"")] == writer.eviction_entries_scanned - scanned
    # A block's record is read once per new block (its presence), once per victim (none more to
    # remove it) and twice per block filed again (its child's, found live; its own, rewritten).
    refiled = counts[("put", "meta", b"")] - victims
    assert refiled > 0
    assert counts[("get", "meta", b"")] == victims + victims + 2 * refiled
    assert IndexUpkeep(engine).check() == []
