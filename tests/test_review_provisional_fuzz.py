"""Adversarial review of provisional puts (``ucm_db/store/provisional.py``,
``ucm_db/index/provisional.py``, ``put_segments``' ``provisional``): real
LMDB/RocksDB stores in ``tmp_path``, real writers (``python -c``) SIGKILLed.

Invariants (passing): a seeded writer puts random chains (one or two
segments, each untagged, under a new tag or an earlier one), settles random
tags, meets MissingAncestorError and, at a small capacity, eviction; the
test stores chains first (first writer wins) and descendants below the
writer's while it lives (none of them swept then). After the SIGKILL a
sweep (the next open; or the maintenance thread, a second process opening
at once) leaves no block stored under a tag unsettled at the death nor a
descendant of one; without eviction every other block stays with its first
writer's payload; no marker, no owner file; ``stats().blocks`` and
``verify`` agree. A conversion carries the markers (the copy sweeps them); a
refused put marks nothing; a settle on a closed store raises ClosedError.

The review's findings, each a minimal repro (all failed before the fixes):
a forked child's tags collided with the parent's (now refused in a child); a
sweep dropped markers a put wrote during its delete (now only those it read);
a sweep judged an owner of its own process made after its snapshot (now
read after the markers); an export after the death carried the wrong blocks
unmarked (now left out with descendants); an idle store swept every
``sync_interval_s``, not every ``SWEEP_INTERVAL_S``.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import pytest

import ucm_db
from ucm_db.index import provisional as marks
from ucm_db.maintenance import verify
from ucm_db.maintenance.archive import export_archive, import_archive
from ucm_db.maintenance.conversion import convert
from ucm_db.store import provisional

NS = ucm_db.Namespace(model="review-provisional", kv_dtype="bfloat16", block_size=4)
BIG = {"capacity_bytes": 64 << 20, "sync_interval_s": 0.2}
SMALL_UNIT_BYTES, EVICTING_UNIT_BYTES = 256, 96 << 10
NO_SWEEP_THREAD = {"capacity_bytes": 64 << 20, "codec": "none", "sync_interval_s": 3600.0}

_PRELUDE = r'''
import json, os, random, sys, time
import ucm_db
cfg = json.loads(sys.argv[1])
ns = ucm_db.Namespace(model="review-provisional", kv_dtype="bfloat16", block_size=4)
store = ucm_db.open(cfg["path"], **cfg["options"])
owner = store.provisional_owner()
def keys(path):
    return ns.block_keys([t for d, v in enumerate(path) for t in [d * 8 + v + 1] * 4])
def payload(k):
    return b"W" + k + bytes(cfg["unit"] - 1 - len(k))
def put(path, tag):
    seg = keys(path)
    return store.put_segments(ns, [(seg, [payload(k) for k in seg])], provisional={k: tag for k in seg})
'''
_READY = r'''
store.flush(); print(json.dumps(said), flush=True); time.sleep(120)
'''
# Random puts and settles; prints every stored key (path, parent, tag) and every settle.
FUZZ_WRITER = _PRELUDE + r'''
rng, tags, events = random.Random(cfg["seed"]), [], []
for _ in range(cfg["ops"]):
    if tags and rng.random() < 0.2:
        chosen = rng.sample(tags, min(len(tags), rng.randint(1, 2))); owner.settle(chosen)
        events.append({"settle": [t.hex() for t in chosen]}); continue
    segments, prov, paths = [], {}, {}
    for _ in range(rng.choice((1, 1, 2))):
        path = [rng.randrange(3) for _ in range(rng.randint(1, 5))]
        start, r = rng.randrange(len(path)), rng.random()
        tag = None if r < 0.3 else rng.choice(tags) if r < 0.5 and tags else owner.tag()
        tags += [tag] if tag is not None and tag not in tags else []
        seg = keys(path)[start:]
        segments.append((seg, [payload(k) for k in seg]))
        for i, k in enumerate(seg):
            paths[k] = (path[:start + i + 1], (seg[i - 1] if i else seg.parent) or b"")
            prov.update({k: tag} if tag is not None else {})
    try:
        stored = store.put_segments(ns, segments, provisional=prov).stored_keys
    except (ucm_db.MissingAncestorError, ucm_db.StoreFullError):
        stored = []
    events.append({"put": [[k.hex(), paths[k][0], paths[k][1].hex(), prov.get(k, b"").hex()] for k in stored]})
said = events
''' + _READY
# One unsettled tag over chain (0,0,0), one settled over (1,1,1).
SIMPLE_WRITER = _PRELUDE + r'''
wrong, right = owner.tag(), owner.tag()
put([0, 0, 0], wrong); put([1, 1, 1], right); owner.settle([right])
said = {"owner": owner.owner_id.hex()}
''' + _READY
# A forked child tags and puts (2,2,2) with the parent's owner; the parent then settles its own first tag.
FORK_WRITER = _PRELUDE + r'''
r, w = os.pipe()
child = os.fork()
if child == 0:
    try:
        tag = owner.tag(); put([2, 2, 2], tag)
    except ucm_db.UcmDbError:  # refused in a forked child: nothing stored
        tag = bytes(24)
    os.write(w, tag); time.sleep(120); os._exit(0)
child_tag = os.read(r, 24)
tag = owner.tag(); put([1, 1, 1], tag); owner.settle([tag])
said = {"child": child, "collided": child_tag == tag}
''' + _READY


def _chain(path: list[int]) -> ucm_db.BlockKeys:
    """The keys of a path of variants (the writers' ``keys``)."""
    return NS.block_keys([t for d, v in enumerate(path) for t in [d * 8 + v + 1] * 4])


def _start(script: str, path: Path, options: dict[str, Any], *, seed: int = 0, ops: int = 0,
           unit: int = SMALL_UNIT_BYTES) -> tuple[subprocess.Popen[str], Any]:
    """A writer process and the JSON line it printed once ready."""
    cfg = {"path": str(path), "options": options, "seed": seed, "ops": ops, "unit": unit}
    proc = subprocess.Popen([sys.executable, "-c", script, json.dumps(cfg)], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline() if proc.stdout is not None else ""
    assert line, f"the writer failed (rc {proc.wait(30)})"
    return proc, json.loads(line)


def _kill(proc: subprocess.Popen[str], *more_pids: int) -> None:
    """SIGKILLs a writer (and other processes), then reaps the writer."""
    for pid in (proc.pid, *more_pids):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait(30)


@pytest.fixture()
def writers() -> Iterator[list[subprocess.Popen[str]]]:
    """Writer processes, killed and reaped at the end whatever happened."""
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        _kill(proc)


def _markers(store: ucm_db.Store) -> set[bytes]:
    return store._state.engine.read(marks.owners)  # noqa: SLF001 - the review reads the markers themselves


def _owner_files(path: Path) -> list[Path]:
    return list(path.glob(".ucm-db.owner.*"))  # the owners' lock files


def _wrong_and_right(store: ucm_db.Store) -> tuple[int, int]:
    """How much of SIMPLE_WRITER's unsettled chain and of its settled one the store holds."""
    return store.lookup(NS, _chain([0, 0, 0]), remote=False), store.lookup(NS, _chain([1, 1, 1]), remote=False)


def _held(store: ucm_db.Store, key: bytes) -> bytes | None:
    found = store.get(NS, [key])[0]
    return bytes(found[:1]) if found is not None else None


class FuzzModel:
    """Every block stored (by whom, its parent) and the writer's tags unsettled at its death."""

    def __init__(self) -> None:
        self.parent: dict[bytes, bytes] = {}
        self.who: dict[bytes, bytes] = {}
        self.paths: dict[bytes, list[int]] = {}
        self.pending: dict[bytes, set[bytes]] = {}  # tag -> keys it stored since its last settle

    def stored(self, keys: list[bytes], chain: ucm_db.BlockKeys, who: bytes) -> None:
        for i, key in enumerate(chain):
            if key in keys:
                self.parent[key], self.who[key] = (chain[i - 1] if i else chain.parent) or b"", who

    def replay(self, events: list[dict[str, Any]]) -> None:
        for event in events:
            for tag in event.get("settle", []):
                self.pending.pop(bytes.fromhex(tag), None)
            for key_hex, path, parent_hex, tag_hex in event.get("put", []):
                key = bytes.fromhex(key_hex)
                self.parent[key], self.who[key], self.paths[key] = bytes.fromhex(parent_hex), b"W", path
                if tag_hex:
                    self.pending.setdefault(bytes.fromhex(tag_hex), set()).add(key)

    def doomed(self) -> set[bytes]:
        """The wrong blocks and every descendant of one."""
        wrong: set[bytes] = set().union(*self.pending.values())
        return {key for key in self.parent if self._first_of(key, wrong)}

    def _first_of(self, key: bytes, wanted: set[bytes]) -> bytes:
        """``key`` or its nearest ancestor in ``wanted``; b"" if none."""
        while key and key not in wanted:
            key = self.parent.get(key, b"")
        return key


def _descendants_below_writer(store: ucm_db.Store, model: FuzzModel, rng: random.Random, unit: int) -> None:
    writer_keys = sorted(k for k, who in model.who.items() if who == b"W")
    for key in rng.sample(writer_keys, min(4, len(writer_keys))):
        chain = cast(ucm_db.BlockKeys, _chain(model.paths[key] + [3, 4])[len(model.paths[key]):])
        try:
            result = store.put_segments(NS, [(chain, [b"T" + k + bytes(unit - 1 - len(k)) for k in chain])])
        except ucm_db.MissingAncestorError:
            continue  # evicted meanwhile
        model.stored(result.stored_keys, chain, b"T")


def _wait(done: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:
        time.sleep(0.05)
    return done()


# seed, engine, codec, sweep ("open": the next open; "thread": maintenance thread + a second opener), evicting
CASES = [(11, "lmdb", "none", "open", False), (12, "lmdb", "zstd", "thread", False),
         (13, "rocksdb", "none", "open", False), (14, "lmdb", "none", "open", True),
         (15, "rocksdb", "zstd", "open", True), (16, "lmdb", "none", "thread", True),
         (17, "lmdb", "zstd", "open", False), (18, "lmdb", "none", "thread", False)]


@pytest.mark.parametrize(("seed", "engine", "codec", "sweep", "evicting"), CASES)
def test_a_killed_writers_unsettled_blocks_and_only_those_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writers: list[subprocess.Popen[str]],
    seed: int, engine: str, codec: str, sweep: str, evicting: bool,
) -> None:
    monkeypatch.setattr(provisional, "SWEEP_INTERVAL_S", 0.2)
    path, rng, model = tmp_path / "s", random.Random(seed), FuzzModel()
    unit = EVICTING_UNIT_BYTES if evicting else SMALL_UNIT_BYTES
    options = {**BIG, "engine": engine, "codec": codec} | ({"capacity_bytes": 1 << 20} if evicting else {})
    store = ucm_db.open(path, **options)
    for chain in [_chain([rng.randrange(3) for _ in range(rng.randint(1, 4))]) for _ in range(3)]:  # first writers
        result = store.put(NS, chain, [b"T" + k + bytes(unit - 1 - len(k)) for k in chain])
        model.stored(result.stored_keys, chain, b"T")
    if engine == "rocksdb":  # one writing process at a time
        store.close()
    proc, events = _start(FUZZ_WRITER, path, options, seed=seed, ops=30, unit=unit)
    writers.append(proc)
    model.replay(events)
    if engine != "rocksdb":
        _descendants_below_writer(store, model, rng, unit)
        if not evicting:
            alive = {k for k in model.who if _held(store, k) is None}
            assert not alive, f"{len(alive)} blocks went while their writer lived"
        if sweep == "open":
            store.close()
    _kill(proc)
    if sweep == "thread":
        opener = "import sys, json, ucm_db as u; u.open(sys.argv[1], **json.loads(sys.argv[2])).close()"  # sweeps
        assert not subprocess.run([sys.executable, "-c", opener, str(path), json.dumps(options)], timeout=60).returncode
        assert _wait(lambda: not _owner_files(path) and not _markers(store)), "the maintenance thread never swept"
    else:
        store = ucm_db.open(path, **options)
    doomed = model.doomed()
    assert doomed and len(doomed) < len(model.parent), "the seed must leave wrong blocks and right ones"
    held = {k: _held(store, k) for k in model.parent}
    assert not [k for k in doomed if held[k] is not None], "a dead writer's unsettled blocks (or descendants) stayed"
    if not evicting:
        assert {k: v for k, v in held.items() if v is not None} == {k: model.who[k] for k in model.parent
                                                                     if k not in doomed}
    assert not _markers(store) and not _owner_files(path)
    assert store.stats().blocks == sum(v is not None for v in held.values())
    store.close()
    assert not verify(path).problems


def test_conversion_carries_markers_and_the_new_store_sweeps(tmp_path: Path) -> None:
    path, dest = tmp_path / "s", tmp_path / "d"
    _kill(_start(SIMPLE_WRITER, path, {**NO_SWEEP_THREAD})[0])  # its markers stay: nobody opened the store
    convert(path, dest, "rocksdb")
    with ucm_db.open(dest, **NO_SWEEP_THREAD) as store:
        assert _wrong_and_right(store) == (0, 3), "the converted store kept the wrong chain (or lost the right one)"


def test_refused_puts_mark_nothing_and_settle_after_close_raises(tmp_path: Path) -> None:
    store = ucm_db.open(tmp_path / "s", **{**NO_SWEEP_THREAD, "capacity_bytes": 1 << 20})
    owner = store.provisional_owner()
    tag = owner.tag()
    orphan = _chain([0, 1])[1:]
    with pytest.raises(ucm_db.MissingAncestorError):
        store.put_segments(NS, [(orphan, [b"x" * 64])], provisional={orphan[0]: tag})
    huge = _chain([1, 1, 1])
    with pytest.raises(ucm_db.StoreFullError):
        store.put_segments(NS, [(huge, [b"y" * (600 << 10)] * 3)], provisional={k: tag for k in huge})
    assert not _markers(store) and store.stats().blocks == 0
    store.close()
    with pytest.raises(ucm_db.ClosedError):
        owner.settle([tag])
    owner.close()


def test_a_forked_childs_tags_never_settle_with_the_parents(tmp_path: Path) -> None:
    path = tmp_path / "s"
    proc, said = _start(FORK_WRITER, path, {**NO_SWEEP_THREAD})
    _kill(proc, said["child"])
    with ucm_db.open(path, **NO_SWEEP_THREAD) as store:
        assert store.lookup(NS, _chain([1, 1, 1]), remote=False) == 3, "the settled chain went"
        collided = said["collided"]
        assert store.lookup(NS, _chain([2, 2, 2]), remote=False) == 0, f"wrong chain stayed (collided: {collided})"


def test_a_put_landing_during_a_sweep_keeps_its_marker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writers: list[Any],
) -> None:
    proc, said = _start(SIMPLE_WRITER, tmp_path / "s", {**NO_SWEEP_THREAD})
    writers.append(proc)
    store = ucm_db.open(tmp_path / "s", **NO_SWEEP_THREAD)  # the writer lives: nothing swept (nor by the thread)
    _kill(proc)
    owner_id = bytes.fromhex(said["owner"])
    late, real_delete = _chain([2, 2]), store._state.tier.delete  # noqa: SLF001

    def delete_then_late_put(keys: list[bytes], **kwargs: Any) -> int:
        removed = real_delete(keys, **kwargs)
        late_tag = owner_id + (99).to_bytes(marks.SEQ_BYTES, "big")  # the dead writer's committer child commits
        store.put_segments(NS, [(late, [b"W" * 64] * 2)], provisional={k: late_tag for k in late})
        return removed

    monkeypatch.setattr(store._state.tier, "delete", delete_then_late_put)  # noqa: SLF001
    provisional.sweep(store._state)  # noqa: SLF001
    monkeypatch.undo()
    provisional.sweep(store._state)  # noqa: SLF001 - a second sweep, all markers it finds deleted
    with store:
        assert _wrong_and_right(store) == (0, 3)
        assert store.lookup(NS, late, remote=False) == 0, "a put under the dead owner's tag lost its marker"


class _LockThenRun:
    """``_OWN_LOCK`` whose next release runs ``then``: another thread acting between a sweep's snapshot of
    this process's owners and its read of the markers."""

    then: Callable[[], None] | None = None

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def __enter__(self) -> None:
        self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()
        then, self.then = self.then, None
        then() if then is not None else None


def test_an_owner_made_during_a_sweep_of_its_own_process_stays(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hooked = _LockThenRun()
    monkeypatch.setattr(provisional, "_OWN_LOCK", hooked)
    with ucm_db.open(tmp_path / "s", **NO_SWEEP_THREAD) as store:
        chain, made = _chain([0, 0]), []

        def owner_puts() -> None:
            owner = store.provisional_owner()
            made.append(owner)
            tag = owner.tag()
            store.put_segments(NS, [(chain, [b"W" * 64] * 2)], provisional={k: tag for k in chain})

        hooked.then = owner_puts
        provisional.sweep(store._state)  # noqa: SLF001
        assert made and store.lookup(NS, chain, remote=False) == 2, "a live owner's blocks were swept"
        assert _owner_files(tmp_path / "s"), "the live owner's lock file was removed"
        made[0].close()


def test_an_export_after_a_death_carries_no_wrong_blocks(tmp_path: Path) -> None:
    path = tmp_path / "s"
    _kill(_start(SIMPLE_WRITER, path, {**NO_SWEEP_THREAD})[0])  # its markers stay: nobody opened the store
    export_archive(path, tmp_path / "a.tar")
    import_archive(tmp_path / "a.tar", tmp_path / "other")
    with ucm_db.open(tmp_path / "other") as other:
        assert _wrong_and_right(other) == (0, 3), "the dead writer's wrong chain was imported"


def test_an_idle_store_sweeps_every_sweep_interval(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writers: list[Any],
) -> None:
    monkeypatch.setattr(provisional, "SWEEP_INTERVAL_S", 0.2)
    options = {**NO_SWEEP_THREAD, "sync_interval_s": 10.0}
    proc, _ = _start(SIMPLE_WRITER, tmp_path / "s", options)
    writers.append(proc)
    with ucm_db.open(tmp_path / "s", **options) as store:  # the writer lives: nothing swept at open
        _kill(proc)
        assert _wait(lambda: not _markers(store), timeout_s=10 * provisional.SWEEP_INTERVAL_S), "no sweep ran"
