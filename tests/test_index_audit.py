"""The index check in sorted scans (``ucm_db.index.audit``) finds what
checking every block by key finds, on every engine, for each kind of damage;
and ``drop_orphans`` walks only the tables the audit suspects."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ucm_db.engines.base import Engine, Txn
from ucm_db.index.audit import audit
from ucm_db.index.entries import BlockMeta, lru_key
from ucm_db.index.local import BlockEntry, LocalTier
from tests.test_tier_conformance import ENGINE_FACTORIES

NS_ID = b"n" * 16


@pytest.fixture(params=sorted(ENGINE_FACTORIES))
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[LocalTier]:
    if request.param == "rocksdb":
        pytest.importorskip("rocksdict")
    engine = ENGINE_FACTORIES[request.param](tmp_path)
    tier = LocalTier(engine, capacity_bytes=1 << 30)
    rng = random.Random(5)
    for _ in range(4):
        keys = [rng.randbytes(32) for _ in range(40)]
        tier.put_blocks([BlockEntry(k, keys[i - 1] if i else None, b"hd", b"body" * (i + 1), 9, NS_ID)
                         for i, k in enumerate(keys)])
    yield tier
    engine.close()


def per_key_problems(txn: Txn) -> set[str]:
    """The check as it was: every block's entries looked up by key."""
    problems = set()
    for key, data in txn.scan("meta"):
        meta = BlockMeta.unpack(data)
        stored, head = txn.get("blocks", key), txn.get("heads", key)
        if stored is None or head is None:
            problems.add(f"block {key.hex()[:16]}: payload or head missing")
        elif meta.stored_bytes not in (len(stored), len(stored) + len(head)):
            problems.add(f"block {key.hex()[:16]}: payload of wrong size")
        if meta.parent is not None and txn.get("meta", meta.parent) is None:
            problems.add(f"block {key.hex()[:16]}: parent missing (prefix invariant broken)")
        elif meta.parent is not None and txn.get("children", meta.parent + key) is None:
            problems.add(f"block {key.hex()[:16]}: child link from its parent missing")
        if txn.get("lru", lru_key(meta.access_ns, meta.depth, key)) is None:
            problems.add(f"block {key.hex()[:16]}: no LRU entry")
    for table in ("blocks", "heads"):
        for key, _ in txn.scan(table):
            if txn.get("meta", key) is None:
                problems.add(f"{table} entry {key.hex()[:16]} has no metadata (orphan)")
    return problems


def nth_key(tier: LocalTier, table: str, n: int) -> bytes:
    return tier.engine.read(lambda txn: [bytes(k) for k, _ in txn.scan(table)][n])


def meta_of(tier: LocalTier, key: bytes) -> BlockMeta:
    return tier.engine.read(lambda txn: BlockMeta.unpack(txn.get("meta", key)))


DAMAGE: dict[str, Callable[[LocalTier], Callable[[Any], object]]] = {
    "none": lambda t: lambda txn: None,
    "payload missing": lambda t: (lambda k: lambda txn: txn.delete("blocks", k))(nth_key(t, "meta", 3)),
    "head missing": lambda t: (lambda k: lambda txn: txn.delete("heads", k))(nth_key(t, "meta", 7)),
    "wrong size": lambda t: (lambda k: lambda txn: txn.put("blocks", k, b"x"))(nth_key(t, "meta", 11)),
    "orphan payload": lambda t: lambda txn: (txn.put("blocks", b"\x01" * 32, b"x"), txn.put("heads", b"\xfe" * 32, b"h")),
    "parent missing": lambda t: (lambda k: lambda txn: txn.delete("meta", meta_of(t, k).parent))(
        next(k for k in [nth_key(t, "meta", i) for i in range(20)] if meta_of(t, k).parent is not None)),
    "parent missing, link gone too": lambda t: (lambda k: lambda txn: (
        txn.delete("meta", meta_of(t, k).parent), txn.delete("children", meta_of(t, k).parent + k)))(
        next(k for k in [nth_key(t, "meta", i) for i in range(20)] if meta_of(t, k).parent is not None)),
    "child link missing": lambda t: (lambda k: lambda txn: txn.delete("children", meta_of(t, k).parent + k))(
        next(k for k in [nth_key(t, "meta", i) for i in range(20)] if meta_of(t, k).parent is not None)),
    "lru entry missing": lambda t: (lambda k: lambda txn: txn.delete("lru", k))(nth_key(t, "lru", 5)),
    "stale lru entry": lambda t: lambda txn: txn.put("lru", lru_key(1, 1, b"\x02" * 32), b""),
    "stale child link": lambda t: (lambda k: lambda txn: txn.put("children", k + b"\x03" * 32, b""))(nth_key(t, "meta", 2)),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_audit_finds_what_a_per_key_check_finds(tier: LocalTier, damage: str) -> None:
    tier.engine.write(DAMAGE[damage](tier))
    expected = tier.engine.read(per_key_problems)
    found = tier.engine.read(audit)
    assert set(found.problems) == expected
    assert len(found.problems) == len(expected)
    # Stale LRU entries and child links are no problem for a check (eviction
    # skips them); drop_orphans removes them.
    assert (damage in ("none", "stale lru entry", "stale child link")) == (expected == set())
    check = tier.check()
    assert set(check) - expected <= {p for p in check if p.startswith(("totals ", "namespace counters "))}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_drop_orphans_after_damage_leaves_no_orphan(tier: LocalTier, damage: str) -> None:
    tier.engine.write(DAMAGE[damage](tier))
    tier.drop_orphans(chunk_keys=16)
    suspect = tier.engine.read(audit).suspect
    # What is left is what dropping entries cannot fix (a block missing a
    # payload, head, LRU entry or parent), never an orphaned entry.
    assert suspect - {"lru", "children"} == {"uploads"}
    assert not any("orphan" in p for p in tier.check())


def test_a_healthy_store_suspects_no_table_but_the_upload_queue(tier: LocalTier) -> None:
    assert tier.engine.read(audit).suspect == {"uploads"}
    assert tier.drop_orphans() == {"blocks": 0, "heads": 0, "uploads": 0, "children": 0, "lru": 0}
    assert tier.check() == []


def test_drop_orphans_and_check_audits_once_when_nothing_is_dropped(tier: LocalTier, monkeypatch: pytest.MonkeyPatch) -> None:
    from ucm_db.index import audit as index_audit

    calls: list[int] = []
    real = index_audit.audit

    def counting(txn: Txn) -> Any:
        calls.append(1)
        return real(txn)

    monkeypatch.setattr(index_audit, "audit", counting)
    assert tier.drop_orphans_and_check() == (dict.fromkeys(["blocks", "heads", "uploads", "children", "lru"], 0), [])
    assert len(calls) == 1
    tier.engine.write(DAMAGE["orphan payload"](tier))
    dropped, problems = tier.drop_orphans_and_check()
    assert (dropped["blocks"], dropped["heads"], problems) == (1, 1, [])  # the problems are those left after dropping
    assert len(calls) == 3
