"""Crash loop: SIGKILL random processes sharing one LMDB store, check an oracle.

Several writer processes put chains (in one or two segments, the second
naming its parent), reader processes read back what the store lists, a
verifier process runs ``LocalTier.check()`` and verifies every payload's
codec checksum, and a maintainer process runs the CLI's ``verify`` and
``compact`` in a loop. The test process kills one of them at a random moment, starts
a new one in its place (which reopens the store), and every few cycles a
fresh checker process compares the store with the writers' intent/ack logs.

Pass criteria (RocksDB crash-test style, with an expected-state oracle):
    * 0 acknowledged blocks lost or wrong, for durability ``sync`` and
      ``group`` (a process kill must not lose group-committed data);
    * in-flight blocks (intent without ack) absent or whole;
    * every reopen succeeds, the index is consistent (no orphans, totals);
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
    NS, OracleWriter, chain_tokens, check_store_against_oracle, fork_call, kill_and_reap, payload_for,
    read_failures, record_failure, run_child, size_for, tail, wait_pid,
)

SIZE_RANGE = (256, 8192)
STORE_OPTIONS: dict[str, Any] = {"capacity_bytes": 4 << 30, "sync_interval_s": 0.2, "map_size_bytes": 4 << 20}

pytestmark = [pytest.mark.crash, pytest.mark.multiprocess]


def open_store(store_path: Path, durability: str) -> ucm_db.Store:
    return ucm_db.open(store_path, durability=durability, **STORE_OPTIONS)


def writer_main(run_dir: Path, store_path: Path, durability: str, wid: int) -> None:
    store = open_store(store_path, durability)
    oracle = OracleWriter(run_dir / f"oracle-{wid}-{os.getpid()}.log")
    for n in range(10**9):
        n_blocks = random.randint(1, 6)
        keys = NS.block_keys(chain_tokens(f"w{wid}-{os.getpid()}-{n}", n_blocks))
        cut = random.randint(1, n_blocks)
        for segment, parent in ((keys[:cut], None), (keys[cut:], keys[cut - 1])):
            if not segment:
                continue
            data = [payload_for(k, size_for(k, *SIZE_RANGE)) for k in segment]
            oracle.intent(segment)
            store.put(NS, segment, data, parent=parent)
            oracle.ack(segment)
        if random.random() < 0.2:
            time.sleep(random.uniform(0, 0.003))


def reader_main(run_dir: Path, store_path: Path, durability: str) -> None:
    """Reads listed blocks: with no deletes and no eviction, a listed block
    must read back whole (never None, never wrong)."""
    store = open_store(store_path, durability)
    while True:
        listed = list(store.tier.iterate())
        sample = random.sample(listed, min(32, len(listed)))
        for key, value in zip(sample, store.get(NS, sample)):
            if value is None:
                record_failure(run_dir, "reader: listed block read as a miss", key=key.hex())
            elif bytes(value) != payload_for(key, size_for(key, *SIZE_RANGE)):
                record_failure(run_dir, "reader: wrong bytes", key=key.hex())
        if sample:
            store.lookup(NS, sample)
        time.sleep(0.002)


def verifier_main(run_dir: Path, store_path: Path, durability: str) -> None:
    """Index check plus codec verification of every payload, in a loop."""
    store = open_store(store_path, durability)
    while True:
        for problem in store.tier.check():
            record_failure(run_dir, "verifier: index problem", problem=problem)
        keys = list(store.tier.iterate())
        for start in range(0, len(keys), 512):
            batch = keys[start : start + 512]

            def visit(i: int, head: memoryview, body: memoryview, batch: list[bytes] = batch) -> str | None:
                try:
                    codec.verify_parts(head, body, batch[i])
                    return None
                except ucm_db.CorruptBlockError as exc:
                    return str(exc)

            for key, error in zip(batch, store.tier.read_blocks(batch, visit)):
                if error is not None:
                    record_failure(run_dir, "verifier: corrupt payload", key=key.hex(), error=error)
        time.sleep(0.01)


def maintainer_main(run_dir: Path, store_path: Path, durability: str) -> None:
    """The real CLI in a loop: ``ucm-db verify --sample`` and ``ucm-db
    compact`` (its transactional steps; the file rewrite is skipped while
    other processes have the store open). No Store is open in this process:
    LMDB allows one environment per path and process, and the CLI opens its
    own."""
    from click.testing import CliRunner

    from ucm_db.tools.cli import cli

    runner = CliRunner()
    while True:
        for args in (["verify", str(store_path), "--json", "--sample", "64"], ["compact", str(store_path), "--json"]):
            result = runner.invoke(cli, args)
            if result.exit_code != 0:
                record_failure(run_dir, f"maintainer: ucm-db {args[0]} exit {result.exit_code}", output=result.output[-1500:])
        time.sleep(0.02)


def checker_main(run_dir: Path, store_path: Path, durability: str, sample: int | None, final: bool, out: Path) -> None:
    """Reopens the store (must succeed) and compares it with the oracle."""
    with open_store(store_path, durability) as store:
        state, report = check_store_against_oracle(store, run_dir, size_range=SIZE_RANGE, sample=sample)
        report["acked"] = len(state.acked)
        report["in_flight"] = len(state.in_flight)
        report["torn_lines"] = state.torn_lines
        if final:  # one more writer after all the kills: the write lock is free
            keys = NS.block_keys(chain_tokens("final-put", 3))
            store.put(NS, keys, [payload_for(k, size_for(k, *SIZE_RANGE)) for k in keys])
            report["final_put_lookup"] = store.lookup(NS, keys)
    out.write_text(json.dumps(report))


def run_checker(run_dir: Path, store_path: Path, durability: str, *, sample: int | None, final: bool) -> dict[str, Any]:
    out = run_dir / "check.json"
    out.unlink(missing_ok=True)
    log = run_dir / "checker.log"
    status = run_child(checker_main, run_dir, store_path, durability, sample, final, out, log_path=log, timeout_s=120)
    assert status == 0, f"reopen/check failed (status {status}):\n{tail(log)}"
    report: dict[str, Any] = json.loads(out.read_text())
    assert report["n_lost"] == 0, f"acknowledged blocks lost: {report}"
    assert report["n_wrong"] == 0, f"acknowledged blocks wrong: {report}"
    assert report["n_unknown"] == 0, f"blocks nobody put: {report}"
    assert report["in_flight_wrong"] == [], f"in-flight blocks torn: {report}"
    assert report["index_problems"] == [], f"index inconsistent: {report}"
    assert report["quarantined"] == 0 and report["evictions"] == 0, report
    return report


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
        kill_and_reap(self.pids.pop(role))
        self.kills[role.rstrip("0123456789")] += 1

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
                report = run_checker(run_dir, loop.store_path, durability, sample=500, final=False)
                assert report["acked"] > acked_before, f"no write acknowledged since the last checkpoint: writers blocked? {report}"
                acked_before = report["acked"]
        loop.assert_all_alive()
    finally:
        loop.stop_all()
    failures = read_failures(run_dir)
    assert failures == [], f"{len(failures)} failures seen by readers/verifier, first: {failures[:5]}"
    report = run_checker(run_dir, loop.store_path, durability, sample=None, final=True)
    assert report["final_put_lookup"] == 3
    report.update(cycles=cycles, kills=dict(loop.kills), seconds=round(time.monotonic() - started, 1))
    print(f"\ncrash loop durability={durability}: {json.dumps(report)}")
    return report


@pytest.mark.parametrize("durability", ["sync", "group"])
def test_crash_loop(tmp_path: Path, durability: str) -> None:
    report = crash_loop(tmp_path, durability, cycles=100, max_delay_s=0.08)
    assert sum(report["kills"].values()) >= 100 + 7
    assert report["acked"] > 0


@pytest.mark.long
@pytest.mark.parametrize("durability", ["sync", "group"])
def test_crash_loop_long(tmp_path: Path, durability: str) -> None:
    report = crash_loop(tmp_path, durability, cycles=2000, max_delay_s=0.25, checkpoint_every=100)
    assert sum(report["kills"].values()) >= 2000 + 7
