"""Review of provisional puts with a write-back remote (held uploads: ``ucm_db/index/provisional.py``; the
ancestor repair's waits; the sweep). Seeded model-based fuzz: one store, a ``file://`` remote, one or two
owners; tagged puts of chains and continuations, untagged puts below held blocks, re-puts of stored, voided,
swept or evicted keys, settles (twice too), voids (``delete(remote=True)``, settle), owners closed then a
reopen (the sweep), flushes, eviction at 1 MiB, RocksDB, write-through, another node reading through the remote.
Invariants after every step: nothing unsettled (or below it), voided or swept is on a write-back remote (a
write-through put's blocks are there at once); a flush returns iff nothing waits below a held block, then all
else is uploaded; another node never reads an unsettled, voided or swept incarnation (payloads name theirs);
``uploads`` names stored publishable blocks only, ``held/``, ``prov/`` rows open tags only (read from the index's
own tables); nothing swept stays. The four defects it found are fixed; their repros are plain tests.
"""

from __future__ import annotations

import os
import random
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import ucm_db
from ucm_db.index import provisional as marks

NS = ucm_db.Namespace(model="review-provisional-uploads", kv_dtype="bfloat16", block_size=4)
OPTIONS: dict[str, Any] = {"codec": "none", "sync_interval_s": 0.2}
UNIT, EVICTING_UNIT, BIG, SMALL = 4096, 48 << 10, 64 << 20, 1 << 20
WAIT_S, DRAIN_S, STEPS = 0.3, 20.0, 60
SEEDS = [(seed, "rocksdb" if seed % 5 == 0 else "lmdb", "write_through" if seed % 7 == 0 else "write_back",
          seed % 3 == 0) for seed in range(1, 16)]

# A second process on the store directory, its uploader; "writer": settled and unsettled chains, a block below.
HELPER = r'''
import sys, time, ucm_db
ns = ucm_db.Namespace(model="review-provisional-uploads", kv_dtype="bfloat16", block_size=4)
store = ucm_db.open(sys.argv[1], codec="none", capacity_bytes=64 << 20, remote=sys.argv[2], remote_mode="write_back")
while not store._state.wing.uploader.election.held: time.sleep(0.01)  # the first store opened uploads
def put(tokens, start, tag):
    keys = ns.block_keys(tokens)[start:]
    store.put_segments(ns, [(keys, [bytes(4096)] * len(keys))], provisional={k: tag for k in keys} if tag else None)
if "writer" in sys.argv:
    owner = store.provisional_owner()
    put(list(range(8)), 0, settled := owner.tag()); owner.settle([settled]); store.flush()
    put(list(range(100, 108)), 0, owner.tag()); put(list(range(100, 108)) + [1] * 4, 2, None)
print("ready", flush=True); time.sleep(120)
'''


def _remote_options(shared: Path, mode: str = "write_back") -> dict[str, Any]:
    return {**OPTIONS, "capacity_bytes": BIG, "remote": f"file://{shared}", "remote_mode": mode}


def _on_remote(shared: Path, key: bytes) -> bool:
    return (shared / NS.short_id / key[:1].hex() / key.hex()).exists()


def _stored(store: ucm_db.Store, keys: list[bytes]) -> set[bytes]:
    return set(store._state.engine.read(lambda txn: [k for k in keys if txn.get("meta", k) is not None]))


def _rows(store: ucm_db.Store) -> tuple[list[bytes], list[bytes], list[bytes]]:  # uploads, held/ and prov/ tags
    def tags(txn: Any, prefix: bytes) -> list[bytes]:
        return [bytes(name[len(prefix):len(prefix) + marks.TAG_BYTES]) for name, _ in txn.scan("info", prefix)]
    return store._state.engine.read(lambda txn: ([bytes(k) for k, _ in txn.scan("uploads")],
                                                 tags(txn, marks.HELD_PREFIX), tags(txn, marks.PROVISIONAL_PREFIX)))


def _wait_retracted(store: ucm_db.Store) -> None:  # until no retraction waits for its remote delete
    uploads, deadline = store._state.tier.uploads, time.monotonic() + DRAIN_S
    while uploads.retractions_due(limit=1):
        assert time.monotonic() < deadline, "a retraction never reached the remote"
        store._state.wing.wake_uploader()
        time.sleep(0.02)


def _put(store: ucm_db.Store, keys: Any, tag: bytes | None, unit: int = UNIT, first_id: int = 0) -> Any:
    payloads = [struct.pack(">Q", first_id + i) + bytes(unit - 8) for i in range(len(keys))]  # incarnation ids
    return store.put_segments(NS, [(keys, payloads)], provisional={k: tag for k in keys} if tag else None)


@dataclass
class Model:
    """Incarnations (one per block a put was given) and what the store should hold of them."""

    write_back: bool
    tokens: dict[bytes, tuple[int, ...]] = field(default_factory=dict)  # every key made -> its token path
    parent: dict[bytes, bytes | None] = field(default_factory=dict)
    current: dict[bytes, int] = field(default_factory=dict)  # stored key -> its incarnation
    incs: dict[int, tuple[bytes, bytes | None]] = field(default_factory=dict)  # incarnation -> key, tag
    fate: dict[int, str] = field(default_factory=dict)  # incarnation -> "ok" (publishable), "held", "bad"
    tag_state: dict[bytes, str] = field(default_factory=dict)  # "open", "settled", "dead"
    held: dict[bytes, set[bytes]] = field(default_factory=dict)  # key -> open tags holding a row for it
    legit: set[bytes] = field(default_factory=set)  # keys whose object may be on the remote (stored: eligible once)
    retracted: set[bytes] = field(default_factory=set)  # keys this node's deletes retracted

    def chain(self, key: bytes | None) -> Iterator[bytes]:
        while key is not None:
            yield key
            key = self.parent[key]

    def state(self, key: bytes) -> str:
        return self.fate[self.current[key]]

    def tag(self, key: bytes) -> bytes | None:
        return self.incs[self.current[key]][1]

    def eligible(self, key: bytes) -> bool:
        return all(self.state(k) == "ok" for k in self.chain(key))

    def waiting(self) -> bool:
        return self.write_back and any(self.state(k) == "ok" and not self.eligible(k) for k in self.current)

    def gone(self, keys: set[bytes]) -> None:
        """``keys`` were deleted by a void or sweep (and retracted)."""
        for key in keys:
            inc = self.current.pop(key)
            self.fate[inc] = self.fate[inc] if key in self.legit else "bad"  # once eligible, it was right
            self.legit.discard(key)
            self.retracted.add(key)

    def settled(self, tags: set[bytes], state: str = "settled") -> None:
        self.tag_state.update(dict.fromkeys(tags, state))
        for inc, (_key, tag) in self.incs.items():
            if tag in tags and self.fate[inc] == "held":
                self.fate[inc] = "ok" if state == "settled" else "bad"
        for held in self.held.values():
            held -= tags


class Run:
    """One seeded sequence against a real store, checked against the model after each step."""

    def __init__(self, tmp_path: Path, seed: int, engine: str, mode: str, evicting: bool) -> None:
        self.rng, self.tmp, self.shared = random.Random(seed), tmp_path, tmp_path / "remote"
        self.unit = EVICTING_UNIT if evicting else UNIT
        self.options = {**_remote_options(self.shared, mode), "engine": engine,
                        "capacity_bytes": SMALL if evicting else BIG}
        self.model = Model(write_back=mode == "write_back")
        self.store = ucm_db.open(tmp_path / "s", **self.options)
        self.owners = [self.store.provisional_owner() for _ in range(self.rng.choice((1, 2)))]
        self.tag_owner: dict[bytes, int] = {}
        self.other: ucm_db.Store | None = None

    def put(self, tagged: bool) -> None:
        m, rng, tag = self.model, self.rng, None
        if tagged:
            owner = rng.randrange(len(self.owners))
            mine = [t for t, s in m.tag_state.items() if s == "open" and self.tag_owner[t] == owner]
            tag = rng.choice(mine) if mine and rng.random() < 0.5 else self.owners[owner].tag()
            m.tag_state.setdefault(tag, "open")
            self.tag_owner[tag] = owner
        stored = sorted(k for k in m.current if len(m.tokens[k]) <= 24)
        same = [k for k in stored if m.tag(k) == tag] if tag else []
        unstored = sorted(k for k in m.tokens if k not in m.current and m.parent[k] in (None, *m.current))
        roll = rng.random()
        if unstored and roll < 0.2:  # a voided, swept or evicted key put again (the recompute)
            path = m.tokens[rng.choice(unstored)]
            start = len(path) // 4 - 1
        else:  # a new chain, or a continuation below a stored block (of the same tag, or any)
            parent = rng.choice(same) if same and roll < 0.45 else rng.choice(stored) if stored and roll < 0.8 else None
            base = m.tokens[parent] if parent is not None else ()
            path = base + tuple(len(m.incs) * 1000 + i for i in range(4 * rng.randint(1, 3)))
            start = len(base) // 4 - (1 if base and rng.random() < 0.3 else 0)  # sometimes the parent again
        chain = NS.block_keys(list(path))
        for depth, key in enumerate(chain):
            m.tokens.setdefault(key, path[:4 * (depth + 1)])
            m.parent.setdefault(key, chain[depth - 1] if depth else None)
        if self._allowed(chain[start:], tag):
            self._store(chain[start:], tag)

    def _store(self, keys: Any, tag: bytes | None) -> None:
        m, first = self.model, len(self.model.incs) + 1
        stored = set(_put(self.store, keys, tag, self.unit, first).stored_keys)  # ancestors fit: never StoreFullError
        for inc, key in enumerate(keys, first):
            m.incs[inc], m.fate[inc] = (key, tag), "held" if tag else "ok"
            if key in stored:
                m.current[key] = inc
                if tag and m.write_back:
                    m.held.setdefault(key, set()).add(tag)
                if not m.write_back:
                    m.legit.add(key)
                    assert _on_remote(self.shared, key), "a write-through put returned before its upload"

    def _allowed(self, keys: list[bytes], tag: bytes | None) -> bool:
        """False for puts the model cannot judge."""
        m = self.model
        for key in keys:
            if key not in m.current and key in m.legit:
                return False  # an old object of the key may be on the remote: the model cannot tell it apart
        return True

    def settle(self, tag: bytes | None = None) -> None:
        tags = sorted(t for t, s in self.model.tag_state.items() if s != "dead")
        if tags:
            tag = tag or self.rng.choice(tags)  # a settled one again, too
            self.owners[self.tag_owner[tag]].settle([tag])
            self.model.settled({tag})

    def void(self) -> None:
        m = self.model
        tags = sorted({m.tag(k) for k in m.current if m.state(k) == "held"})
        if tags:
            tag = self.rng.choice(tags)
            mine, before = sorted(k for k in m.current if m.tag(k) == tag), set(m.current)
            self.store.delete(NS, mine if self.rng.random() < 0.5 else [self.rng.choice(mine)], remote=True)
            m.gone(before - _stored(self.store, sorted(before)))
            self.settle(tag)
            _wait_retracted(self.store)

    def reopen(self) -> None:
        """Owners closed unsettled, the store reopened: its sweep takes their open tags."""
        m = self.model
        for owner in self.owners:
            owner.close()
        self.store.close()
        dead = {t for t, s in m.tag_state.items() if s == "open"}
        m.retracted |= {key for key, tag in m.incs.values() if tag in dead}  # what the sweep may retract
        m.settled(dead, "dead")
        before, self.store = set(m.current), ucm_db.open(self.tmp / "s", **self.options)
        m.gone(before - _stored(self.store, sorted(before)))
        self.owners = [self.store.provisional_owner() for _ in self.owners]
        _wait_retracted(self.store)

    def flush(self) -> None:
        m = self.model
        if m.waiting():
            with pytest.raises(ucm_db.TierError, match="waiting for upload"):
                self.store.flush(upload_timeout_s=WAIT_S)
            return
        self.store.flush(upload_timeout_s=DRAIN_S)
        missing = [k.hex()[:12] for k in m.current if (m.eligible(k) or not m.write_back)
                   and not _on_remote(self.shared, k)]
        assert not missing, f"settled or untagged blocks not uploaded after a flush: {missing}"
        assert _rows(self.store)[0] == [], "the queue did not drain"

    def read_elsewhere(self, every: bool = False) -> None:
        """Another node reads chains: never an unsettled, voided or swept incarnation (``every``: reads all whole)."""
        m = self.model
        if not m.write_back or not m.tokens:
            return
        self.other = self.other or ucm_db.open(self.tmp / "other", **_remote_options(self.shared))
        for key in sorted(m.tokens) if every else self.rng.sample(sorted(m.tokens), min(6, len(m.tokens))):
            chain = NS.block_keys(list(m.tokens[key]))
            found = self.other.lookup(NS, chain)
            assert not every or key not in m.current or found == len(chain), "another node misses settled blocks"
            for got, k in zip(self.other.get(NS, chain[:found]), chain):
                fate = m.fate[struct.unpack(">Q", bytes(got[:8]))[0]] if got is not None else "ok"
                assert fate == "ok", f"another node read block {k.hex()[:12]} of a {fate} incarnation"

    def check(self) -> None:
        m = self.model
        stored = _stored(self.store, sorted(m.tokens))
        assert stored <= set(m.current), "a block the model never stored (or a swept one) is stored"
        m.current = {k: i for k, i in m.current.items() if k in stored}  # the rest was evicted
        assert not [k for k in m.current if m.state(k) == "bad"], "a dead owner's block (or one below) was not swept"
        m.legit.update(filter(m.eligible, m.current))
        for key in m.tokens:
            early = m.write_back and key in m.current and not m.eligible(key)
            if (early or (key not in m.current and key not in m.legit)) and _on_remote(self.shared, key):
                what = "an unsettled block (or one below it)" if early else "a voided or swept block"
                raise AssertionError(f"{what} is on the remote: {key.hex()[:12]}")
        if m.write_back:
            uploads, held, prov = _rows(self.store)
            assert all(k in m.current and m.state(k) == "ok" for k in uploads), \
                "the upload queue names a held or removed block"
            stale = {t.hex()[:12] for t in held + prov if m.tag_state.get(t) != "open"}
            assert not stale, f"held or marker rows of settled or swept tags stayed: {stale}"


@pytest.mark.parametrize(("seed", "engine", "mode", "evicting"), SEEDS)
def test_provisional_uploads_fuzz(tmp_path: Path, seed: int, engine: str, mode: str, evicting: bool) -> None:
    run = Run(tmp_path, seed, engine, mode, evicting)
    steps = {lambda: run.put(True): 30, lambda: run.put(False): 22, run.settle: 12, run.void: 10, run.flush: 10,
             run.reopen: 4, run.read_elsewhere: 8}
    try:
        for _ in range(STEPS):
            run.rng.choices(list(steps), weights=list(steps.values()))[0]()
            run.check()
        for tag in sorted(t for t, s in run.model.tag_state.items() if s == "open"):  # in the end every tag settles:
            run.settle(tag)  # everything stored is uploaded, another node reads it whole, no row is left
        run.check()
        run.flush()
        run.read_elsewhere(every=True)
        assert _rows(run.store)[1:] == ([], []), "held or marker rows stayed once every tag was settled"
    finally:
        for store in filter(None, (run.other, run.store)):
            store.close()


@contextmanager
def _helper(path: Path, shared: Path, *flags: str) -> Iterator[subprocess.Popen[str]]:
    """A second process on the store directory (``HELPER``), ready once it is the elected uploader."""
    args = [sys.executable, "-c", HELPER, str(path), f"file://{shared}", *flags]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        yield proc
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        proc.wait(30)


@pytest.fixture
def remote_store(tmp_path: Path) -> Iterator[tuple[ucm_db.Store, ucm_db.ProvisionalOwner, Path]]:
    with ucm_db.open(tmp_path / "s", **_remote_options(tmp_path / "remote")) as store:
        yield store, store.provisional_owner(), tmp_path / "remote"


def test_a_killed_writers_held_blocks_and_what_hangs_below_never_reach_the_remote(tmp_path: Path) -> None:
    shared, path, settled = tmp_path / "remote", tmp_path / "s", NS.block_keys(list(range(8)))
    held = NS.block_keys(list(range(100, 108)) + [1] * 4 + [2] * 4)  # the writer's held two, its block below, ours
    with _helper(path, shared, "writer") as writer, ucm_db.open(path, **_remote_options(shared)) as store:
        assert _put(store, held[:2], None).stored_keys == [], "a held block was put again over its first writer"
        assert _put(store, held[3:], None).stored_keys == [held[3]]  # another store's put below them
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait(30)
        with pytest.raises(ucm_db.TierError, match="waiting for upload"):
            store.flush(upload_timeout_s=WAIT_S)
        assert [_on_remote(shared, k) for k in held] == [False] * 4
        with ucm_db.open(tmp_path / "other", **_remote_options(shared)) as other:  # before any sweep
            assert (other.lookup(NS, held), other.lookup(NS, settled)) == (0, 2)
    with ucm_db.open(path, **_remote_options(shared)) as store:  # the sweep
        _wait_retracted(store)
        store.flush(upload_timeout_s=DRAIN_S)
        assert _stored(store, list(held)) == set() and _rows(store) == ([], [], [])
        assert [_on_remote(shared, k) for k in [*held, *settled]] == [False] * 4 + [True] * 2


def _void_and_recompute(store: ucm_db.Store, owner: ucm_db.ProvisionalOwner, keys: Any, settle_late: bool) -> None:
    """A save voided (deleted, its tag settled: ``settle_late``, after the recompute), recomputed under a new tag."""
    void_tag = owner.tag()
    _put(store, keys, void_tag)
    store.delete(NS, list(keys), remote=True)
    owner.settle([] if settle_late else [void_tag])
    _put(store, keys, owner.tag())
    owner.settle([void_tag] if settle_late else [])


def test_a_settle_never_queues_a_key_held_under_another_tag(remote_store: Any) -> None:
    store, owner, shared = remote_store
    keys = NS.block_keys(list(range(8)))
    _void_and_recompute(store, owner, keys, settle_late=True)  # the void's settle comes KEEP_STEPS later
    store.flush(upload_timeout_s=DRAIN_S)
    assert [_on_remote(shared, k) for k in keys] == [False, False], "an unsettled block was uploaded"


def test_a_block_below_a_recomputed_held_block_waits(remote_store: Any) -> None:
    store, owner, shared = remote_store
    chain = NS.block_keys(list(range(12)))
    _void_and_recompute(store, owner, chain[:2], settle_late=False)
    _put(store, chain[2:], None)
    with pytest.raises(ucm_db.TierError, match="waiting for upload"):
        store.flush(upload_timeout_s=WAIT_S)
    assert not _on_remote(shared, chain[2]), "a block below an unsettled one was uploaded"


def test_a_retractions_confirmation_never_queues_a_held_block(tmp_path: Path) -> None:
    shared = tmp_path / "remote"
    with _helper(tmp_path / "s", shared) as uploader, ucm_db.open(tmp_path / "s", **_remote_options(shared)) as store:
        owner, keys = store.provisional_owner(), NS.block_keys(list(range(8)))
        os.kill(uploader.pid, signal.SIGSTOP)  # its pass confirms the void's retraction only after the recompute
        _void_and_recompute(store, owner, keys, settle_late=False)
        os.kill(uploader.pid, signal.SIGCONT)
        store.flush(upload_timeout_s=DRAIN_S)  # until the retraction is confirmed and the queue empty
        assert [_on_remote(shared, k) for k in keys] == [False, False], "an unsettled block was uploaded"


def test_blocks_waiting_below_a_held_one_never_starve_other_uploads(remote_store: Any) -> None:
    store, owner, shared = remote_store
    chain = NS.block_keys(list(range(4 * 301)))
    _put(store, chain[:1], owner.tag(), unit=256)
    _put(store, chain[1:], None, unit=256)  # 300 blocks wait for the settle
    cut = sorted(chain[1:])[255]
    other = next(keys for seed in range(10_000, 20_000) if (keys := NS.block_keys([seed] * 4))[0] > cut)
    _put(store, other, None, unit=256)  # queued after the first 256 rows, in key order
    with pytest.raises(ucm_db.TierError, match="waiting for upload"):
        store.flush(upload_timeout_s=1.0)
    assert _on_remote(shared, other[0]), "an unrelated block was never uploaded while others waited"
