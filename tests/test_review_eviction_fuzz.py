"""Seeded randomised model check of the public Store API with eviction (review).

Random walks of put/put_segments, get, get_into, lookup, touch, pin/unpin, delete, bump_epoch, keys used under
the other namespace and close/reopen, over two namespaces of chains sharing prefixes, on LMDB and RocksDB stores
(codecs none, zstd) at the 1 MiB capacity floor: puts evict all the time. Payloads are incompressible, new at each
write, so a block stores its raw size plus a fixed overhead (learnt from stats, then held to). The model predicts
all but which tails an eviction takes (LRU order is not modelled): after a put it reads which blocks went, checks
each was allowed to go ("maybe evicted"), then holds the store to that state.

Invariants after every step (each assert cites its doc line): 1. reads give a key's first write exactly, a miss
only where the model has the block gone; 2. a stored block's parent is stored, lookup is the stored prefix;
3. stats: stored bytes <= capacity, blocks, bytes, pins and evictions as modelled; 4. pinned blocks and their
ancestors are never evicted, a put only they (or its own blocks) could make room for is a StoreFullError that
writes nothing, delete takes descendants and their pins, bump_epoch the namespace's pins, max_pinned_bytes
holds; 5. a put never evicts its call's blocks or their ancestors, nor more than it needs, and its PutResult
adds up; 6. a reopen keeps every block bit for bit, the pins and epochs; 7. keys used under the other
namespace read, look up, delete and put nothing of it.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import takewhile
from pathlib import Path
from typing import Any

import pytest

import ucm_db
from ucm_db import BlockKeys, ConfigError, MissingAncestorError, Namespace, StoreFullError

CAPACITY = 1 << 20  # configuration.md: capacity_bytes "1 MiB to 2^62"; 10-60 blocks of 16-96 KiB
NAMESPACES = (Namespace(model="fuzz-a", kv_dtype="bfloat16", block_size=2),
              Namespace(model="fuzz-b", kv_dtype="bfloat16", block_size=2))
SHARED = [7, 7, 8, 8, 9, 9]  # three blocks the first two chains share; the third shares one
TOKEN_CHAINS = (SHARED + list(range(100, 110)), SHARED + list(range(200, 210)), SHARED[:2] + list(range(300, 312)))
CONFIGS = [("lmdb", "none"), ("lmdb", "zstd"), ("rocksdb", "none"), ("rocksdb", "zstd")]
SEEDS = range(10)
STEPS = 100
MAX_EPOCHS = 3  # per namespace: every epoch's keys stay in the universe the checks read


def raw_size(key: bytes) -> int:
    """Fixed per key, 16-96 KiB, so raw byte totals are known whatever was written."""
    return (16 << 10) + int.from_bytes(key[:4], "little") % (80 << 10)


@dataclass
class Universe:
    """Every key the walk uses: chains per (namespace index, epoch), each key's parent and namespace."""

    chains: dict[tuple[int, int], list[BlockKeys]] = field(default_factory=dict)
    parent: dict[bytes, bytes | None] = field(default_factory=dict)
    owner: dict[bytes, int] = field(default_factory=dict)

    def add_epoch(self, ns: int, epoch: int) -> Universe:
        chains = [NAMESPACES[ns].block_keys(tokens, epoch=epoch) for tokens in TOKEN_CHAINS]
        self.chains[(ns, epoch)] = chains
        for keys in chains:
            for i, key in enumerate(keys):
                self.parent[key], self.owner[key] = (keys[i - 1] if i else None), ns
        return self

    def lineage(self, key: bytes) -> list[bytes]:
        """``key`` and all its ancestors."""
        out = [key]
        while (up := self.parent[out[-1]]) is not None:
            out.append(up)
        return out

    def all_chains(self, ns: int) -> list[BlockKeys]:
        return [c for (owner, _epoch), chains in self.chains.items() if owner == ns for c in chains]

    def keys_of(self, ns: int) -> list[bytes]:
        return list(dict.fromkeys(k for chain in self.all_chains(ns) for k in chain))


@dataclass
class Model:
    """What the store must hold: each stored key's bytes, the pins, epochs and evictions so far."""

    universe: Universe
    epochs: list[int]
    stored: dict[bytes, bytes] = field(default_factory=dict)  # key -> bytes of its first write
    pins: dict[tuple[int, bytes], bytes] = field(default_factory=dict)  # (ns, chain id = last key given) -> tip
    evictions: int = 0
    overhead: int | None = None  # stored bytes a block takes beyond its raw bytes (learnt once)
    writes: int = 0

    def size(self, key: bytes) -> int:
        return raw_size(key) + (self.overhead or 0)

    def total(self, keys: Iterable[bytes]) -> int:
        return sum(self.size(k) for k in keys)

    def prefix(self, keys: Sequence[bytes], held: set[bytes] | dict[bytes, bytes] | None = None) -> int:
        """Leading ``keys`` stored (or inside ``held``)."""
        return sum(1 for _ in takewhile((self.stored if held is None else held).__contains__, keys))

    def pinned(self, pins: dict[tuple[int, bytes], bytes] | None = None, ns: int | None = None) -> set[bytes]:
        held = self.pins if pins is None else pins
        return {k for (owner, _), tip in held.items() if ns in (None, owner) for k in self.universe.lineage(tip)}

    def payload(self, key: bytes) -> bytes:
        """Bytes never written before (unique per key and write): a re-put must not replace the first."""
        self.writes += 1
        return random.Random(key + self.writes.to_bytes(4, "little")).randbytes(raw_size(key))


@dataclass
class Run:
    """One seeded walk: the store, how to reopen it, the model and the random source."""

    path: Path
    options: dict[str, Any]
    rng: random.Random
    model: Model
    store: ucm_db.Store

    def chain(self, ns: int, *, current: bool = True) -> BlockKeys:
        universe = self.model.universe
        return self.rng.choice(universe.chains[(ns, self.model.epochs[ns])] if current else universe.all_chains(ns))

    def span(self, keys: BlockKeys, most: int) -> BlockKeys:
        return part(keys, self.rng.randrange(len(keys)), self.rng.randint(1, most))


def part(keys: BlockKeys, start: int, count: int) -> BlockKeys:
    """``count`` keys from ``start`` (fewer at the end): a contiguous slice of BlockKeys knows its parent."""
    out = keys[start : start + count]
    assert isinstance(out, BlockKeys)
    return out


def present(run: Run) -> set[bytes]:
    """Keys stored now, each asked alone (lookup_many answers every chain from one snapshot)."""
    out: set[bytes] = set()
    for ns in range(2):
        keys = run.model.universe.keys_of(ns)
        counts = run.store.lookup_many(NAMESPACES[ns], [[k] for k in keys])
        out.update(k for k, n in zip(keys, counts) if n)
    return out


def check_reads(run: Run, ns: int, keys: Sequence[bytes], got: Sequence[bytes | bytearray | None]) -> None:
    # api.md: "get ... bytes per block; None = miss or corrupt"; only "lookup, get, get_into and delete see only
    # blocks stored under the namespace they are given" (a key of the other namespace reads as a miss).
    model, owner = run.model, run.model.universe.owner
    for key, value in zip(keys, got):
        want = model.stored.get(key) if owner[key] == ns else None
        assert (None if value is None else bytes(value)) == want, f"get of {key.hex()[:12]} under ns {ns}"


def check_store(run: Run) -> None:
    """The whole store against the model (invariants 1, 2, 3, 4 and 7)."""
    model, store, universe = run.model, run.store, run.model.universe
    assert present(run) == set(model.stored)
    for key in model.stored:  # storage.md: "A stored block's ancestors are always stored"
        assert universe.parent[key] is None or universe.parent[key] in model.stored
    for ns, namespace in enumerate(NAMESPACES):
        for chain in universe.all_chains(ns):  # api.md: lookup gives the "leading blocks stored"
            assert store.lookup(namespace, chain) == model.prefix(chain)
        keys = universe.keys_of(ns)
        buffers = [bytearray(raw_size(k)) for k in keys]
        flags = store.get_into(namespace, keys, buffers, touch=False)
        check_reads(run, ns, keys, [b if f else None for b, f in zip(buffers, flags)])
    stats = store.stats()
    assert (stats.blocks, stats.raw_bytes) == (len(model.stored), sum(raw_size(k) for k in model.stored))
    if model.overhead is None and stats.blocks:
        model.overhead, rest = divmod(stats.stored_bytes - stats.raw_bytes, stats.blocks)
        assert rest == 0 and model.overhead >= 0, "incompressible blocks should take raw bytes + a fixed header"
    # configuration.md: capacity_bytes is the "stored bytes kept before LRU eviction"
    assert stats.stored_bytes == model.total(model.stored) <= CAPACITY
    assert stats.evictions == model.evictions  # the put results' evicted counts, summed
    for ns, namespace in enumerate(NAMESPACES):
        mine = [k for k in model.stored if model.universe.owner[k] == ns]
        pinned = model.pinned(ns=ns)
        counts = stats.namespaces.get(namespace.id.hex())
        got = (counts.blocks, counts.raw_bytes, counts.pinned_blocks, counts.pinned_bytes) if counts else (0,) * 4
        assert got == (len(mine), sum(raw_size(k) for k in mine), len(pinned), model.total(pinned))
    assert stats.pinned_bytes == model.total(model.pinned())


def put_checked(run: Run, ns: int, segments: list[BlockKeys]) -> str:
    """One put (one segment) or put_segments, its outcome predicted but for which tails are evicted."""
    model = run.model
    call = [k for seg in segments for k in seg]
    payload_of = {k: model.payload(k) for k in call}  # a key in two segments carries one payload
    known, missing_parent = set(model.stored), False
    for seg in segments:  # api.md: refused "with MissingAncestorError unless keys[19] is stored"
        missing_parent |= seg.parent is not None and seg.parent not in known
        known.update(seg)  # put_segments: a segment may continue "an earlier segment of the same call"
    new = list(dict.fromkeys(k for k in call if k not in model.stored))
    # api.md: "Its eviction never removes the batch's blocks, the call's blocks that were stored already, or
    # their ancestors"; configuration.md: "A pinned chain and its ancestors are never evicted".
    protected = {a for k in call for a in model.universe.lineage(k)}
    evictable = set(model.stored) - protected - model.pinned()
    full = model.total(model.stored) + model.total(new) - model.total(evictable) > CAPACITY
    try:
        if len(segments) == 1:
            result = run.store.put(NAMESPACES[ns], segments[0], [payload_of[k] for k in segments[0]])
        else:
            result = run.store.put_segments(NAMESPACES[ns], [(s, [payload_of[k] for k in s]) for s in segments])
    except MissingAncestorError:  # nothing written: check_store holds the store to the unchanged model
        assert missing_parent, "MissingAncestorError with every parent stored"
        return "missing-ancestor"
    except StoreFullError:
        # api.md: "when only those would be left to evict, it raises StoreFullError and writes nothing"
        assert not missing_parent and full, "StoreFullError although unpinned, unprotected blocks could go"
        return "store-full"
    assert not missing_parent and not full, f"put succeeded: missing parent {missing_parent}, full {full}"
    after = present(run)
    gone = set(model.stored) - after
    # api.md: "A put stores every block it reports, or nothing"; "The PutResult ... names in stored_keys the
    # blocks it wrote"; a block stored already is left as it is (first writer wins).
    assert after - set(model.stored) == set(new) and result.stored_keys == new and result.stored == len(new)
    assert result.already_present == len(call) - len(new)
    assert gone <= evictable, "a put evicted a protected or pinned block"
    assert result.evicted == len(gone)
    assert (left := model.total(after)) <= CAPACITY
    assert not gone or left + max(model.size(k) for k in gone) > CAPACITY, "evicted more than it needed"
    model.stored = {k: v for k, v in model.stored.items() if k not in gone} | {k: payload_of[k] for k in new}
    model.evictions += result.evicted
    return f"stored {len(new)} evicted {len(gone)}"


def op_put(run: Run) -> str:
    ns, rng = run.rng.randrange(2), run.rng
    chain = run.chain(ns)
    have = min(run.model.prefix(chain), len(chain) - 1)
    orphan = have + 1 < len(chain) and rng.random() < 0.1  # its parent not stored: refused
    start = rng.randint(have + 1, len(chain) - 1) if orphan else rng.randint(max(0, have - 2), have)
    return put_checked(run, ns, [part(chain, start, rng.randint(1, 4))])


def op_put_segments(run: Run) -> str:
    ns, rng = run.rng.randrange(2), run.rng
    first = run.chain(ns)
    start = rng.randint(0, min(run.model.prefix(first), len(first) - 1))
    head = part(first, start, rng.randint(1, 3))
    if rng.random() < 0.5 and start + len(head) < len(first):  # the second segment continues the first
        return put_checked(run, ns, [head, part(first, start + len(head), rng.randint(1, 3))])
    other = run.chain(ns)  # may share blocks with the first (api.md: "chains of one call may share blocks")
    begin = rng.randint(0, min(run.model.prefix(other) + 1, len(other) - 1))  # its parent may be missing
    return put_checked(run, ns, [head, part(other, begin, rng.randint(1, 3))])


def op_get(run: Run) -> str:
    """A lookup and get of a span, or (a third of the time) a touch of it: recency only, no change."""
    ns = run.rng.randrange(2)
    keys = run.span(run.chain(ns, current=False), 8)
    if run.rng.random() < 1 / 3:
        run.store.touch(NAMESPACES[ns], keys)
        return f"touched {len(keys)}"
    assert run.store.lookup(NAMESPACES[ns], keys) == run.model.prefix(keys)  # api.md: "leading blocks stored"
    check_reads(run, ns, keys, run.store.get(NAMESPACES[ns], keys))
    return f"{len(keys)} keys"


def op_get_into(run: Run) -> str:
    ns = run.rng.randrange(2)
    keys = run.span(run.chain(ns, current=False), 4)
    buffers = [bytearray(raw_size(k)) for k in keys]
    cut = run.rng.randint(1, 8000)  # api.md: a scatter list is filled "in order"
    pieces: list[Any] = [[memoryview(b)[:cut], memoryview(b)[cut:]] if i % 2 else b for i, b in enumerate(buffers)]
    flags = run.store.get_into(NAMESPACES[ns], keys, pieces)
    check_reads(run, ns, keys, [b if f else None for b, f in zip(buffers, flags)])
    return f"{len(keys)} keys"


def op_pin(run: Run) -> str:
    """Pins one to three chains of a namespace in one call (whole chains mostly, else prefixes of them)."""
    model, ns = run.model, run.rng.randrange(2)
    chains = run.rng.sample(model.universe.chains[(ns, model.epochs[ns])], run.rng.randint(1, 3))
    chains = [c if run.rng.random() < 0.6 else part(c, 0, run.rng.randint(1, len(c))) for c in chains]
    if len({c[-1] for c in chains}) < len(chains):
        chains = chains[:1]  # one chain named twice in a call: not a case the docs speak of
    haves = tuple(model.prefix(c) for c in chains)
    pins = dict(model.pins)
    for keys, have in zip(chains, haves):  # pinning.py: "A pin covers what is stored *now* of each chain",
        if have:  # "named by the chain (its last key as given)"; one pin per chain, moved to what is stored now
            pins[(ns, keys[-1])] = keys[have - 1]
    before, after = model.pinned(), model.pinned(pins)
    # configuration.md: max_pinned_bytes ("default half of capacity_bytes"): "a pin beyond it is a StoreFullError";
    # pinning.py: refused if it "would leave more than limit_bytes pinned in the whole store, and pins anything new"
    limit = min(run.options.get("max_pinned_bytes", CAPACITY // 2), CAPACITY)
    refused = bool(after - before) and model.total(after) > limit
    try:
        report = run.store.pin(NAMESPACES[ns], chains if len(chains) > 1 else chains[0])
    except StoreFullError:
        assert refused, "pin refused within max_pinned_bytes"
        return "refused"
    assert not refused, "pin beyond max_pinned_bytes"
    assert report.chains == haves and report.changed_blocks == len(after - before)
    assert report.changed_bytes == model.total(after - before) and report.store_bytes == model.total(after)
    assert report.namespace_blocks == len(model.pinned(pins, ns))
    model.pins = pins
    return f"pinned {sum(haves)} in {len(chains)} chains"


def op_unpin(run: Run) -> str:
    model, ns = run.model, run.rng.randrange(2)
    keys: Sequence[bytes] = part(chain := run.chain(ns, current=False), 0, run.rng.randint(1, len(chain)))
    if model.pins and run.rng.random() < 0.7:  # mostly a chain that holds a pin: named by its last key
        ns, chain_id = run.rng.choice(sorted(model.pins))
        keys = model.universe.lineage(chain_id)[::-1]
    pins = {p: tip for p, tip in model.pins.items() if p != (ns, keys[-1])}
    before, after = model.pinned(), model.pinned(pins)
    report = run.store.unpin(NAMESPACES[ns], keys)
    # pinning.py: "Unpinning a chain takes back that chain's pin and no other"
    assert report.changed_blocks == len(before - after) and report.chains == (model.prefix(keys, after),)
    model.pins = pins
    return f"unpinned {len(before - after)}"


def op_delete(run: Run) -> str:
    model, ns = run.model, run.rng.randrange(2)
    mine = [k for k in model.stored if model.universe.owner[k] == ns]
    pool = mine if mine and run.rng.random() < 0.8 else model.universe.keys_of(ns)
    roots = set(run.rng.sample(pool, min(len(pool), run.rng.randint(1, 2))))
    # api.md: "delete(ns, keys) removes blocks and their descendants"; pins.py: "Removing a block removes its pin"
    removed = {k for k in mine if roots.intersection(model.universe.lineage(k))}
    assert run.store.delete(NAMESPACES[ns], sorted(roots)) == len(removed)
    model.stored = {k: v for k, v in model.stored.items() if k not in removed}
    model.pins = {p: tip for p, tip in model.pins.items() if tip not in removed}
    return f"deleted {len(removed)}"


def op_bump(run: Run) -> str:
    model, ns = run.model, run.rng.randrange(2)
    if sum(owner == ns for owner, _ in model.universe.chains) >= MAX_EPOCHS:
        return op_get(run)
    epoch = run.store.bump_epoch(NAMESPACES[ns])
    assert epoch > model.epochs[ns] and run.store.epoch(NAMESPACES[ns]) == epoch  # epochs.py: "only move forward"
    model.epochs[ns] = epoch
    model.universe.add_epoch(ns, epoch)  # epochs.py: "Moving an epoch on ... releases the namespace's pins"
    model.pins = {p: tip for p, tip in model.pins.items() if p[0] != ns}
    return f"epoch {epoch}"


def op_reopen(run: Run) -> str:
    run.store.close()
    run.store = ucm_db.open(run.path, **run.options)  # pinning.py: pins "survive restarts" (check_stats)
    assert [run.store.epoch(n) for n in NAMESPACES] == run.model.epochs
    return "reopened"


def op_cross(run: Run) -> str:
    """Keys of one namespace, used under the other (invariant 7)."""
    model, ns = run.model, run.rng.randrange(2)
    other, chain = NAMESPACES[1 - ns], run.chain(ns, current=False)
    assert run.store.lookup(other, chain) == 0
    assert run.store.get(other, chain) == [None] * len(chain)
    # api.md: "A delete leaves a key stored under another namespace alone (it counts as not removed)"
    assert run.store.delete(other, [run.rng.choice(chain)]) == 0
    have = model.prefix(chain)
    if have:  # api.md: "a put whose key or parent is stored under another namespace ... is a ConfigError"
        keys = chain[run.rng.randrange(have) :][:3]
        with pytest.raises(ConfigError):
            run.store.put(other, keys, [model.payload(k) for k in keys])
    return f"prefix {have}"


OPS: list[tuple[Callable[[Run], str], int]] = [
    (op_put, 30), (op_put_segments, 10), (op_get, 16), (op_get_into, 5),
    (op_pin, 12), (op_unpin, 2), (op_delete, 6), (op_bump, 2), (op_reopen, 3), (op_cross, 4),
]


def walk(tmp_path: Path, engine: str, codec: str, seed: int) -> None:
    rng = random.Random(f"{engine}-{codec}-{seed}")
    options: dict[str, Any] = {"capacity_bytes": CAPACITY, "codec": codec, "engine": engine}
    if (pin_share := rng.choice([None, 0.75, 1.0])) is not None:  # more pins: more puts refused as full
        options["max_pinned_bytes"] = int(CAPACITY * pin_share)
    model = Model(Universe().add_epoch(0, 0).add_epoch(1, 0), [0, 0])
    run = Run(tmp_path / "s", options, rng, model, ucm_db.open(tmp_path / "s", **options))
    ops, weights = zip(*OPS)
    trace: list[str] = []
    try:
        for step in range(STEPS):
            op = rng.choices(ops, weights)[0]
            trace.append(f"{step} {op.__name__}")
            trace[-1] += f": {op(run)}"
            check_store(run)
        assert run.store._tier.check() == []  # the index's own audit (as test_store_statemachine.py ends)
    except AssertionError as exc:
        raise AssertionError(f"{engine}/{codec} seed {seed}, last steps {trace[-6:]}: {exc}") from exc
    finally:
        run.store.close()


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("engine", "codec"), CONFIGS)
def test_random_walk_with_eviction_matches_the_model(tmp_path: Path, engine: str, codec: str, seed: int) -> None:
    walk(tmp_path, engine, codec, seed)
