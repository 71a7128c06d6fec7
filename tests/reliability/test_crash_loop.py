"""Crash loop: SIGKILL random processes sharing one LMDB store under capacity
pressure, check an oracle.

Several writer processes put chains (in one or two segments, the second
naming its parent) into a store far smaller than what they write, so puts
evict all the time; now and then a writer puts a chain larger than the
whole capacity, which must be refused (StoreFullError) with nothing stored.
Reader processes read back what the store lists, a verifier process runs
``LocalTier.check()`` and verifies every payload's codec checksum, and a
maintainer process runs the CLI's ``verify`` and ``compact`` in a loop, half
of the compactions evicting down to a random target. The test process kills
one of them at a random moment (inside puts and their evictions, reads and
their LRU touches, compactions), starts a new one in its place (which
reopens the store), and every few cycles a fresh checker process compares
the store with the oracle (:class:`~.harness.EvictionRule`).

Pass criteria (RocksDB crash-test style, with an expected-state oracle):
    * 0 acknowledged blocks lost: a missing acknowledged block must be one
      an eviction could legally have removed (fewer bytes than the capacity,
      or than a running compaction's target, were put or touched after it,
      counting a put's protected ancestors), for durability ``sync`` and
      ``group`` (a process kill must not lose group-committed data);
    * a put that returned stored its whole segment and every ancestor (its
      writer checks right after; a gap no eviction explains is a failure);
      a refused put stored nothing;
    * 0 wrong bytes in any stored block; in-flight blocks absent or whole;
      no block nobody put; no stored block without its parent;
    * every reopen succeeds, the index is consistent (no orphans, totals);
    * evictions happened (the store's counter, at least what the puts
      reported), and acknowledged blocks were protected (strictly checked);
    * progress after kills: a writer killed inside its transaction never
      blocks the next one (acks keep growing; the final put finishes).
"""

from __future__ import annotations

import json
import os
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import ucm_db
from ucm_db import codec

from .harness import (
    NS, STORED_OVERHEAD_BYTES, OracleWriter, chain_tokens, check_store_under_pressure, fork_call, kill_and_reap,
    payload_for, read_failures, read_untouched, record_death, record_failure, run_child, size_for, tail, wait_pid,
)

SIZE_RANGE = (256, 8192)
CAPACITY_BYTES = 1 << 20
MAX_CHAIN_BLOCKS = 6
#: A chain's stored bytes at most (upper bound): what a put's eviction protects.
MAX_CHAIN_BYTES = MAX_CHAIN_BLOCKS * (SIZE_RANGE[1] + STORED_OVERHEAD_BYTES)
#: Blocks of a chain that cannot fit: ~2.5 MiB raw, ~1.7 MiB stored.
OVERSIZE_BLOCKS = 600
OVERSIZE_SHARE = 0.01
#: Keys a reader reads through the Store API every other round (touching them).
TOUCHED_PER_READ = 4
#: Writers alone at the end of a loop (see CrashLoop.quiet_ending), at
#: least this long. With group durability a put may wait for a sync once
#: the shared file grew by ``sync_bytes`` beyond its own payload
#: (ucm_db/store/background.py; about a dozen waits per loop here), and a
#: restarted writer must open the store first: 0.5 s once left no
#: acknowledged block after the last compaction in a full suite run, so the
#: oracle had nothing to check strictly. Hence the acks below, not a longer time.
QUIET_S = 1.0
#: Puts each writer acknowledges in each half of the quiet ending, however
#: long that takes on a slow machine: what the final check holds strictly.
QUIET_ACKS = 3
#: A writer that acknowledges nothing for this long is stuck (a put blocked
#: behind a killed writer's transaction): a failure, not a slow machine
#: (a put waits at most GROWTH_WAIT_S, 30 s, for a sync).
QUIET_DEADLINE_S = 60.0
#: Chain length of the oracle's own test (fewer, larger puts).
TEETH_CHAIN_BLOCKS = 8
STORE_OPTIONS: dict[str, Any] = {"capacity_bytes": CAPACITY_BYTES, "sync_interval_s": 0.2, "map_size_bytes": 4 << 20}

pytestmark = [pytest.mark.crash, pytest.mark.multiprocess]


def open_store(store_path: Path, durability: str) -> ucm_db.Store:
    return ucm_db.open(store_path, durability=durability, **STORE_OPTIONS)


def writer_main(run_dir: Path, store_path: Path, durability: str, wid: int) -> None:
    store = open_store(store_path, durability)
    oracle = OracleWriter(run_dir / f"oracle-w{wid}-{os.getpid()}.log")
    for n in range(10**9):
        label = f"w{wid}-{os.getpid()}-{n}"
        if random.random() < OVERSIZE_SHARE:
            put_oversize(run_dir, store, oracle, label)
            continue
        n_blocks = random.randint(1, MAX_CHAIN_BLOCKS)
        keys = NS.block_keys(chain_tokens(label, n_blocks))
        cut = random.randint(1, n_blocks)
        for segment, parent, end in ((keys[:cut], None, cut), (keys[cut:], keys[cut - 1], n_blocks)):
            if not segment:
                continue
            data = [payload_for(k, size_for(k, *SIZE_RANGE)) for k in segment]
            oracle.intent(segment, parent=parent, timed=True)
            try:
                result = store.put(NS, segment, data, parent=parent)
            except ucm_db.MissingAncestorError:
                # The first segment, acknowledged a moment ago, is gone: the
                # oracle decides whether an eviction explains it.
                oracle.refused(segment)
                oracle.missing_after_ack([parent] if parent is not None else [])
                break
            oracle.ack(segment, evicted=result.evicted)
            # A put that returned stored its segment and every ancestor.
            chain = list(keys[:end])
            missing = [k for k, here in zip(chain, store._tier.exists(chain)) if not here]
            if missing:
                oracle.missing_after_ack(missing)
        if random.random() < 0.2:
            time.sleep(random.uniform(0, 0.003))


def put_oversize(run_dir: Path, store: ucm_db.Store, oracle: OracleWriter, label: str) -> None:
    """A chain larger than the capacity: refused, nothing stored."""
    keys = NS.block_keys(chain_tokens(label, OVERSIZE_BLOCKS))
    data = [payload_for(k, size_for(k, *SIZE_RANGE)) for k in keys]
    oracle.intent(keys, timed=True, oversize=True)
    try:
        store.put(NS, keys, data)
    except ucm_db.StoreFullError:
        oracle.refused(keys)
        return
    record_failure(run_dir, "writer: a chain larger than the capacity was accepted", first=keys[0].hex())


def reader_main(run_dir: Path, store_path: Path, durability: str) -> None:
    """Reads listed blocks through the Store API (which touches them: each
    read is logged as a touch window). A listed block may be evicted before
    it is read (a miss); it is never wrong."""
    store = open_store(store_path, durability)
    oracle = OracleWriter(run_dir / f"oracle-r-{os.getpid()}.log")
    while True:
        listed = list(store._tier.iterate())
        sample = random.sample(listed, min(32, len(listed)))
        # A few keys through the Store API (LRU touches: each touch makes a
        # block and its ancestors newer, which the oracle must then allow to
        # outlive newer puts), the rest below it (no touch).
        touched = sample[:TOUCHED_PER_READ] if random.random() < 0.5 else []
        oracle.touch_open(touched)
        values = store.get(NS, touched)
        if touched:
            store.lookup(NS, touched)
        oracle.touch_close()
        values += read_untouched(store, sample[len(touched):])
        for key, value in zip(sample, values):
            if isinstance(value, str) or value is not None and bytes(value) != payload_for(key, size_for(key, *SIZE_RANGE)):
                record_failure(run_dir, "reader: wrong bytes", key=key.hex())
        time.sleep(0.01)


def verifier_main(run_dir: Path, store_path: Path, durability: str) -> None:
    """Index check plus codec verification of every payload, in a loop."""
    store = open_store(store_path, durability)
    while True:
        for problem in store._tier.check():
            record_failure(run_dir, "verifier: index problem", problem=problem)
        keys = list(store._tier.iterate())
        for start in range(0, len(keys), 512):
            batch = keys[start : start + 512]

            def visit(i: int, head: memoryview, body: memoryview, batch: list[bytes] = batch) -> str | None:
                try:
                    codec.verify_parts(head, body, batch[i])
                    return None
                except ucm_db.CorruptBlockError as exc:
                    return str(exc)

            for key, error in zip(batch, store._tier.read_blocks(batch, visit)):
                if error is not None:
                    record_failure(run_dir, "verifier: corrupt payload", key=key.hex(), error=error)
        time.sleep(0.01)


def maintainer_main(run_dir: Path, store_path: Path, durability: str) -> None:
    """The real CLI in a loop: ``ucm-db verify --sample`` and ``ucm-db
    compact`` (its transactional steps; the file rewrite is skipped while
    other processes have the store open), every other compaction evicting
    down to a random target (logged: the oracle allows its evictions). No
    Store is open in this process: LMDB allows one environment per path and
    process, and the CLI opens its own."""
    from click.testing import CliRunner

    from ucm_db.tools.cli import cli

    runner = CliRunner()
    oracle = OracleWriter(run_dir / f"oracle-m-{os.getpid()}.log")
    while True:
        target = random.randint(CAPACITY_BYTES // 2, CAPACITY_BYTES) if random.random() < 0.5 else None
        compact = ["compact", str(store_path), "--json"] + (["--target-bytes", str(target)] if target is not None else [])
        for args in (["verify", str(store_path), "--json", "--sample", "64"], compact):
            if args is compact and target is not None:
                oracle.evict_open(target)
            result = runner.invoke(cli, args)
            if args is compact and target is not None:
                oracle.evict_close()
            if result.exit_code != 0:
                record_failure(run_dir, f"maintainer: ucm-db {args[0]} exit {result.exit_code}", output=result.output[-1500:])
        time.sleep(0.02)


def checker_main(run_dir: Path, store_path: Path, durability: str, final: bool, out: Path) -> None:
    """Reopens the store (must succeed) and compares it with the oracle."""
    with open_store(store_path, durability) as store:
        report = check_store_under_pressure(store, run_dir, size_range=SIZE_RANGE, capacity_bytes=CAPACITY_BYTES,
                                           max_chain_bytes=MAX_CHAIN_BYTES, final=final)
        if final:  # one more writer after all the kills: the write lock is free
            keys = NS.block_keys(chain_tokens("final-put", 3))
            store.put(NS, keys, [payload_for(k, size_for(k, *SIZE_RANGE)) for k in keys])
            report["final_put_lookup"] = store.lookup(NS, keys)
    out.write_text(json.dumps(report))


def run_checker(run_dir: Path, store_path: Path, durability: str, *, final: bool) -> dict[str, Any]:
    out = run_dir / "check.json"
    out.unlink(missing_ok=True)
    log = run_dir / "checker.log"
    status = run_child(checker_main, run_dir, store_path, durability, final, out, log_path=log, timeout_s=180)
    assert status == 0, f"reopen/check failed (status {status}):\n{tail(log)}"
    report: dict[str, Any] = json.loads(out.read_text())
    assert report["n_lost"] == 0, f"acknowledged blocks lost (no eviction could remove them): {report}"
    assert report["n_wrong"] == 0, f"wrong bytes stored: {report}"
    assert report["n_unknown"] == 0, f"blocks nobody put: {report}"
    assert report["refused_present"] == [], f"a refused put stored blocks: {report}"
    assert report["unexplained_missing_after_ack"] == [], f"a put returned without its chain stored: {report}"
    assert report["index_problems"] == [] and report["orphans"] == [], f"index inconsistent: {report}"
    assert report["quarantined"] == 0, report
    assert report["evictions"] >= report["evictions_logged_by_puts"], f"puts report evictions the store did not count: {report}"
    return report


def _ack_lines(path: Path) -> list[dict[str, str]]:
    """The ``t=``/``e=`` fields of each whole ack line of an oracle log."""
    try:
        complete = path.read_bytes().rpartition(b"\n")[0]
    except FileNotFoundError:
        return []
    return [dict(t.split("=", 1) for t in line.decode().split(" ")[1:] if "=" in t)
            for line in complete.split(b"\n") if line.startswith(b"A ")]


def acks_since(path: Path, since_ns: int) -> int:
    """Puts the oracle log at ``path`` acknowledged after ``since_ns``."""
    return sum(int(fields.get("t", 0)) > since_ns for fields in _ack_lines(path))


def puts_evicted(run_dir: Path) -> bool:
    """Whether any writer's put has reported evicting blocks."""
    return any(int(fields.get("e", 0)) > 0 for path in run_dir.glob("oracle-w*.log") for fields in _ack_lines(path))


class CrashLoop:
    """The processes of one crash loop and the kills done to them."""

    def __init__(self, run_dir: Path, durability: str, *, writers: int = 3, readers: int = 2) -> None:
        self.run_dir = run_dir
        self.store_path = run_dir / "store"
        self.durability = durability
        self.roles: dict[str, tuple[Any, tuple[Any, ...]]] = {"verifier": (verifier_main, ()), "maintainer": (maintainer_main, ())}
        self.roles.update({f"writer{i}": (writer_main, (i,)) for i in range(writers)})
        self.roles.update({f"reader{i}": (reader_main, ()) for i in range(readers)})
        self.pids: dict[str, int] = {}
        self.kills: Counter[str] = Counter()

    def start(self, role: str) -> None:
        fn, extra = self.roles[role]
        args = (self.run_dir, self.store_path, self.durability, *extra)
        self.pids[role] = fork_call(fn, *args, log_path=self.run_dir / f"{role}.log")

    def assert_all_alive(self) -> None:
        for role, pid in list(self.pids.items()):
            status = wait_pid(pid, 0)
            if status is not None:
                del self.pids[role]
            assert status is None, f"{role} died on its own (status {status}):\n{tail(self.run_dir / f'{role}.log')}"

    def kill(self, role: str) -> None:
        pid = self.pids.pop(role)
        kill_and_reap(pid)
        record_death(self.run_dir, pid)
        self.kills[role.rstrip("0123456789")] += 1

    def quiet_ending(self, rng: random.Random) -> None:
        """Ends with writers alone (one killed half-way), each half at least
        :data:`QUIET_S` / 2 and until every writer acknowledged
        :data:`QUIET_ACKS` puts in it, the last half also until some put
        reported an eviction: with no touches or compactions after them,
        the last acknowledged blocks are protected by LRU order alone, so
        the final check holds them strictly (see
        :class:`~.harness.EvictionRule`)."""
        for role in [r for r in self.pids if not r.startswith("writer")]:
            self.kill(role)
        self.writers_alone(QUIET_S / 2)
        self.kill(rng.choice(sorted(self.pids)))
        self.writers_alone(QUIET_S / 2, until_evicted=True)

    def writers_alone(self, min_s: float, *, until_evicted: bool = False) -> None:
        """Lets the writers run for ``min_s`` and until each acknowledged
        :data:`QUIET_ACKS` puts since (and, ``until_evicted``, a put reported
        evicting): a slow machine gets more time, never an empty window."""
        since_ns = time.time_ns()
        time.sleep(min_s)
        deadline = time.monotonic() + QUIET_DEADLINE_S
        while True:
            self.assert_all_alive()
            acks = {role: acks_since(self.run_dir / f"oracle-w{role.removeprefix('writer')}-{pid}.log", since_ns)
                    for role, pid in self.pids.items()}
            if min(acks.values()) >= QUIET_ACKS and not (until_evicted and not puts_evicted(self.run_dir)):
                return
            assert time.monotonic() < deadline, f"writers alone acknowledged too little in {QUIET_DEADLINE_S} s: {acks}"
            time.sleep(0.05)

    def stop_all(self) -> None:
        for role in list(self.pids):
            try:
                self.kill(role)
            except BaseException:  # noqa: BLE001 - kill the rest regardless
                pass


def crash_loop(run_dir: Path, durability: str, cycles: int, max_delay_s: float = 0.15, checkpoint_every: int = 25) -> dict[str, Any]:
    rng = random.Random(int.from_bytes(os.urandom(8), "little"))
    loop = CrashLoop(run_dir, durability)
    # Create the store once so that the first processes race only on use.
    assert run_child(lambda: open_store(loop.store_path, durability).close(), log_path=run_dir / "create.log", timeout_s=60) == 0
    for role in loop.roles:
        loop.start(role)
    acked_before = -1
    started = time.monotonic()
    try:
        for cycle in range(1, cycles + 1):
            time.sleep(rng.uniform(0.005, max_delay_s))
            loop.assert_all_alive()
            victim = rng.choice(sorted(loop.roles))
            loop.kill(victim)
            loop.start(victim)
            if cycle % checkpoint_every == 0:
                report = run_checker(run_dir, loop.store_path, durability, final=False)
                assert report["acked"] > acked_before, f"no write acknowledged since the last checkpoint: writers blocked? {report}"
                acked_before = report["acked"]
        loop.assert_all_alive()
        loop.quiet_ending(rng)
    finally:
        loop.stop_all()
    failures = read_failures(run_dir)
    assert failures == [], f"{len(failures)} failures seen by readers/verifier, first: {failures[:5]}"
    report = run_checker(run_dir, loop.store_path, durability, final=True)
    assert report["final_put_lookup"] == 3
    # The loop ran under pressure, and the oracle still had teeth.
    assert report["evictions"] > 0 and report["evictions_logged_by_puts"] > 0, report
    assert report["strictly_checked"] > 0, report
    report.update(cycles=cycles, kills=dict(loop.kills), seconds=round(time.monotonic() - started, 1))
    print(f"\ncrash loop durability={durability}: {json.dumps(report)}")
    return report


@pytest.mark.parametrize("durability", ["sync", "group"])
def test_crash_loop(tmp_path: Path, durability: str) -> None:
    report = crash_loop(tmp_path, durability, cycles=70, max_delay_s=0.08)  # 2000 with --long
    assert sum(report["kills"].values()) >= 70 + 7
    assert report["acked"] > 0


@pytest.mark.long
@pytest.mark.parametrize("durability", ["sync", "group"])
def test_crash_loop_long(tmp_path: Path, durability: str) -> None:
    report = crash_loop(tmp_path, durability, cycles=2000, max_delay_s=0.25, checkpoint_every=100)
    assert sum(report["kills"].values()) >= 2000 + 7


def test_eviction_oracle_flags_what_no_eviction_explains(tmp_path: Path) -> None:
    """The oracle's teeth, on a real store in one process: a block deleted
    behind the oracle's back is lost if fewer than a capacity's bytes came
    after it, legally evicted if more did; a gap right after a put is
    flagged unless later puts explain it."""
    with ucm_db.open(tmp_path / "store", durability="sync", **STORE_OPTIONS) as store:
        oracle = OracleWriter(tmp_path / "oracle-w0-1.log")
        chains = []
        for n in range(120):  # ~4 MB raw: the first chains fall out of the LRU window
            keys = NS.block_keys(chain_tokens(f"teeth-{n}", TEETH_CHAIN_BLOCKS))
            oracle.intent(keys, timed=True)
            result = store.put(NS, keys, [payload_for(k, size_for(k, *SIZE_RANGE)) for k in keys])
            oracle.ack(keys, evicted=result.evicted)
            chains.append(keys)
        old, recent = chains[0], chains[-3]
        assert store.delete(NS, [recent[-1]]) == 1  # lost: only two chains came after it
        oracle.missing_after_ack([chains[-1][0]])  # claimed gap right after the last put
        report = check_store_under_pressure(store, tmp_path, size_range=SIZE_RANGE, capacity_bytes=CAPACITY_BYTES,
                                            max_chain_bytes=TEETH_CHAIN_BLOCKS * (SIZE_RANGE[1] + STORED_OVERHEAD_BYTES), final=True)
    assert report["evictions"] > 0 and not store_has(tmp_path, old), "the first chain was evicted by the puts after it"
    assert report["lost"] == [recent[-1].hex()], report
    assert report["unexplained_missing_after_ack"] == [chains[-1][0].hex()], report
    assert report["strictly_checked"] > 100 and report["n_wrong"] == 0 and report["orphans"] == [], report


def store_has(tmp_path: Path, keys: list[bytes]) -> bool:
    with ucm_db.open(tmp_path / "store", durability="sync", **STORE_OPTIONS) as store:
        return all(store._tier.exists(list(keys)))
