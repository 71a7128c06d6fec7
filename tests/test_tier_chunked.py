"""Bounded maintenance over large tables (issue 13, scale): prefix partitions,
random key probes, chunked orphan removal and ``verify --sample`` without
listing the store, on every local engine.

Bounds are asserted by counting what the engine is asked to do (keys a
transaction scans, keys a sample reads), never by timing.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import ucm_db
from ucm_db.keys import Namespace
from ucm_db.store.view import open_view
from ucm_db.index import partitions as chunked
from ucm_db.engines.base import Engine
from ucm_db.index.entries import lru_key
from ucm_db.index.local import BlockEntry, LocalTier
from ucm_db.maintenance.verification import verify_view
from tests.test_tier_conformance import ENGINE_FACTORIES

NS_ID = b"n" * 16


class CountingEngine(Engine):
    """Delegates to an engine and counts, per transaction, the keys its
    scans yielded (to assert how much one transaction touched)."""

    def __init__(self, inner: Engine) -> None:
        self.inner = inner
        self.name = inner.name
        self.write_scans: list[int] = []
        self.read_scans: list[int] = []

    def _counted(self, fn: Callable[[Any], Any], log: list[int]) -> Callable[[Any], Any]:
        def run(txn: Any) -> Any:
            seen = [0]

            class Txn:
                def get(self, table: str, key: bytes) -> Any:
                    return txn.get(table, key)

                def put(self, table: str, key: bytes, value: Any) -> None:
                    txn.put(table, key, value)

                def delete(self, table: str, key: bytes) -> bool:
                    return txn.delete(table, key)  # type: ignore[no-any-return]

                def scan(self, table: str, prefix: bytes = b"") -> Iterator[tuple[bytes, Any]]:
                    for item in txn.scan(table, prefix):
                        seen[0] += 1
                        yield item

            try:
                return fn(Txn())
            finally:
                log.append(seen[0])
        return run

    def read(self, fn: Callable[[Any], Any]) -> Any:
        return self.inner.read(self._counted(fn, self.read_scans))

    def write(self, fn: Callable[[Any], Any]) -> Any:
        return self.inner.write(self._counted(fn, self.write_scans))

    def sync(self) -> None:
        self.inner.sync()

    def close(self) -> None:
        self.inner.close()


@pytest.fixture(params=sorted(ENGINE_FACTORIES))
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[CountingEngine]:
    if request.param == "rocksdb":
        pytest.importorskip("rocksdict")
    eng = CountingEngine(ENGINE_FACTORIES[request.param](tmp_path))
    yield eng
    eng.close()


def fill(engine: Engine, table: str, keys: list[bytes]) -> None:
    for start in range(0, len(keys), 500):
        engine.write(lambda txn, s=start: [txn.put(table, k, b"v") for k in keys[s:s + 500]])


def random_keys(n: int, length: int = 32, seed: int = 1) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(length) for _ in range(n)]


# -- partitions ------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["hashes", "lru"])
def test_partitions_cover_every_key_once_within_the_limit(engine: CountingEngine, kind: str) -> None:
    if kind == "hashes":
        keys = random_keys(1000)
    else:  # LRU keys: a shared timestamp prefix, as one put writes them
        keys = [lru_key(1_750_000_000_000_000_000 + i // 300, i % 300, k) for i, k in enumerate(random_keys(1000))]
    fill(engine, "lru", keys)
    prefixes = list(chunked.partitions(engine, "lru", 40))
    assert prefixes == sorted(prefixes)
    covered: list[bytes] = []
    for prefix in prefixes:
        under = engine.read(lambda txn, p=prefix: [bytes(k) for k, _ in txn.scan("lru", p)])
        assert 0 < len(under) <= 40
        covered += under
    assert covered == sorted(keys)
    assert max(engine.read_scans) <= 256 + 41  # a count reads limit + 1 keys; a split probes 256 prefixes


def test_partitions_of_a_small_or_empty_table(engine: CountingEngine) -> None:
    assert list(chunked.partitions(engine, "lru", 10)) == []
    fill(engine, "lru", random_keys(7))
    assert list(chunked.partitions(engine, "lru", 10)) == [b""]


# -- sampling --------------------------------------------------------------------
def test_probe_length_gives_about_one_key_per_prefix() -> None:
    assert [chunked.probe_bytes(n) for n in (0, 255, 256, 65_535, 65_536, 1_000_000)] == [0, 0, 1, 1, 2, 2]


def test_sample_reads_o_of_the_sample_not_of_the_table(engine: CountingEngine) -> None:
    keys = random_keys(6000)
    fill(engine, "meta", keys)
    engine.read_scans.clear()
    sample = chunked.sample_keys(engine, "meta", 40, total_keys=len(keys), seed=3)
    assert len(sample) == 40 and sample == sorted(set(sample)) and set(sample) <= set(keys)
    # 6000 keys probed with 1-byte prefixes: about 23 keys read per probe.
    assert sum(engine.read_scans) < 40 * 2 * 6000 / 256 * 2
    assert chunked.sample_keys(engine, "meta", 40, total_keys=len(keys), seed=3) == sample
    assert chunked.sample_keys(engine, "meta", 40, total_keys=len(keys), seed=4) != sample


def test_sample_of_a_small_table_or_a_wrong_count_stays_bounded(engine: CountingEngine) -> None:
    keys = random_keys(30)
    fill(engine, "meta", keys)
    assert chunked.sample_keys(engine, "meta", 100, total_keys=30) == sorted(keys)
    assert len(chunked.sample_keys(engine, "meta", 10, total_keys=30)) == 10
    assert chunked.sample_keys(engine, "meta", 0, total_keys=30) == []
    # Totals that claim far more keys than there are: fewer keys, not a spin.
    engine.read_scans.clear()
    few = chunked.sample_keys(engine, "meta", 25, total_keys=10_000_000, seed=1)
    assert set(few) <= set(keys) and len(few) < 25
    assert len(engine.read_scans) <= (chunked.PROBES_PER_KEY * 25 + 256) // chunked.PROBES_PER_TXN + 2


def test_sample_is_spread_over_the_key_space(engine: CountingEngine) -> None:
    keys = random_keys(4000)
    fill(engine, "meta", keys)
    sample = chunked.sample_keys(engine, "meta", 400, total_keys=len(keys), seed=0)
    halves = sum(1 for k in sample if k[0] < 128)
    assert 150 < halves < 250  # a fair coin over 400 draws


# -- the tier's maintenance primitives ----------------------------------------------
def chain_entries(n: int, seed: int) -> list[BlockEntry]:
    keys = random_keys(n, seed=seed)
    return [BlockEntry(k, keys[i - 1] if i else None, b"h", b"body", 8, NS_ID) for i, k in enumerate(keys)]


def test_drop_orphans_in_bounded_transactions(engine: CountingEngine) -> None:
    tier = LocalTier(engine, capacity_bytes=1 << 30)
    for seed in range(3):
        tier.put_blocks(chain_entries(100, seed))
    ghosts = random_keys(20, seed=99)
    live = next(iter(tier.iterate()))

    def orphan(txn: Any) -> None:
        for g in ghosts:
            txn.put("blocks", g, b"x")
            txn.put("heads", g, b"x")
            txn.put("uploads", g, b"x")
            txn.put("children", live + g, b"")
            txn.put("lru", lru_key(5, 1, g), b"")
    engine.write(orphan)
    assert tier.check()  # the orphans are seen
    engine.write_scans.clear()
    dropped = tier.drop_orphans(chunk_keys=24)
    assert dropped == {"blocks": 20, "heads": 20, "uploads": 20, "children": 20, "lru": 20}
    assert tier.check() == []
    assert tier.totals().blocks == 300
    assert len(engine.write_scans) > 4 * 320 // 24  # many short transactions, not one
    assert max(engine.write_scans) <= 24  # one partition each (no keys written meanwhile)
    assert tier.drop_orphans(chunk_keys=24) == dict.fromkeys(dropped, 0)


def test_drop_quarantine_records_in_chunks(engine: CountingEngine) -> None:
    tier = LocalTier(engine, capacity_bytes=1 << 30)
    fill(engine, "quarantine", random_keys(300))
    assert tier.drop_quarantine_records(chunk_keys=32) == 300
    assert engine.read(lambda txn: list(txn.scan("quarantine"))) == []


# -- verify --sample on a real store ---------------------------------------------
def test_verify_sample_does_not_list_the_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ns = Namespace(model="test/chunked", kv_dtype="bfloat16", block_size=4)
    path = tmp_path / "s"
    with ucm_db.open(path, codec="none") as store:
        for seed in range(4):
            keys = ns.block_keys(list(range(seed * 1000, seed * 1000 + 4 * 300)))
            store.put(ns, keys, [os.urandom(64) for _ in keys])

    def no_listing(_self: LocalTier) -> Iterator[bytes]:
        raise AssertionError("verify --sample listed every key")

    with open_view(path) as view:
        monkeypatch.setattr(LocalTier, "iterate", no_listing)
        report = verify_view(view, sample=50, seed=2)
    assert report.checked == 50 and not report.problems
    monkeypatch.undo()
    with open_view(path) as view:
        assert verify_view(view).checked == 1200
