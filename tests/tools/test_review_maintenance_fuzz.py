"""Seeded fuzz: maintenance never changes what a reader gets.

Per seed, a real store (LMDB; RocksDB every third seed): random chains over two namespaces (shared prefixes, codec
``none``/``zstd`` per put, 1 MiB capacity so puts evict), pins, unpins, touches, reads, deletes; the model: each key
put holds exactly ``payload_for(key)`` or is absent. Then random maintenance, through ``ucm_db.maintenance`` or the
CLI (``CliRunner``): compact with and without ``--target-bytes``, verify, ``verify --fix`` on an intact store,
export (all or one namespace) and import into a fresh store (which may become the subject) or the source,
``migrate``, ``migrate --to-engine``, invalidate, a serving reader, one-byte damage through the engine's tables.

Invariants after each (cited where checked): 1. every block the model holds reads back bit for bit, other keys
miss, ``lookup`` gives each chain's modelled prefix; only compact's target removes blocks: exactly the least
recently used unpinned tails it needs; 2. verify on an intact store finds nothing, ``verify --fix`` there changes
no record; 3. pins survive compact, reopen, engine conversion; invalidate releases them; 4. an imported store serves
the same bytes for the same keys, nothing else; 5. ``stats()`` agree with the model (blocks, raw, stored and pinned
bytes, per namespace); 6. a damaged block reads as a miss; verify names exactly it; ``--fix`` takes its subtree.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
import tarfile
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import pytest

import ucm_db
from ucm_db import Namespace, StoreFullError, maintenance, migrations
from ucm_db.maintenance import BlockInfo
from ucm_db.migrations.access import open_engine

from cli_stores import invoke_json

NAMESPACES = (Namespace(model="review/fuzz-a", kv_dtype="bfloat16", block_size=4),
              Namespace(model="review/fuzz-b", kv_dtype="float16", block_size=8, tp_rank=1, tp_size=2))
CAPACITY_BYTES = 1 << 20  # the smallest capacity: the build's ~1.3 MB of puts evict
SEEDS = list(range(10))
BUILD_STEPS = 70
MAINTENANCE_STEPS = 10


def payload_for(key: bytes) -> bytes:
    """4-24 KiB, three quarters noise: zstd stores about 3/4 of it."""
    size = 4096 + int.from_bytes(key[:4], "little") % (20 << 10)
    noise = hashlib.shake_256(key).digest(size * 3 // 4)
    return noise + bytes(size - len(noise))


@dataclass(frozen=True, slots=True)
class Chain:
    ns: Namespace
    tokens: tuple[int, ...]
    keys: list[bytes]


@dataclass(slots=True)
class Model:
    """What a reader must get: ``blocks`` (each holding ``payload_for(key)``); every other key of ``chains`` misses."""
    path: Path
    engine: str
    chains: list[Chain]
    blocks: dict[bytes, BlockInfo]
    pin_tips: dict[bytes, tuple[bytes, bytes]]  # chain id (its last key) -> (namespace id, tip key)
    epochs: dict[bytes, int]
    log: list[str] = field(default_factory=list)
    evictions: int = 0  # the store's counter at the last check

    def pinned(self) -> set[bytes]:
        """Each live pin's tip and its ancestors (ucm_db/index/pins.py: "it pins that block and every ancestor")."""
        out: set[bytes] = set()
        for _ns_id, tip in self.pin_tips.values():
            key: bytes | None = tip
            while key is not None and key in self.blocks and key not in out:
                out.add(key)
                key = self.blocks[key].parent
        return out

    def prefix(self, chain: Chain) -> int:
        return next((i for i, key in enumerate(chain.keys) if key not in self.blocks), len(chain.keys))


def snapshot(path: Path) -> dict[bytes, BlockInfo]:  # maintenance.iter_blocks reads below the Store: no touch
    return {b.key: b for b in maintenance.iter_blocks(path)}


def identity(info: BlockInfo) -> tuple[Any, ...]:  # what only a removal may change (recency and hits may move)
    return info.namespace_id, info.parent, info.depth, info.raw_bytes, info.stored_bytes


def lru_victims(blocks: dict[bytes, BlockInfo], pinned: set[bytes], target: int) -> set[bytes]:
    """Compact's victims (compaction.py step 1): the oldest LRU entry (entries.py lru_key: access_ns, then deeper) that
    is an unpinned tail, until ``target``; storage.md: a block with children "files it as used and goes on", and so
    does a pinned tail (eviction.py): those passed over go behind all others, refiled at one ``now``."""
    queue = sorted(blocks, key=lambda k: (blocks[k].last_use_ns, -blocks[k].depth, k))
    children = Counter(b.parent for b in blocks.values())
    stored, victims = totals(blocks.values())[2], set()
    while stored > target:
        at = next((i for i, k in enumerate(queue) if not children[k] and k not in pinned), None)
        if at is None:
            break
        victim, queue = queue[at], queue[at + 1:] + sorted(queue[:at], key=lambda k: (-blocks[k].depth, k))
        victims.add(victim)
        stored -= blocks[victim].stored_bytes
        children[blocks[victim].parent] -= 1
    return victims


def totals(blocks: Iterable[BlockInfo]) -> tuple[int, ...]:  # blocks, raw bytes, stored bytes
    return tuple(map(sum, zip(*[(1, b.raw_bytes, b.stored_bytes) for b in blocks], strict=True))) or (0, 0, 0)


def build_store(path: Path, engine: str, rng: random.Random) -> Model:
    chains: list[Chain] = []
    pins: dict[bytes, tuple[Chain, int]] = {}
    with ucm_db.open(path, engine=engine, capacity_bytes=CAPACITY_BYTES, codec=rng.choice(["none", "zstd"])) as store:
        for _ in range(BUILD_STEPS):
            action = rng.choice(["put"] * 6 + ["touch", "get", "pin", "pin", "unpin", "delete"])
            if action == "put" or not chains:
                chains.append(put_random_chain(store, chains, rng))
                continue
            chain = rng.choice(chains)
            keys = chain.keys[:store.lookup(chain.ns, chain.keys, remote=False)]
            if action == "touch":
                store.touch(chain.ns, keys)
            elif action == "get":
                assert store.get(chain.ns, keys) == [bytearray(payload_for(k)) for k in keys]
            elif action == "pin":
                with contextlib.suppress(StoreFullError):  # over max_pinned_bytes: pins nothing (cli.md "Pins")
                    if pinned := store.pin(chain.ns, chain.keys).chains[0]:
                        pins[chain.keys[-1]] = (chain, pinned)
            elif action == "unpin" and pins:
                unpinned = pins.pop(rng.choice(sorted(pins)))[0]
                store.unpin(unpinned.ns, unpinned.keys)
            elif action == "delete" and keys:
                store.delete(chain.ns, [rng.choice(keys)])
                pins = {cid: (c, n) for cid, (c, n) in pins.items()  # cli.md "Pins": "A delete ... takes the blocks'
                        if store.lookup(c.ns, c.keys[:n], remote=False) == n}  # pins with them" (a tip put again: none)
        epochs = {ns.id: store.epoch(ns) for ns in NAMESPACES}
    blocks, universe = snapshot(path), {key: chain.ns.id for chain in chains for key in chain.keys}
    for key, info in blocks.items():  # nothing nobody put; docs/api.md: "A stored block's ancestors are stored"
        assert (universe.get(key), info.raw_bytes) == (info.namespace_id, len(payload_for(key)))
        assert info.parent is None or info.parent in blocks
    tips = {cid: (c.ns.id, c.keys[n - 1]) for cid, (c, n) in pins.items()}
    assert all(tip in blocks for _ns, tip in tips.values()), "a put evicted a pinned block (cli.md: never evicted)"
    return Model(path, engine, chains, blocks, tips, epochs)


def put_random_chain(store: ucm_db.Store, chains: list[Chain], rng: random.Random) -> Chain:
    ns = rng.choice(NAMESPACES)
    base = rng.choice([c for c in chains if c.ns == ns] or [None])  # most chains continue a shared prefix
    tokens = list(base.tokens[:rng.randint(1, len(base.keys)) * ns.block_size]) if base and rng.random() < 0.6 else []
    tokens += [rng.randrange(50000) for _ in range(rng.randint(1, 8) * ns.block_size)]
    keys = ns.block_keys(tokens)
    new = keys[store.lookup(ns, keys, remote=False):]  # a BlockKeys slice knows its parent (docs/api.md)
    if new:
        store.put(ns, new, [payload_for(k) for k in new], codec_name=rng.choice([None, "none", "zstd"]))
    return Chain(ns, tuple(tokens), list(keys))


def check_reader_view(model: Model) -> None:
    """Invariants 1, 3, 5 through a read-only open: it writes no recency, so the LRU order stays for compact."""
    with ucm_db.open(model.path, read_only=True) as store:
        assert {ns.id: store.epoch(ns) for ns in NAMESPACES} == model.epochs, model.log
        for chain in model.chains:
            want = [bytearray(payload_for(k)) if k in model.blocks else None for k in chain.keys]
            assert store.get(chain.ns, chain.keys) == want, f"{model.log}: wrong bytes or presence"
            assert store.lookup(chain.ns, chain.keys, remote=False) == model.prefix(chain), model.log
        for key in list(model.blocks)[:8]:  # "Namespaces never mix" (docs/api.md): the other one misses
            assert store.get(NAMESPACES[model.blocks[key].namespace_id == NAMESPACES[0].id], [key]) == [None]
        stats = store.stats()
    pinned = [model.blocks[k] for k in model.pinned()]
    assert (stats.blocks, stats.raw_bytes, stats.stored_bytes, stats.pinned_bytes) == (
        *totals(model.blocks.values()), totals(pinned)[2]), model.log
    for ns in NAMESPACES:
        row = stats.namespaces.get(ns.id.hex())
        got = row and (row.blocks, row.raw_bytes, row.stored_bytes, row.pinned_blocks, row.pinned_bytes)
        assert (got or (0,) * 5) == (*totals(b for b in model.blocks.values() if b.namespace_id == ns.id),
                                     *totals(b for b in pinned if b.namespace_id == ns.id)[::2]), model.log
    model.evictions = stats.evictions


def settle(model: Model, *, same_records: bool) -> None:
    """The store holds exactly the model's blocks; with ``same_records`` not even recency or hits moved."""
    now = snapshot(model.path)
    assert now.keys() == model.blocks.keys(), f"{model.log}: blocks appeared or vanished"
    assert all(identity(now[k]) == identity(v) for k, v in model.blocks.items()), model.log
    if same_records:
        assert now == model.blocks, f"{model.log}: block records changed"
    model.blocks = now
    check_reader_view(model)


def door(model: Model, rng: random.Random, api: Callable[[], Any], *cli_args: Any, expect: int = 0) -> dict[str, Any]:
    """One maintenance call through the Python API or the CLI (cli.md: each command is a thin layer over it)."""
    via_cli = rng.random() < 0.5
    model.log.append(("cli " if via_cli else "api ") + " ".join(str(a) for a in cli_args if not isinstance(a, Path)))
    if via_cli:
        return invoke_json(*cli_args, expect=expect)
    return report if isinstance(report := api(), dict) else report.to_dict()


def op_compact(model: Model, rng: random.Random, work: Path) -> Model:
    # cli.md: compact "drops quarantine records and orphaned entries"; compaction.py: "... so pins survive it".
    r = door(model, rng, lambda: maintenance.compact(model.path), "compact", model.path)
    assert (r["evicted_blocks"], r["blocks_after"], r["index_problems"]) == (0, len(model.blocks), [])
    assert r["rewrite"] == ("rewritten" if model.engine == "lmdb" else "rocksdb compaction")
    settle(model, same_records=True)
    return model


def op_compact_target(model: Model, rng: random.Random, work: Path) -> Model:
    before, pinned, evictions_before = model.blocks, model.pinned(), model.evictions
    total = totals(before.values())[2]
    draw = rng.random()  # mostly a trim; sometimes anything; sometimes below the pinned bytes
    target = rng.randint(total * 3 // 5, total) if draw < 0.7 else rng.randint(0, total if draw < 0.9 else total // 8)
    r = door(model, rng, lambda: maintenance.compact(model.path, target_bytes=target),
             "compact", model.path, "--target-bytes", target)
    after = snapshot(model.path)
    evicted, stored_after = before.keys() - after.keys(), totals(after.values())[2]
    assert after.keys() <= before.keys() and all(identity(after[k]) == identity(before[k]) for k in after)
    # compaction.py step 1: "Pinned blocks are never evicted ... a target below the pinned bytes stops there";
    # docs/storage.md: "eviction takes chain tails only"; cli.md: compact "evicts to a size".
    assert not evicted & pinned, f"{model.log}: a pinned block was evicted"
    assert stored_after <= target or after.keys() <= pinned, f"{model.log}: stopped at {stored_after} > {target}"
    assert evicted == lru_victims(before, pinned, target), f"{model.log}: not the least recently used tails"
    assert (r["evicted_blocks"], r["blocks_after"], r["stored_bytes_after"]) == (len(evicted), len(after), stored_after)
    assert r["pinned_bytes_after"] == sum(after[k].stored_bytes for k in pinned)
    model.blocks = after
    check_reader_view(model)
    assert model.evictions == evictions_before + len(evicted)  # writes.py evict_lru: "counted in the totals' evictions"
    return model


def op_verify(model: Model, rng: random.Random, work: Path, fix: bool = False) -> Model:
    # cli.md verify "decodes and checksums every block ... checks the index"; with fix "repairs what was found".
    r = door(model, rng, lambda: maintenance.verify(model.path, fix=fix, isolated=rng.random() < 0.5),
             "verify", model.path, *(["--fix"] if fix else []))
    assert (r["checked"], r["corrupt"], r["index_problems"]) == (len(model.blocks), [], []), model.log
    assert r["raw_bytes"] == totals(model.blocks.values())[1]
    assert not (r["quarantined_blocks"] or r["totals_recomputed"] or r["feed_repaired"] or r["epochs_renewed"]
                or any(r["index_repaired"].values())), model.log
    settle(model, same_records=True)
    return model


def op_migrate(model: Model, rng: random.Random, work: Path) -> Model:
    # A current store of API-written blocks: nothing pending, and pre_units.py takes per-rank blocks only with
    # "the connector's layout record" (the second namespace has a TP rank but no such record).
    r = door(model, rng, lambda: {"applied_now": [m.version for m in migrations.migrate(model.path)],
                                  "pre_unit_blocks": maintenance.convert_pre_unit_blocks(model.path).to_dict()},
             "migrate", model.path)  # tools/migrate_cmd.py migrate_in_place: the two steps
    assert r["applied_now"] == [] and not any(v for k, v in r["pre_unit_blocks"].items() if k != "namespaces"), r
    settle(model, same_records=True)
    return model


def op_read(model: Model, rng: random.Random, work: Path) -> Model:
    # A serving reader (reopen, get, touch) moves recency (docs/storage.md "Reading a block makes its ancestors ...").
    model.log.append("reader")
    with ucm_db.open(model.path) as store:
        for chain in rng.sample(model.chains, min(4, len(model.chains))):
            want = [bytearray(payload_for(k)) if k in model.blocks else None for k in chain.keys]
            assert store.get(chain.ns, chain.keys) == want, model.log
            store.touch(chain.ns, chain.keys[:model.prefix(chain)])
    settle(model, same_records=False)
    return model


def op_convert(model: Model, rng: random.Random, work: Path) -> Model:
    # conversion.py "copies every table verbatim (... LRU order, hit counts ...)"; cli.md "Pins": pins survive it.
    engine = "rocksdb" if model.engine == "lmdb" else "lmdb"
    converted = replace(model, path=work / f"converted-{len(model.log)}", engine=engine)
    model.log.append(f"convert to {engine}")
    maintenance.convert_engine(model.path, converted.path, engine)
    settle(converted, same_records=True)
    return converted


def op_invalidate(model: Model, rng: random.Random, work: Path) -> Model:
    held = [ns for ns in NAMESPACES if any(b.namespace_id == ns.id for b in model.blocks.values())]
    if not held:
        return model
    ns = rng.choice(held)
    r = door(model, rng, lambda: {"invalidated": maintenance.invalidate(model.path, (ns.model,))},
             "invalidate", model.path, "--namespace", ns.model)
    (row,) = r["invalidated"]
    assert row["epoch"] > model.epochs[ns.id]  # "a store's epoch never goes down" (cli.md "Epochs")
    model.epochs[ns.id] = row["epoch"]
    # cli.md "Stale is stale": invalidate "releases the namespace's pins"; "nothing is deleted".
    model.pin_tips = {cid: pin for cid, pin in model.pin_tips.items() if pin[0] != ns.id}
    settle(model, same_records=True)
    with ucm_db.open(model.path, read_only=True) as store:  # chains keyed at the new epoch find nothing stored before
        for chain in (c for c in model.chains if c.ns == ns):
            assert store.lookup(ns, ns.block_keys(list(chain.tokens), epoch=row["epoch"]), remote=False) == 0
    return model


def op_export_import(model: Model, rng: random.Random, work: Path) -> Model:
    archive, fresh = work / f"export-{len(model.log)}.tar", work / f"imported-{len(model.log)}"
    held = [ns for ns in NAMESPACES if any(b.namespace_id == ns.id for b in model.blocks.values())]
    chosen = rng.choice([[], *[[ns] for ns in held]])  # cli.md export "[--namespace X]": all, or one held
    wanted = {k: b for k, b in model.blocks.items() if not chosen or b.namespace_id == chosen[0].id}
    r = door(model, rng, lambda: maintenance.export_archive(model.path, archive, tuple(ns.model for ns in chosen)),
             "export", model.path, archive, *[arg for ns in chosen for arg in ("--namespace", ns.model)])
    assert (r["blocks"], r["left_out"], r["corrupt"]) == (len(wanted), 0, []), model.log
    with tarfile.open(archive) as tar:  # archive/__init__.py: "each block's encoded blob exactly as stored"
        manifest = json.loads(tar.extractfile("manifest.json").read())  # type: ignore[union-attr]
        sizes = {m.name: m.size for m in tar.getmembers()}
    assert {bytes.fromhex(k): (p and bytes.fromhex(p)) for k, p, _ns in manifest["blocks"]} == {
        k: b.parent for k, b in wanted.items()}
    assert all(sizes[f"blocks/{k.hex()}"] == b.stored_bytes for k, b in wanted.items())
    if rng.random() < 0.25:  # back into the source: "import only adds blocks" (cli.md "Archives"), same epochs
        r = door(model, rng, lambda: maintenance.import_archive(archive, model.path), "import", archive, model.path)
        assert (r["stored"], r["already_present"], r["skipped"], r["evicted"]) == (0, len(wanted), [], 0), model.log
        settle(model, same_records=False)
        return model
    engine = rng.choice(["lmdb", "lmdb", "rocksdb"])
    ucm_db.open(fresh, engine=engine, capacity_bytes=CAPACITY_BYTES, codec=rng.choice(["none", "zstd"])).close()
    r = door(model, rng, lambda: maintenance.import_archive(archive, fresh), "import", archive, fresh)
    assert (r["stored"], r["already_present"], r["skipped"], r["evicted"]) == (len(wanted), 0, [], 0), model.log
    # Invariant 4; cli.md "Epochs": import records the archive's epoch; pinning.py: pins are "not ... exported".
    carried = {b.namespace_id for b in wanted.values()}
    imported = Model(fresh, engine, model.chains, wanted, {},
                     {ns_id: e if ns_id in carried else 0 for ns_id, e in model.epochs.items()}, [*model.log, engine])
    settle(imported, same_records=False)
    return imported if rng.random() < 0.5 else model


def op_corrupt(model: Model, rng: random.Random, work: Path) -> Model:
    # One flipped byte in the head or body of a few blocks, through the tables as tests/reliability/test_corruption.py.
    if not model.blocks:
        return model
    damaged = rng.sample(sorted(model.blocks), min(len(model.blocks), rng.randint(1, 3)))
    flips = {key: (rng.choice(["heads", "blocks"]), rng.random(), rng.randrange(1, 256)) for key in damaged}
    model.log.append(f"corrupt {sorted(t for t, _at, _mask in flips.values())}")

    def flip(txn: Any) -> None:
        for key, (table, at, mask) in flips.items():
            value = bytearray(txn.get(table, key))
            value[int(at * len(value))] ^= mask
            txn.put(table, key, bytes(value))
    with contextlib.closing(open_engine(model.path)) as engine:
        engine.write(flip)
    # cli.md verify: "decodes and checksums every block"; exit 1: "problems found (corrupt blocks ...)".
    r = door(model, rng, lambda: maintenance.verify(model.path), "verify", model.path, expect=1)
    assert {bytes.fromhex(c["key"]) for c in r["corrupt"]} == set(damaged), f"{model.log}: verify did not name them"
    below: set[bytes] = set()  # the damaged blocks' descendants
    while grown := {k for k, b in model.blocks.items() if b.parent in below.union(damaged)} - below:
        below |= grown
    gone = below.union(damaged)
    if rng.random() < 0.5:  # archive/members.py: a corrupt block "is left out with its descendants and named"; one
        archive = work / f"damaged-{len(model.log)}.tar"
        r = door(model, rng, lambda: maintenance.export_archive(model.path, archive), "export", model.path, archive,
                 expect=1)
        assert ({bytes.fromhex(c["key"]) for c in r["corrupt"]}, r["left_out"], r["blocks"]) == (  # below one: left out
            set(damaged) - below, len(gone), len(model.blocks) - len(gone)), model.log
    with ucm_db.open(model.path, read_only=True) as store:  # docs/api.md: "A damaged block is a miss, never a wedge"
        for chain in model.chains:
            for key, value in zip(chain.keys, store.get(chain.ns, chain.keys), strict=True):
                if key in flips:
                    assert value is None, f"{model.log}: a damaged block was served"
                elif key in model.blocks:
                    assert value == payload_for(key) or (value is None and key in gone), model.log
    # cli.md verify --fix "quarantines corrupt blocks ... each with its descendants".
    r = door(model, rng, lambda: maintenance.verify(model.path, fix=True), "verify", model.path, "--fix", expect=1)
    assert r["quarantined_blocks"] == len(gone), model.log
    model.blocks = {k: v for k, v in model.blocks.items() if k not in gone}
    model.pin_tips = {cid: pin for cid, pin in model.pin_tips.items() if pin[1] not in gone}
    settle(model, same_records=False)
    return op_verify(model, rng, work)


OPERATIONS: list[tuple[Callable[[Model, random.Random, Path], Model], int]] = [
    (op_compact, 2), (op_compact_target, 4), (op_verify, 2), (partial(op_verify, fix=True), 2), (op_read, 2),
    (op_export_import, 2), (op_convert, 1), (op_invalidate, 1), (op_corrupt, 1), (op_migrate, 1),
]


def run_seed(seed: int, work: Path) -> Model:
    rng = random.Random(seed)
    model = build_store(work / "built", "rocksdb" if seed % 3 == 2 else "lmdb", rng)
    model.log.append(f"seed {seed}: {model.engine}, {len(model.blocks)} blocks, {len(model.pin_tips)} pins")
    check_reader_view(model)
    for _ in range(MAINTENANCE_STEPS):
        model = rng.choices(*zip(*OPERATIONS, strict=True))[0](model, rng, work)
    return model


@pytest.mark.parametrize("seed", SEEDS)
def test_maintenance_never_changes_what_a_reader_gets(tmp_path: Path, seed: int) -> None:
    model = run_seed(seed, tmp_path)
    op_verify(model, random.Random(seed), tmp_path)  # the store the sequence left is intact
