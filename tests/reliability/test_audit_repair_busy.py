"""`verify --fix` and `compact` on a damaged store that live writers use
(audit of the repairs beside other processes).

* A block quarantined for its metadata (its parent's record lost) was
  quarantined whatever happened between the check and the repair: a live
  writer that stored the missing parent again (what vLLM does on the next
  request for that prefix) made the block intact and reachable, and the
  repair still took it and its descendants. The writer here is a real
  process, run between the check and the repair
  (:func:`ucm_db.maintenance.verify` then :func:`ucm_db.maintenance.repair`,
  the two halves ``verify --fix`` runs), so the interleaving is exact.
* Re-adding lost LRU entries and child links ran as one write transaction
  over every block: on a million blocks it held every live writer up for
  about ten seconds (2 s measured on 200k). It now runs one partition of
  the ``meta`` table at a time. What is measured is the largest number of
  entries one write transaction of the repair puts (through a wrapper
  around the real engine that counts them), not a time.

The lost records are written through the engine's raw tables (a precise
logical damage: the record of one block gone).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

import ucm_db
from ucm_db.engines.base import Engine, T, Txn
from ucm_db.index.entries import BlockMeta, lru_key
from ucm_db.maintenance import compaction, repair, verification, verify
from ucm_db.migrations.access import open_engine

from .harness import NS, chain_tokens, payload_for

ROOT = Path(__file__).resolve().parents[2]


def edit(path: Path, change: Callable[[Txn], object]) -> None:
    engine = open_engine(path)
    try:
        engine.write(change)
    finally:
        engine.close()


def keys_of(label: str, blocks: int) -> list[bytes]:
    return NS.block_keys(chain_tokens(label, blocks))


def put_in_another_process(path: Path, label: str, blocks: int) -> None:
    """A live writer: another process stores the chain ``label`` (whole)."""
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        import ucm_db
        from tests.reliability.harness import NS, chain_tokens, payload_for
        keys = NS.block_keys(chain_tokens({label!r}, {blocks}))
        with ucm_db.open({str(path)!r}) as store:
            store.put(NS, keys, [payload_for(k, 3000) for k in keys])
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr


@pytest.mark.multiprocess
def test_a_block_whose_lost_parent_a_writer_stored_again_is_kept(tmp_path: Path) -> None:
    path = tmp_path / "s"
    keys = keys_of("busy-parent", 6)
    with ucm_db.open(path, capacity_bytes=1 << 30) as store:
        store.put(NS, keys, [payload_for(k, 3000) for k in keys])
    edit(path, lambda txn: [txn.delete(table, keys[2]) for table in ("meta", "blocks", "heads")])

    report = verify(path, isolated=True)
    assert report.corrupt.get(keys[3]) == verification.PARENT_MISSING
    put_in_another_process(path, "busy-parent", 6)  # the parent is back: keys[3:] are reachable and intact
    repair(path, report)

    assert report.quarantined_blocks == 0
    assert not verify(path).problems
    with ucm_db.open(path) as store:
        assert store.lookup(NS, keys, remote=False) == 6
        assert store.get(NS, keys) == [payload_for(k, 3000) for k in keys]


class CountingEngine:
    """Delegates to a real engine; records the entries each write
    transaction puts (the size of what holds the writer lock)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self.puts_per_write: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def write(self, fn: Callable[[Txn], T]) -> T:
        def counted(txn: Txn) -> T:
            puts = 0
            real_put = txn.put

            def put(table: str, key: bytes, value: Any) -> None:
                nonlocal puts
                puts += 1
                real_put(table, key, value)
            txn.put = put  # type: ignore[method-assign]
            try:
                return fn(txn)
            finally:
                self.puts_per_write.append(puts)
        return self._engine.write(counted)


@contextmanager
def counted_engine(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[CountingEngine]]:
    opened: list[CountingEngine] = []
    real_open = compaction.open_engine

    def open_counting(*args: Any, **kwargs: Any) -> CountingEngine:
        engine = CountingEngine(real_open(*args, **kwargs))
        opened.append(engine)
        return engine
    monkeypatch.setattr(compaction, "open_engine", open_counting)
    yield opened


def test_compact_restores_lost_lru_entries_in_bounded_transactions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "s"
    chunk = 64
    with ucm_db.open(path, capacity_bytes=1 << 30, codec="none") as store:
        for c in range(100):
            keys = keys_of(f"busy-lru-{c}", 8)
            store.put(NS, keys, [b"x" * 64] * 8)

    def drop_lru(txn: Txn) -> None:
        for key, data in list(txn.scan("meta")):
            meta = BlockMeta.unpack(data)
            txn.delete("lru", lru_key(meta.access_ns, meta.depth, bytes(key)))
    edit(path, drop_lru)

    monkeypatch.setattr(verification, "MAINTENANCE_CHUNK_KEYS", chunk, raising=False)  # (absent before the fix)
    with counted_engine(monkeypatch) as opened:
        report = compaction.compact(path)
    assert report["links_restored"]["lru"] == 800 and report["index_problems"] == [], report
    largest = max(opened[0].puts_per_write)
    assert largest <= 2 * chunk, f"one write transaction put {largest} entries (the repair of {800} blocks in one)"
    assert not verify(path).problems
