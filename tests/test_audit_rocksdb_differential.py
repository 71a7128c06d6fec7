"""Differential audit of the RocksDB engine against LMDB: one randomised
sequence of public-API operations (chained puts, get, get_into with lists
and ScatterSlabs, lookup, lookup_many, touch, delete, pin/unpin,
bump_epoch, put_encoded, quarantine, flush, reopen, capacity pressure)
applied to an LMDB store and a RocksDB store opened with equal settings;
every observable result must be equal step by step: returned bytes and
flags, lookups, put results (evictions included: both engines keep the
same LRU order), pin reports, epochs, the counters of ``stats()``, the
change feed and the event inventory, and the index's own check.

The wall clock is the one thing faked (``time.time_ns``, the LRU clock):
the two stores run one after the other, so with the real clock a tie or a
30 s recency window could fall differently for each. Each step sets the
same fake time for both stores. A fixed seed list bounds the run."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ucm_db
from ucm_db import BlockEventFields, Namespace, ScatterSlabs, maintenance

NS = Namespace(model="audit-rocksdb-diff", kv_dtype="bfloat16", block_size=4)
OTHER = Namespace(model="audit-rocksdb-diff-other", kv_dtype="bfloat16", block_size=4)
#: Below and above RocksDB's blob threshold (4 KiB): index entries and blob files both take part.
SIZES = (3072, 49152)
SEEDS = (1, 2, 3, 4, 5, 6)
STEPS = 90


class Clock:
    """The fake ``time.time_ns`` both stores read (module docs)."""

    def __init__(self) -> None:
        self.now_ns = 1_900_000_000 * 10**9

    def __call__(self) -> int:
        return self.now_ns


def payload(key: bytes, size: int) -> bytes:
    rng = np.random.default_rng(int.from_bytes(key[:8], "little"))
    return rng.integers(0, 1 << 16, size // 2, dtype=np.uint16).tobytes()


class Pair:
    """An LMDB store and a RocksDB store driven alike."""

    def __init__(self, root: Path, clock: Clock, **options: Any) -> None:
        self.paths = {"lmdb": root / "lmdb-store", "rocksdb": root / "rocks-store"}
        self.options, self.clock = options, clock
        self.stores = {name: ucm_db.open(path, engine=name, **options) for name, path in self.paths.items()}
        #: Each feed starts at a random seq (docs/events.md): seqs are compared as offsets from it.
        self.feed_base = {name: store.feed_position() for name, store in self.stores.items()}

    def both(self, what: str, fn: Callable[[ucm_db.Store], Any]) -> Any:
        results = {}
        now = self.clock.now_ns
        for name, store in self.stores.items():
            self.clock.now_ns = now
            try:
                results[name] = ("ok", normalise(fn(store), self.feed_base[name]))
            except ucm_db.UcmDbError as exc:
                results[name] = ("raised", type(exc).__name__)
        assert results["lmdb"] == results["rocksdb"], f"{what}: lmdb {results['lmdb']!r} != rocksdb {results['rocksdb']!r}"
        return results["lmdb"]

    def reopen(self) -> None:
        for name in self.stores:
            self.stores[name].close()
            self.stores[name] = ucm_db.open(self.paths[name], engine=name, **self.options)

    def close(self) -> None:
        for store in self.stores.values():
            store.close()


def normalise(value: Any, base: int) -> Any:
    """Plain values, feed seqs made offsets from ``base``."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, (list, tuple)):
        return [normalise(v, base) for v in value]
    if isinstance(value, dict):
        return {k: normalise(v, base) for k, v in value.items()}
    if isinstance(value, Seq):
        return int(value) - base
    return value


class Seq(int):
    """A feed seq (made an offset by :func:`normalise`)."""


def observe(store: ucm_db.Store, feed_base: int) -> dict[str, Any]:
    """Everything engine-independent a caller can see of the whole store
    (its feed read from ``feed_base``, where it started)."""
    stats = store.stats().to_dict()
    for engine_specific in ("path", "engine", "file_bytes", "settings"):
        stats.pop(engine_specific, None)
    feed = store.changes_since(feed_base, 1 << 20)
    inventory = store.event_inventory()
    def rows(records: Any) -> list[Any]:
        return [(Seq(r.seq), r.kind, r.namespace_id, r.key, r.fields, r.depth) for r in records]
    return {"stats": stats, "feed": (rows(feed.records), Seq(feed.next_seq), feed.resync),
            "inventory": (sorted(rows(inventory.records), key=lambda r: (r[5], r[3])), Seq(inventory.next_seq)),
            "check": store._tier.check()}


class Workload:
    """Random operations over a small forest of chains (a few roots, each
    with branches), so prefixes are shared and eviction meets inner blocks."""

    def __init__(self, seed: int, pair: Pair) -> None:
        self.rng = random.Random(seed)
        self.pair = pair
        self.roots = [[self.rng.randrange(1 << 20) for _ in range(4 * 6)] for _ in range(3)]
        self.pinned: list[list[bytes]] = []

    def tokens(self) -> list[int]:
        root = self.rng.choice(self.roots)
        cut = 4 * self.rng.randrange(1, 7)
        tail = [self.rng.randrange(1 << 20) for _ in range(4 * self.rng.randrange(0, 4))]
        return root[:cut] + tail

    def keys(self, ns: Namespace = NS) -> ucm_db.BlockKeys:
        epoch = self.pair.stores["lmdb"].epoch(ns)
        return ns.block_keys(self.tokens(), epoch=epoch)

    def step(self) -> None:
        self.pair.clock.now_ns += self.rng.choice((1, 10**6, 10**9, 40 * 10**9))
        op = self.rng.choices(list(OPS), weights=[w for w, _ in OPS.values()])[0]
        OPS[op][1](self)

    # -- operations ------------------------------------------------------------------
    def put(self) -> None:
        ns = NS if self.rng.random() < 0.85 else OTHER
        keys = self.keys(ns)
        have = self.pair.both("lookup before put", lambda s: s.lookup(ns, keys))
        start = self.rng.randrange(0, have[1] + 1) if have[0] == "ok" else 0
        size = self.rng.choice(SIZES)
        blobs = [payload(k, size) for k in keys[start:]]
        fields = {k: BlockEventFields(block_hash=k[:8], parent_block_hash=None, token_ids=(1, 2, 3, 4), block_size=4)
                  for k in keys[start:]} if self.rng.random() < 0.5 else None
        self.pair.both("put", lambda s: s.put(ns, keys[start:], blobs, event_fields=fields))

    def flood(self) -> None:
        """A put larger than what eviction may free: StoreFullError, nothing written (or, under less
        pressure, an eviction of many tails at once)."""
        tokens = [self.rng.randrange(1 << 20) for _ in range(4 * self.rng.choice((12, 30)))]
        keys = NS.block_keys(tokens, epoch=self.pair.stores["lmdb"].epoch(NS))
        self.pair.both("flood", lambda s: s.put(NS, keys, [payload(k, SIZES[1]) for k in keys]))

    def get(self) -> None:
        keys = self.keys()
        self.pair.both("get", lambda s: s.get(NS, keys))

    def get_into(self) -> None:
        keys = self.keys()
        size = self.rng.choice(SIZES)

        def run(s: ucm_db.Store) -> Any:
            buffers = [bytearray(b"\xa5" * size) for _ in keys]
            return s.get_into(NS, keys, buffers, touch=self.rng.random() < 0.5), buffers
        state = self.rng.getstate()

        def seeded(s: ucm_db.Store) -> Any:
            self.rng.setstate(state)
            return run(s)
        self.pair.both("get_into", seeded)

    def get_slabs(self) -> None:
        keys = self.keys()
        size = self.rng.choice(SIZES)

        def run(s: ucm_db.Store) -> Any:
            halves = [np.full(len(keys) * size // 2, 0x5A, dtype=np.uint8) for _ in range(2)]
            slabs = ScatterSlabs([memoryview(h) for h in halves], [size // 2] * 2, list(range(len(keys))))
            return s.get_into(NS, keys, slabs, touch=False), [h.tobytes() for h in halves]
        self.pair.both("get_into slabs", run)

    def lookup(self) -> None:
        chains = [self.keys() for _ in range(3)]
        self.pair.both("lookup", lambda s: [s.lookup(NS, c) for c in chains])
        self.pair.both("lookup_many", lambda s: s.lookup_many(NS, chains))

    def touch(self) -> None:
        keys = self.keys()
        self.pair.both("touch", lambda s: s.touch(NS, keys))

    def delete(self) -> None:
        keys = self.keys()
        cut = self.rng.randrange(len(keys))
        self.pair.both("delete", lambda s: s.delete(NS, keys[cut:cut + 1]))

    def pin(self) -> None:
        if self.pinned and self.rng.random() < 0.4:
            keys = self.pinned.pop(self.rng.randrange(len(self.pinned)))
            self.pair.both("unpin", lambda s: s.unpin(NS, keys))
            return
        keys = self.keys()
        self.pinned.append(list(keys))
        self.pair.both("pin", lambda s: s.pin(NS, keys))

    def bump(self) -> None:
        self.pair.both("bump_epoch", lambda s: s.bump_epoch(NS))

    def put_encoded(self) -> None:
        """Blobs as the LMDB store holds them (an archive's) put into both stores under OTHER."""
        keys = self.keys()
        have = self.pair.both("lookup before put_encoded", lambda s: s.lookup(NS, keys))[1]
        blobs = self.pair.stores["lmdb"]._tier.get_batch(list(keys[:have]))
        other = OTHER.block_keys(self.tokens(), epoch=self.pair.stores["lmdb"].epoch(OTHER))
        stored = self.pair.both("lookup OTHER", lambda s: s.lookup(OTHER, other))[1]
        rows = [(k, other[i - 1] if i else None, blob) for i, (k, blob) in enumerate(zip(other, blobs)) if blob]
        # a blob verifies under its own key only: these are refused (CorruptBlockError), alike
        self.pair.both("put_encoded wrong keys", lambda s: s.put_encoded(OTHER, rows[stored:stored + 1]))
        own = [(k, keys[i - 1] if i else None, blob) for i, (k, blob) in enumerate(zip(keys, blobs)) if blob]
        self.pair.both("put_encoded", lambda s: s.put_encoded(NS, own))

    def quarantine(self) -> None:
        keys = self.keys()
        key = keys[self.rng.randrange(len(keys))]
        self.pair.both("quarantine", lambda s: s.quarantine(key, "audit", recheck=False))

    def flush(self) -> None:
        self.pair.both("flush", lambda s: s.flush())

    def reopen(self) -> None:
        self.pair.reopen()

    def compare(self) -> None:
        bases = {id(store): self.pair.feed_base[name] for name, store in self.pair.stores.items()}
        self.pair.both("observe", lambda s: observe(s, bases[id(s)]))


OPS: dict[str, tuple[float, Callable[[Workload], None]]] = {
    "put": (8, Workload.put), "flood": (0.5, Workload.flood), "get": (3, Workload.get), "get_into": (2, Workload.get_into),
    "get_slabs": (2, Workload.get_slabs), "lookup": (3, Workload.lookup), "touch": (2, Workload.touch),
    "delete": (1, Workload.delete), "pin": (2, Workload.pin), "bump": (0.3, Workload.bump),
    "put_encoded": (1, Workload.put_encoded), "quarantine": (0.5, Workload.quarantine),
    "flush": (1, Workload.flush), "reopen": (0.5, Workload.reopen), "compare": (3, Workload.compare),
}


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[Clock]:
    fake = Clock()
    monkeypatch.setattr(time, "time_ns", fake)
    yield fake


#: What maintenance reports differently by engine alone (paths, file sizes, the engine's own step).
ENGINE_FIELDS = ("path", "engine", "settings", "file_bytes", "file_free_bytes", "file_bytes_before", "file_bytes_after",
                 "rewrite", "archive", "last_use_age_s")


def maintained(path: Path, archive: Path) -> list[Any]:
    """The maintenance doors' reports on a closed store, engine fields left out."""
    def plain(report: Any) -> Any:
        if isinstance(report, dict):
            return {k: plain(v) for k, v in report.items() if k not in ENGINE_FIELDS}
        return [plain(v) for v in report] if isinstance(report, list) else report
    return [plain(maintenance.inspect(path, now_ns=2 * 10**18)), maintenance.verify(path).to_dict(),
            plain(maintenance.export_archive(path, archive)), plain(maintenance.compact(path)),
            maintenance.invalidate(path, (NS.model,)), maintenance.verify(path).to_dict()]


@pytest.mark.parametrize("codec", ["none", "zstd"])
@pytest.mark.parametrize("seed", SEEDS)
def test_rocksdb_and_lmdb_answer_every_step_alike(tmp_path: Path, clock: Clock, seed: int, codec: str) -> None:
    durability = "sync" if seed % 3 == 0 else "group"
    pair = Pair(tmp_path, clock, codec=codec, capacity_bytes=1 << 20, durability=durability, sync_interval_s=3600)
    try:
        workload = Workload(seed * 2 + (codec == "zstd"), pair)
        for _ in range(STEPS):
            workload.step()
        workload.compare()
        pair.reopen()
        workload.compare()
    finally:
        pair.close()
    reports = {name: maintained(path, tmp_path / f"{name}.tar") for name, path in pair.paths.items()}
    assert reports["lmdb"] == reports["rocksdb"]
    imported = {}
    for name in pair.paths:  # each archive into a store of the other engine
        other = "rocksdb" if name == "lmdb" else "lmdb"
        ucm_db.open(tmp_path / f"{name}-into-{other}", engine=other, capacity_bytes=1 << 20).close()
        maintenance.import_archive(tmp_path / f"{name}.tar", tmp_path / f"{name}-into-{other}")
        with ucm_db.open(tmp_path / f"{name}-into-{other}") as store:
            assert store.config.engine == other
            bases = store.feed_position()
            imported[name] = normalise(observe(store, bases), bases)
    assert imported["lmdb"] == imported["rocksdb"]
