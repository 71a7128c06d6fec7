"""Seeded model-based fuzz of ``Store.epoch`` answered from memory while the store saw no commit
(``EpochGate.epoch``, ucm_db/store/epoch_gate.py; LMDB's commit ids read from a map of the meta pages,
ucm_db/engines/lmdb/commit_ids.py), on real LMDB stores in ``tmp_path`` with real child processes.

Each local scenario interleaves, from a fixed seed: ``epoch()`` calls; bumps, puts, lookups, deletes, flushes,
close and reopen (read-only too) here; a long-lived writer child's bumps, puts, deletes, flushes, epoch-record
damage (a commit through its engine) and map growth (a small map doubled), each sent while this process spins
``epoch()`` on its cached answer; the real ``ucm-db invalidate`` and ``ucm-db compact`` beside the open store; a
forked child bumping through the inherited Store. The remote scenarios give two nodes one ``file://`` remote (both
remote modes): the other node (a child) bumps, puts and reopens while this one holds answers, then this one bumps,
reopens or is invalidated through the CLI with ``--remote``.

Invariants, for every ``epoch()`` call (docs/connector.md "Reset and invalidation", connector/epochs.py):
    * never below the last bump acknowledged (committed, by any process: bump_epoch returned) before the call
      began; with a remote, never below the remote's epoch as of this node's last (re)open (first contact);
    * EpochUnknownError while the record is damaged by an acknowledged commit and no bump followed;
    * blocks found under keys rooted at the answer carry that epoch (each payload names the epoch it was keyed
      at), never one below the last acknowledged bump;
    * a bump here answers above every bump acknowledged before it (the fleet's too, with a remote);
    * the commit-id map reads LMDB's own ``last_txnid`` after growth, compaction and reopen.
The review's finding: with durability ``"sync"`` LMDB writes (and fsyncs) a commit's meta page before it hands the
commit to readers (its lock file's txnid), so a read begun in between read the old epoch while the meta page already
named the new commit, and the answer was kept for up to QUICK_RECHECK_S after the bump returned. The two ``sync``
tests reproduced it (strict xfails); they pass since the cache is keyed by the commit its read saw (``seen_by``).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import ucm_db
from ucm_db import Namespace
from ucm_db.store.epochs import EpochUnknownError

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

NS = Namespace(model="test/review-quick-epochs", kv_dtype="bfloat16", block_size=4)
BLOCKS = 3
CHAINS = 6  # chain 0..5: tokens chain*100 + j
GROW_CHAIN = 50  # the map-growth chain: many large blocks
SPIN_LIMIT_S = 60.0
CLI = [sys.executable, "-m", "ucm_db.tools.cli"]
LOCAL_SEEDS = [1, 2, 3]
LONG_LOCAL_SEEDS = list(range(10, 22))
REMOTE_SEEDS = [(1, "write_back"), (2, "write_through")]
LONG_REMOTE_SEEDS = [(s, m) for s in range(10, 16) for m in ("write_back", "write_through")]

#: The writer child: one JSON command per stdin line, one JSON reply per stdout line, after the work is done.
CHILD = r"""
import json, sys
import ucm_db
from ucm_db import Namespace
from ucm_db.store.epochs import EpochUnknownError
path, options, ns = sys.argv[1], json.loads(sys.argv[2]), Namespace(**json.loads(sys.argv[3]))
store = ucm_db.open(path, **options)
def tokens(chain, blocks):
    return [chain * 100 + j for j in range(blocks * 4)]
def run(op, chain):
    global store
    if op == "reopen":
        store.close()
        store = ucm_db.open(path, **options)
        return {"ok": True}
    if op == "bump":
        return {"epoch": store.bump_epoch(ns)}
    if op == "flush":
        store.flush()
        return {"ok": True}
    if op == "damage":
        name = b"epoch:" + ns.id
        store._tier.engine.write(lambda txn: txn.put("info", name, (7).to_bytes(8, "little")))
        return {"ok": True}
    try:
        epoch = store.epoch(ns)
    except EpochUnknownError:
        return {"unknown": True}
    blocks, size = (400, 16384) if op == "grow" else (3, 64)
    keys = ns.block_keys(tokens(chain, blocks), epoch=epoch)
    if op in ("put", "grow"):
        store.put(ns, keys, [f"{epoch}:{chain}:{i}:".encode().ljust(size, b".") for i in range(blocks)])
    elif op == "delete":
        store.delete(ns, keys)
    return {"epoch": epoch}
for line in sys.stdin:
    op, chain = json.loads(line)
    if op == "quit":
        break
    print(json.dumps(run(op, chain)), flush=True)
store.close()
"""


@dataclass
class Expected:
    """What an ``epoch()`` call beginning now must answer: at least ``floor`` (acknowledged bumps, the remote's
    epoch at this node's last open); EpochUnknownError where ``damaged`` and no bump is in flight."""

    floor: int = 0
    damaged: bool = False
    damage_may_land: bool = False  # a damage sent, not acknowledged: raising is allowed
    bump_may_land: bool = False  # a bump sent after a damage: answering is allowed
    calls: int = 0

    def bumped(self, epoch: int) -> None:
        assert epoch > self.floor or self.damaged, f"a bump answered {epoch}, not above {self.floor}"
        self.floor, self.damaged = max(self.floor, epoch), False


def payload(epoch: int, chain: int, index: int) -> bytes:
    return f"{epoch}:{chain}:{index}:".encode().ljust(64, b".")


def chain_keys(epoch: int, chain: int, blocks: int = BLOCKS) -> list[bytes]:
    return NS.block_keys([chain * 100 + j for j in range(blocks * NS.block_size)], epoch=epoch)


def checked_epoch(store: ucm_db.Store, expected: Expected) -> int | None:
    """One ``epoch()`` call checked against what was acknowledged before it began; None: unknown (allowed)."""
    floor, damaged, in_flight = expected.floor, expected.damaged, expected.damage_may_land or expected.bump_may_land
    expected.calls += 1
    try:
        got = store.epoch(NS)
    except EpochUnknownError:
        assert damaged or expected.damage_may_land, f"EpochUnknownError with an intact record (floor {floor})"
        return None
    assert not damaged or in_flight, f"answered {got} with the record damaged by an acknowledged commit"
    assert got >= floor, f"answered {got} after a bump to {floor} was acknowledged (call {expected.calls})"
    return got


def served_epochs(store: ucm_db.Store, epoch: int, chain: int) -> set[int]:
    """The epochs named by the payloads a reader keyed at ``epoch`` is served for ``chain``."""
    keys = chain_keys(epoch, chain)
    found = store.get(NS, keys[: store.lookup(NS, keys)])
    return {int(bytes(block).split(b":")[0]) for block in found if block is not None}


class Child:
    """A writer process on ``path`` (the CHILD script) whose replies are read without blocking."""

    def __init__(self, path: Path, options: dict[str, Any]) -> None:
        argv = [sys.executable, "-c", CHILD, str(path), json.dumps(options), json.dumps(NS.to_dict())]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._out = self.proc.stdout.fileno()
        os.set_blocking(self._out, False)
        self._buffer = b""

    def send(self, op: str, chain: int = 0) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps([op, chain]).encode() + b"\n")
        self.proc.stdin.flush()

    def reply(self) -> dict[str, Any] | None:
        """The next reply if one arrived (never blocks)."""
        if b"\n" not in self._buffer:
            try:
                chunk = os.read(self._out, 65536)
            except BlockingIOError:
                return None
            assert chunk, f"the writer child died: exit {self.proc.wait()}"
            self._buffer += chunk
        if b"\n" not in self._buffer:
            return None
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.send("quit")
            self.proc.wait(timeout=60)
        assert self.proc.returncode == 0


def spin(store: ucm_db.Store, expected: Expected, done: Callable[[], Any]) -> Any:
    """Calls ``epoch()`` (checked) until ``done()`` answers (not None); its answer."""
    deadline = time.monotonic() + SPIN_LIMIT_S
    while (answer := done()) is None:
        checked_epoch(store, expected)
        assert time.monotonic() < deadline, "another process did not answer in time"
    return answer


def child_op(store: ucm_db.Store, expected: Expected, child: Child, op: str, chain: int = 0, *,
             same_store: bool = True) -> dict[str, Any]:
    """``op`` run by the child while this process spins ``epoch()``; the model takes its acknowledgement
    (``same_store``: the child's store is this one, so its own ``epoch()`` answers are checked too)."""
    expected.damage_may_land, expected.bump_may_land = op == "damage", op == "bump" and expected.damaged
    child.send(op, chain)
    answer: dict[str, Any] = spin(store, expected, child.reply)
    expected.damage_may_land = expected.bump_may_land = False
    if op == "bump" and same_store:
        expected.bumped(answer["epoch"])
    elif op == "damage":
        expected.damaged = True
    elif same_store and "epoch" in answer:
        assert answer["epoch"] >= expected.floor, f"the child answered {answer['epoch']}, floor {expected.floor}"
    for _ in range(3):
        checked_epoch(store, expected)
    return answer


def process_op(store: ucm_db.Store, expected: Expected, argv: list[str]) -> dict[str, Any]:
    """A real ``ucm-db`` command beside the open store while this process spins ``epoch()``; its JSON."""
    proc = subprocess.Popen([*CLI, *argv, "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    expected.bump_may_land = argv[0] == "invalidate" and expected.damaged
    spin(store, expected, proc.poll)
    expected.bump_may_land = False
    out, err = proc.communicate()
    assert proc.returncode == 0, err
    return json.loads(out)


def forked_bump(store: ucm_db.Store, expected: Expected) -> None:
    """A forked child answers ``epoch()`` from the inherited Store, then bumps; this process spins meanwhile."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the inherited store, its cached answer included
        try:
            before = store.epoch(NS)
            os.write(write_end, json.dumps([before, store.bump_epoch(NS)]).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    spin(store, expected, lambda: None if os.waitpid(pid, os.WNOHANG) == (0, 0) else True)
    before, bumped = json.loads(os.read(read_end, 4096))
    os.close(read_end)
    assert before >= expected.floor or expected.damaged
    expected.bumped(bumped)
    checked_epoch(store, expected)


def check_commit_ids(store: ucm_db.Store) -> None:
    """The store's own meta-page map (``StoreState._commit_ids``) reads LMDB's last transaction id."""
    ids = store._state._commit_ids
    assert ids is not None and ids.last() == store._engine._environment().info()["last_txnid"]


def own_op(store: ucm_db.Store, expected: Expected, rng: random.Random, ops: tuple[str, ...]) -> None:
    """One of ``ops`` (bump, put, get, delete, flush) made by this process."""
    op = rng.choice(ops)
    if op == "bump":
        expected.bumped(store.bump_epoch(NS))
        return
    if op == "flush":
        store.flush()
        return
    epoch, chain = checked_epoch(store, expected), rng.randrange(CHAINS)
    if epoch is None:
        return
    if op == "put":
        store.put(NS, chain_keys(epoch, chain), [payload(epoch, chain, i) for i in range(BLOCKS)])
    elif op == "delete":
        store.delete(NS, chain_keys(epoch, chain))
    served = served_epochs(store, epoch, chain)
    assert served <= {epoch} and all(e >= expected.floor for e in served), f"served {served} at {epoch}"


def local_scenario(tmp_path: Path, seed: int, durability: str, steps: int) -> None:
    rng = random.Random(seed)
    path = tmp_path / "s"
    options: dict[str, Any] = {"codec": "none", "durability": durability, "map_size_bytes": 1 << 20}
    expected, read_only = Expected(), False
    store = ucm_db.open(path, **options)
    store.put(NS, chain_keys(0, 0), [payload(0, 0, i) for i in range(BLOCKS)])  # described: invalidate finds it
    child = Child(path, options)
    try:
        for step in range(steps):
            kind = rng.choice(["child"] * 5 + ["own"] * 3 + ["epoch", "reopen", "cli", "fork"])
            if kind == "child":
                op = rng.choice(["bump", "bump", "put", "put", "delete", "flush", "damage", "grow", "reopen"])
                child_op(store, expected, child, op, GROW_CHAIN if op == "grow" else rng.randrange(CHAINS))
                check_commit_ids(store)  # the data file grown, the map resized by the child
            elif kind == "own" and not expected.damaged:
                own_op(store, expected, rng, ("get",) if read_only else ("bump", "put", "get", "delete", "flush"))
            elif kind == "reopen":
                store.close()
                read_only = rng.random() < 0.4
                store = ucm_db.open(path, **options, read_only=read_only)
                check_commit_ids(store)
            elif kind == "cli" and rng.random() < 0.5:
                rows = process_op(store, expected, ["invalidate", str(path), "--namespace", NS.id.hex()])
                expected.bumped(rows["invalidated"][0]["epoch"])
            elif kind == "cli":
                assert process_op(store, expected, ["compact", str(path)])["rewrite"] == "skipped"
            elif kind == "fork" and not read_only and not expected.damaged:
                forked_bump(store, expected)
            for _ in range(rng.randrange(1, 4)):
                checked_epoch(store, expected)
            if expected.damaged and step % 4 == 3:  # repaired: a bump of an unknown epoch takes a fresh one
                child_op(store, expected, child, "bump")
    finally:
        child.close()
        store.close()
    compacted = subprocess.run([*CLI, "compact", str(path), "--json"], check=True, capture_output=True, text=True)
    assert json.loads(compacted.stdout)["rewrite"] == "rewritten"  # a new file, its txnids counted from 1 again
    with ucm_db.open(path, **options) as reopened:
        check_commit_ids(reopened)
        assert checked_epoch(reopened, expected) is not None or expected.damaged


def _params(seeds: list[Any], long: bool) -> list[Any]:
    marks = [pytest.mark.long] if long else []
    return [pytest.param(*(s if isinstance(s, tuple) else (s,)), marks=marks, id="seed" + "-".join(map(str, s))
                         if isinstance(s, tuple) else f"seed{s}") for s in seeds]


@pytest.mark.parametrize("seed", _params(LOCAL_SEEDS, False) + _params(LONG_LOCAL_SEEDS, True))
def test_local_interleavings_never_answer_a_stale_epoch(tmp_path: Path, seed: int) -> None:
    local_scenario(tmp_path, seed, "group", steps=26)


@pytest.mark.parametrize("seed", _params([1], False) + _params([2, 3, 4], True))
def test_local_interleavings_with_sync_durability(tmp_path: Path, seed: int) -> None:
    local_scenario(tmp_path, seed, "sync", steps=40)


def test_a_bump_another_process_committed_is_seen_by_the_next_call(tmp_path: Path) -> None:
    """Durability "sync": a child bumps 60 times, this process spins ``epoch()``; once a bump's ``bump_epoch``
    returned (its line read), no later call may answer below it (the review's repro: every run failed at the
    first bump while the cache was keyed by the meta page's id read before the read)."""
    path, options = tmp_path / "s", {"codec": "none", "durability": "sync"}
    with ucm_db.open(path, **options) as store:
        expected, child = Expected(), Child(path, options)
        try:
            for _ in range(60):
                stale: list[int] = []
                child.send("bump")
                answer = spin(store, expected, child.reply)
                expected.bumped(answer["epoch"])
                stale += [got for got in (store.epoch(NS) for _ in range(20)) if got < expected.floor]
                assert not stale, f"after a bump to {expected.floor} was acknowledged, epoch() answered {stale[:3]}"
        finally:
            child.close()


def remote_scenario(tmp_path: Path, seed: int, mode: str, steps: int) -> None:
    """This node (A) and a child node (B) on one file:// remote; ``fleet``: epochs acknowledged as claimed there."""
    rng = random.Random(seed)
    url = f"file://{tmp_path}/remote"
    options: dict[str, Any] = {"codec": "none", "remote": url, "remote_mode": mode, "remote_deadline_s": 10}
    a_path, b_path = tmp_path / "a", tmp_path / "b"
    a, b = Expected(), Expected()  # b: what node B's own epoch() must answer (checked from its replies)
    fleet = 0
    store = ucm_db.open(a_path, **options)
    store.put(NS, chain_keys(0, 1), [payload(0, 1, i) for i in range(BLOCKS)])
    child = Child(b_path, options)
    try:
        for _ in range(steps):
            kind = rng.choice(["b_bump", "b_bump", "b_put", "b_reopen", "a_bump", "a_put", "a_reopen", "a_cli"])
            if kind == "b_bump":
                fleet = child_op(store, a, child, "bump", same_store=False)["epoch"]  # A learns it at its next open
                b.bumped(fleet)
            elif kind in ("b_put", "b_reopen"):
                answer = child_op(store, a, child, kind[2:], rng.randrange(CHAINS), same_store=False)
                if kind == "b_reopen":
                    b.floor = max(b.floor, fleet)  # first contact: the remote's epoch
                    answer = child_op(store, a, child, "put", rng.randrange(CHAINS), same_store=False)
                assert answer["epoch"] >= b.floor
            elif kind == "a_bump":
                epoch = store.bump_epoch(NS)
                assert epoch > fleet, f"A's bump took {epoch}, not above the fleet's {fleet}"
                a.bumped(epoch)
                fleet = epoch
            elif kind == "a_put":
                own_op(store, a, rng, ("put", "put", "get", "delete"))
            elif kind == "a_reopen":
                store.close()  # never read-only: read_only and remote do not mix (ConfigError)
                store = ucm_db.open(a_path, **options)
                a.floor = max(a.floor, fleet)  # first contact: the remote's epoch
            elif kind == "a_cli":
                rows = process_op(store, a, ["invalidate", str(a_path), "--namespace", NS.id.hex(), "--remote", url])
                assert rows["invalidated"][0]["remote"] == "claimed" and rows["invalidated"][0]["epoch"] > fleet
                fleet = rows["invalidated"][0]["epoch"]
                a.bumped(fleet)
            for _ in range(rng.randrange(1, 4)):
                epoch = checked_epoch(store, a)
                assert epoch is not None and served_epochs(store, epoch, rng.randrange(CHAINS)) <= {epoch}
    finally:
        child.close()
        store.close()


@pytest.mark.parametrize("seed,mode", _params(REMOTE_SEEDS, False) + _params(LONG_REMOTE_SEEDS, True))
def test_two_nodes_sharing_a_remote_never_answer_a_stale_epoch(tmp_path: Path, seed: int, mode: str) -> None:
    remote_scenario(tmp_path, seed, mode, steps=10)
