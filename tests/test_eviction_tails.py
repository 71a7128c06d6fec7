"""A put's eviction removes a tail the LRU scan found by the tail's own
entries alone (ucm_db/index/eviction.py, issue 50 item 3): victims, records,
counters and change feed end as the general removal leaves them, in a store
that holds queued uploads and evented blocks; a block filed again as used
is rewritten byte for byte as its record unpacked, made newer and packed.

Real engines (LMDB and the in-memory reference).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings, strategies as st

from ucm_db.engines.base import Engine, Txn
from ucm_db.index import eviction
from ucm_db.index.accounting import Totals
from ucm_db.index.damage import Damage
from ucm_db.index.entries import META, BlockMeta, DamagedMeta, refiled_record
from ucm_db.index.removal import remove_tree

from tests.test_eviction_reads import BODY_BYTES, ENGINES, NS_ID, _entry, _writer


def _index(engine: Engine) -> dict[str, Any]:
    """Everything of the index but times: each table's keys (the LRU entries
    by block), values where they hold no time, the counters."""
    def read(txn: Txn) -> dict[str, Any]:
        tables: dict[str, Any] = {}
        for table in ("blocks", "heads", "children", "uploads"):
            tables[table] = {bytes(k): bytes(v) for k, v in txn.scan(table)}
        tables["lru"] = sorted(bytes(k)[12:] for k, _ in txn.scan("lru"))
        metas = {bytes(k): BlockMeta.unpack(v) for k, v in txn.scan("meta")}
        tables["meta"] = {k: (m.parent, m.depth, m.raw_bytes, m.stored_bytes, m.hits) for k, m in metas.items()}
        tables["info"] = sorted(bytes(k) for k, _ in txn.scan("info") if not bytes(k).startswith((b"feed", b"sum:feed")))
        tables["feed"] = [bytes(v)[:1] + bytes(v)[17:49] for k, v in txn.scan("info", b"feed/")]  # kind and key, in order
        tables["totals"] = Totals.read(txn)
        return tables
    return engine.read(read)


def _workload(engine: Engine) -> tuple[list[list[bytes]], dict[str, Any]]:
    """Puts into a full store that holds queued uploads and evented blocks;
    returns each put's victims and the index at the end."""
    writer = _writer(engine, 20 * (BODY_BYTES + 2))
    for i in range(5):  # evented chains, queued for upload
        writer.put_blocks([_entry(c, i, event_fields=b"f%d" % c) for c in range(4)], enqueue_upload=True)
    seen: list[list[bytes]] = []
    real = Damage.write_evicting

    def recording(self: Damage, run: Callable[[Txn, list[bytes]], Any]) -> Any:
        victims: list[bytes] = []
        out = real(self, lambda txn, v: run(txn, victims))
        seen.append(victims)
        return out
    Damage.write_evicting = recording  # type: ignore[method-assign]
    try:
        for i in range(6):  # other chains: each put evicts
            writer.put_blocks([_entry(50 + c, i) for c in range(3)], enqueue_upload=i % 2 == 0)
    finally:
        Damage.write_evicting = real  # type: ignore[method-assign]
    return seen, _index(engine)


def test_the_tail_removal_leaves_the_index_the_general_removal_leaves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, make in ENGINES.items():
        fast_engine = make(tmp_path / f"fast-{name}")
        fast = _workload(fast_engine)
        fast_engine.close()
        with monkeypatch.context() as patched:
            patched.setattr(eviction, "remove_tail", lambda txn, changes, key, meta, *, feed_max_records, **_: remove_tree(
                txn, changes, key, feed_max_records=feed_max_records))
            general_engine = make(tmp_path / f"general-{name}")
            general = _workload(general_engine)
            general_engine.close()
        assert sum(map(len, fast[0])) >= 18, name  # the puts evicted (evented, queued blocks among them)
        assert fast == general, name


@settings(max_examples=200, deadline=None)
@given(depth=st.integers(0, 2**32 - 1), raw=st.integers(0, 2**32), stored=st.integers(0, 2**32), created=st.integers(0, 2**64 - 1),
       access=st.integers(0, 2**64 - 1), hits=st.integers(0, 2**32 - 1), now=st.integers(0, 2**64 - 1), parent=st.booleans())
def test_a_refiled_record_is_the_record_unpacked_made_newer_and_packed(
    depth: int, raw: int, stored: int, created: int, access: int, hits: int, now: int, parent: bool,
) -> None:
    meta = BlockMeta(NS_ID, b"p" * 32 if parent else None, depth, raw, stored, created, access, hits)
    record = meta.pack()
    refiled = refiled_record(memoryview(record), now)
    assert refiled is not None
    meta.access_ns = max(access, now)
    assert refiled == (NS_ID, depth, meta.access_ns, meta.pack())


@pytest.mark.parametrize("record", [b"", bytes(META.size - 1), bytes(META.size + 1),
                                    BlockMeta(NS_ID, None, 1, 2**40, 1, 0, 0, 0).pack(),
                                    BlockMeta(NS_ID, None, 1, 1, 2**40, 0, 0, 0).pack()])
def test_a_damaged_record_is_never_refiled(record: bytes) -> None:
    with pytest.raises(DamagedMeta):
        BlockMeta.unpack(record)
    assert refiled_record(record, 5) is None
