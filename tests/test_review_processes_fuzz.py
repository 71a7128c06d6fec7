"""Seeded multi-process fuzz of one LMDB store: 2-4 child processes (``tests/review_processes_child.py``) run
random puts, gets, get_into, lookups, lookup_many, deletes, quarantines, pins, flushes and reopens on one
store in ``tmp_path`` while this test SIGKILLs them at random moments (often right after a ``putgo``: in a
put; or any child, one opening the store included), restarts some, and now and then reads through a
read-only store (open all round, or opened then) or runs ``maintenance.verify`` beside them. Each child
reports its intents and acknowledgements on its stdout pipe; the test keeps a model from them. Options
drawn per seed: codec, sync_interval_s, max_readers (8 or 1024), check_on_open, encode_threads.

Invariants, per seed (durability ``sync`` or ``group``, codec, 1 MiB capacity so eviction runs, or 64 MiB
so it never does):
    * every get/get_into in a child and in a read-only or final store returns exactly the key's derived
      bytes or a miss (get_into leaves a buffer's tail alone, slabs take only blocks of their size); one
      lookup_many snapshot counts consistently (a chain's prefix, a sibling chain); a long chain that children
      cut and put back reads only at a prefix some commit left (at 64 MiB); no child reports an unexpected
      error or hangs (every wait bounded);
    * once every child is dead or done: a stored block's parent is stored; lookup and lookup_many equal the
      stored prefix of every chain; a put acknowledged before a SIGKILL is still stored (docs/storage.md: a
      killed process loses nothing committed, with ``group`` too) unless eviction could take it (1 MiB
      seeds: only pinned blocks must stay) or a delete, a quarantine without recheck (or a pin's unpin)
      was ever asked on its line; a quarantine with recheck never removes a readable block;
    * stats blocks and raw_bytes (the store's and the namespace's) equal the stored blocks' count and derived
      sizes; stored bytes within capacity, pinned within max_pinned_bytes, at least the live pins' blocks
      pinned; no evictions at 64 MiB, and at 1 MiB at least one per acknowledged block gone that no
      removal was asked of;
    * at the end the store opens writable; alone on it, a quarantine with recheck keeps readable blocks and a
      delete removes exactly its key's stored subtree; ``verify`` reports no corrupt block, no index problem.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import ucm_db
from review_processes_child import BRANCHES, DEPTH, LONG, NS, chain, payload, size_of
from ucm_db.maintenance import verify

pytestmark = [pytest.mark.crash, pytest.mark.multiprocess]

CHILD = Path(__file__).with_name("review_processes_child.py")
#: Every path of the key tree (in order: neighbours share their longest prefix), its keys, each key's parent,
#: and the deepest chains.
PATHS = sorted(p for d in range(1, DEPTH + 1) for p in itertools.product(range(BRANCHES), repeat=d))
KEY_OF = {p: chain(p)[-1] for p in PATHS}
ALL_KEYS = list(KEY_OF.values()) + list(LONG)
PARENT_OF = {KEY_OF[p]: (KEY_OF[p[:-1]] if len(p) > 1 else None) for p in PATHS} | {
    k: (LONG[i - 1] if i else None) for i, k in enumerate(LONG)}
TREE_LEAVES = [p for p in PATHS if len(p) == DEPTH]
LEAF_CHAINS = [chain(p) for p in TREE_LEAVES] + [LONG]
SMALL_CAPACITY_BYTES, LARGE_CAPACITY_BYTES = 1 << 20, 64 << 20
ROUND_LINES, FINAL_OPS, MAX_KILLS = 200, 40, 4
KILL_IN_PUT_P, KILL_P, RESTART_P, LIVE_CHECK_P = 0.08, 0.01, 0.7, 0.03
#: No child legitimately runs this long without its round ending (a put waits at most 30 s for a sync).
ROUND_DEADLINE_S = 60.0

# seed, durability, evicting (1 MiB) or not (64 MiB), children
CASES = [(1, "sync", False, 3), (2, "group", True, 2), (3, "sync", True, 4), (4, "group", False, 3),
         (5, "sync", False, 2), (6, "group", True, 3), (7, "sync", True, 2), (8, "group", False, 4),
         (9, "sync", True, 3), (10, "group", False, 2)]


def ancestry(key: bytes | None) -> Iterator[bytes]:
    """``key`` and every ancestor of it in the tree."""
    while key is not None:
        yield key
        key = PARENT_OF[key]


@dataclass
class Model:
    """What the children acknowledged, and every key a removal was ever asked of."""

    acked: set[bytes] = field(default_factory=set)
    doomed: set[bytes] = field(default_factory=set)  # delete or no-recheck quarantine targets (intents)
    pins: dict[bytes, set[bytes]] = field(default_factory=dict)  # a pinned chain's last key -> keys it pinned
    unpinned: set[bytes] = field(default_factory=set)  # last keys an unpin was ever asked of
    failures: list[str] = field(default_factory=list)

    def feed(self, who: str, line: str) -> None:
        word, *rest = line.split()
        keys = [bytes.fromhex(w) for w in rest if len(w) == 64]
        if word == "put":
            self.acked.update(keys)
        elif word == "delgo" or (word == "qgo" and rest[1] == "0"):
            self.doomed.add(keys[0])
        elif word == "pin":
            self.pins.setdefault(keys[0], set()).update(keys[1:])
            self.acked.update(keys[1:])
        elif word == "unpingo":
            self.unpinned.add(keys[0])
        elif word in ("bad", "error"):
            self.failures.append(f"{who}: {line}")

    def removable(self, key: bytes) -> bool:
        return any(k in self.doomed for k in ancestry(key))

    def live_pinned(self) -> set[bytes]:
        """Blocks of pins no unpin, delete or quarantine was ever asked of."""
        return {k for last, keys in self.pins.items() if last not in self.unpinned and not self.removable(last)
                for k in keys}

    def must_be_stored(self, evicting: bool) -> set[bytes]:
        """Acknowledged blocks no removal could have taken: without eviction every one; with it the pinned."""
        return self.live_pinned() if evicting else {k for k in self.acked if not self.removable(k)}


class Children:
    """The child processes of one store, their pipes, and what each has said so far."""

    def __init__(self, path: Path, options: dict[str, Any], log_dir: Path) -> None:
        self.path, self.options, self.log_dir = path, options, log_dir
        self.selector = selectors.DefaultSelector()
        self.partial: dict[int, bytes] = {}
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.killed: set[int] = set()

    def spawn(self, seed: int, ops: int) -> None:
        cfg = {"path": str(self.path), "options": self.options, "seed": seed, "ops": ops,
               "evicting": self.options["capacity_bytes"] == SMALL_CAPACITY_BYTES}
        with open(self.log_dir / f"child-{seed}.err", "wb") as err:
            proc = subprocess.Popen([sys.executable, str(CHILD), json.dumps(cfg)], stdout=subprocess.PIPE,
                                    stderr=err)
        assert proc.stdout is not None
        os.set_blocking(proc.stdout.fileno(), False)
        self.selector.register(proc.stdout, selectors.EVENT_READ, proc)
        self.procs[proc.pid], self.partial[proc.pid] = proc, b""

    def kill(self, proc: subprocess.Popen[bytes]) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        self.killed.add(proc.pid)

    def kill_all(self) -> None:
        for proc in self.procs.values():
            self.kill(proc)

    def close(self) -> None:
        """Kills and reaps whatever still runs (a failed test leaves no process behind)."""
        self.kill_all()
        for proc in list(self.procs.values()):
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
            if proc.stdout is not None:
                proc.stdout.close()
        self.procs.clear()

    def lines(self, deadline: float) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
        """Every line any child writes, until every child's pipe closed (then each is reaped and checked)."""
        while self.procs:
            remaining = deadline - time.monotonic()
            events = self.selector.select(timeout=max(remaining, 0))
            if not events and time.monotonic() >= deadline:
                self.kill_all()
                pytest.fail(f"children hung: pids {sorted(self.procs)} said nothing for {ROUND_DEADLINE_S} s")
            for selected, _ in events:
                proc: subprocess.Popen[bytes] = selected.data
                chunk = os.read(selected.fd, 1 << 16)
                if not chunk:
                    self.reap(proc)
                    continue
                *whole, self.partial[proc.pid] = (self.partial[proc.pid] + chunk).split(b"\n")
                yield from ((proc, line.decode()) for line in whole)

    def reap(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        self.selector.unregister(proc.stdout)
        proc.stdout.close()
        rc = proc.wait(timeout=30)
        del self.procs[proc.pid]
        allowed = (0, -signal.SIGKILL) if proc.pid in self.killed else (0,)
        assert rc in allowed, f"child {proc.pid} exited {rc}: {self.stderr_tail()}"

    def stderr_tail(self) -> str:
        return " | ".join(p.read_text()[-1500:] for p in sorted(self.log_dir.glob("child-*.err")) if p.stat().st_size)


def run_round(children: Children, model: Model, rng: random.Random, *, line_budget: int | None, kill_p: float,
              restarts: int, live_checks: bool, reader: ucm_db.Store | None = None) -> None:
    """Feeds the model every line; kills (and restarts) children at random; ends after ``line_budget``
    lines by killing the rest, or (None) once every child finished."""
    kills, seen = 0, 0
    for proc, line in children.lines(time.monotonic() + ROUND_DEADLINE_S):
        model.feed(str(proc.pid), line)
        seen += 1
        if proc.pid in children.killed:
            continue
        if line_budget is not None and seen >= line_budget:
            children.kill_all()
        elif kills < MAX_KILLS and rng.random() < (KILL_IN_PUT_P if line.startswith("putgo") else kill_p):
            # in its put, or anywhere in another (opening the store, just restarted, say)
            alive = sorted(pid for pid in children.procs if pid not in children.killed)
            victim = proc.pid if line.startswith("putgo") or rng.random() < 0.5 else rng.choice(alive)
            children.kill(children.procs[victim])
            kills += 1
            if restarts and rng.random() < RESTART_P:
                restarts -= 1
                children.spawn(rng.randrange(1 << 30), 400 if line_budget is not None else FINAL_OPS)
        elif live_checks and rng.random() < LIVE_CHECK_P:
            check_beside_writers(children.path, rng, reader)


def stored_prefix(keys: list[bytes], stored: set[bytes]) -> int:
    n = 0
    while n < len(keys) and keys[n] in stored:
        n += 1
    return n


def read_all(store: ucm_db.Store) -> set[bytes]:
    """The stored keys of the tree; every one read must hold exactly its derived bytes."""
    got = store.get(NS, ALL_KEYS)
    wrong = [k.hex()[:16] for k, g in zip(ALL_KEYS, got) if g is not None and bytes(g) != payload(k)]
    assert not wrong, f"blocks read with bytes that are not their payload: {wrong}"
    return {k for k, g in zip(ALL_KEYS, got) if g is not None}


def check_one_snapshot(counts: list[int]) -> None:
    """Leaf chains sharing their first ``j`` blocks agree on those (one lookup_many snapshot)."""
    for (a, ca), (b, cb) in zip(zip(TREE_LEAVES, counts), zip(TREE_LEAVES[1:], counts[1:])):
        shared = next((i for i in range(DEPTH) if a[i] != b[i]), DEPTH)
        assert min(ca, shared) == min(cb, shared), f"one snapshot: {a}:{ca} and {b}:{cb} share {shared} blocks"


def check_beside_writers(path: Path, rng: random.Random, reader: ucm_db.Store | None) -> None:
    """While children write, reads through the read-only store open all round (a store opens once per
    process), or through one opened now, or a verify: exact bytes or misses, one snapshot's counts agree,
    nothing damaged."""
    if reader is not None or rng.random() < 0.5:
        with contextlib.nullcontext(reader) if reader is not None else ucm_db.open(path, read_only=True) as store:
            read_all(store)
            check_one_snapshot(store.lookup_many(NS, LEAF_CHAINS))
    else:
        report = verify(path)
        assert not report.problems, f"verify beside writers: {report.to_dict()}"


def check_settled(store: ucm_db.Store, model: Model, evicting: bool) -> None:
    """Every child dead or done: prefix invariant, lookups, acknowledged puts kept, stats totals."""
    stored = read_all(store)
    orphans = [k.hex()[:16] for k in stored if PARENT_OF[k] is not None and PARENT_OF[k] not in stored]
    assert not orphans, f"stored blocks whose parent is not stored: {orphans}"
    expected = [stored_prefix(c, stored) for c in LEAF_CHAINS]
    assert store.lookup_many(NS, LEAF_CHAINS) == expected
    assert [store.lookup(NS, c, remote=False) for c in LEAF_CHAINS[::7]] == expected[::7]
    lost = model.must_be_stored(evicting) - stored
    assert not lost, f"{len(lost)} acknowledged blocks lost after SIGKILLs: {sorted(k.hex()[:16] for k in lost)}"
    stats = store.stats()
    assert (stats.blocks, stats.raw_bytes) == (len(stored), sum(size_of(k) for k in stored)), stats.to_dict()
    ns_stats = stats.namespaces.get(NS.id.hex())
    assert (ns_stats.blocks, ns_stats.raw_bytes, ns_stats.stored_bytes) == (
        stats.blocks, stats.raw_bytes, stats.stored_bytes) if ns_stats else not stored, stats.to_dict()
    assert stats.stored_bytes <= stats.capacity_bytes and stats.pinned_bytes <= stats.max_pinned_bytes, stats.to_dict()
    assert (ns_stats.pinned_blocks if ns_stats else 0) >= len(model.live_pinned()), stats.to_dict()
    if not evicting:
        assert stats.evictions == 0, f"evictions at {LARGE_CAPACITY_BYTES} bytes: {stats.evictions}"
    gone = {k for k in model.acked if not model.removable(k)} - stored  # only an eviction takes these
    assert stats.evictions >= len(gone), f"{len(gone)} acknowledged blocks gone, {stats.evictions} evictions"


def probe_writes(store: ucm_db.Store, model: Model, rng: random.Random) -> None:
    """Alone on the store: a quarantine with recheck keeps readable blocks; a delete removes exactly the stored
    subtree of its key and says how many."""
    stored = read_all(store)
    for key in rng.sample(sorted(stored), min(3, len(stored))):
        assert store.quarantine(key, "review", recheck=True) is False, f"readable {key.hex()[:16]} quarantined"
    deep = sorted(k for k in stored if PARENT_OF[k] is not None)
    if deep:
        key = rng.choice(deep)
        subtree = {k for k in stored if key in ancestry(k)}
        model.doomed.add(key)
        assert store.delete(NS, [key]) == len(subtree)
        assert read_all(store) == stored - subtree


@pytest.mark.parametrize(("seed", "durability", "evicting", "n_children"), CASES)
def test_children_killed_at_random_keep_the_store_right(
    tmp_path: Path, seed: int, durability: str, evicting: bool, n_children: int,
) -> None:
    rng, model, path = random.Random(seed), Model(), tmp_path / "store"
    options = {"durability": durability, "codec": rng.choice(("zstd", "none")),
               "capacity_bytes": SMALL_CAPACITY_BYTES if evicting else LARGE_CAPACITY_BYTES,
               "sync_interval_s": rng.choice((0.05, 0.2, 1.0)), "max_readers": rng.choice((8, 1024)),
               "check_on_open": rng.choice(("pages", "none")), "encode_threads": rng.choice((0, 2))}
    ucm_db.open(path, **options).close()
    children = Children(path, options, tmp_path)
    try:
        for _ in range(n_children):
            children.spawn(rng.randrange(1 << 30), 400)
        with ucm_db.open(path, read_only=True) if rng.random() < 0.5 else contextlib.nullcontext() as reader:
            run_round(children, model, rng, line_budget=ROUND_LINES, kill_p=KILL_P, restarts=2, live_checks=True,
                      reader=reader)
        with ucm_db.open(path, read_only=True) as store:
            check_settled(store, model, evicting)
        for _ in range(rng.randint(2, n_children)):
            children.spawn(rng.randrange(1 << 30), FINAL_OPS)
        run_round(children, model, rng, line_budget=None, kill_p=KILL_P * 3, restarts=1, live_checks=False)
    finally:
        children.close()
    assert not model.failures, f"children found: {model.failures[:5]} (stderr: {children.stderr_tail()[:3000]})"
    with ucm_db.open(path) as store:
        check_settled(store, model, evicting)
        probe_writes(store, model, rng)
        check_settled(store, model, evicting)
    report = verify(path)
    assert not report.problems, f"verify after the run: {report.to_dict()}"
