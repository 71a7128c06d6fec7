"""Concurrent load: several processes, mixed operations, eviction, inspection.

Four worker processes run get / put / lookup / delete on one shared set of
chains (blocks of 64 KiB to 4 MiB), the capacity is a fraction of what they
put so eviction runs all the time, and an inspector process loops over
``Store.stats()``, ``LocalTier.check()`` and the real CLI (``ucm-db inspect``
and ``ucm-db verify --sample``). Pass: 0 errors, 0 wrong bytes, 0 deadlocks
(every process finishes before the watchdog), the index consistent in every
snapshot, stored bytes never over capacity. Per-operation latencies are
written out and p50/p99 printed (RELIABILITY.md records them).
"""

from __future__ import annotations

import json
import random
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ucm_db

from .harness import (
    NS, chain_tokens, fork_call, kill_and_reap, payload_for, read_counter, read_failures, record_failure, tail,
    wait_counter, wait_pid, write_counter,
)

CHAINS = 48
BLOCKS_PER_CHAIN = 4
SIZES_BYTES = (64 << 10, 256 << 10, 1 << 20, 4 << 20)
SIZE_WEIGHTS = (45, 30, 18, 7)
CAPACITY_BYTES = 32 << 20
OPTIONS: dict[str, Any] = {"capacity_bytes": CAPACITY_BYTES, "durability": "group", "sync_interval_s": 0.2}
OPS = ("get", "put", "lookup", "delete")
OP_WEIGHTS = (40, 30, 20, 10)
INSPECTOR_GRACE_S = 60.0

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def block_size(key: bytes) -> int:
    """64 KiB - 4 MiB, mostly small (weights above), a function of the key."""
    pick = int.from_bytes(key[16:24], "little") % sum(SIZE_WEIGHTS)
    for size, weight in zip(SIZES_BYTES, SIZE_WEIGHTS):
        if pick < weight:
            return size
        pick -= weight
    raise AssertionError("unreachable")


def chain_keys(chain: int) -> list[bytes]:
    return NS.block_keys(chain_tokens(f"load-{chain}", BLOCKS_PER_CHAIN))


def run_op(store: ucm_db.Store, op: str, keys: list[bytes], rng: random.Random) -> tuple[int, int]:
    """Runs one operation; returns (wrong blocks, bytes moved)."""
    if op == "put":
        n = rng.randint(1, len(keys))
        payloads = [payload_for(k, block_size(k)) for k in keys[:n]]
        store.put(NS, keys[:n], payloads)
        return 0, sum(map(len, payloads))
    if op == "get":
        start = rng.randrange(len(keys))
        picked = keys[start : start + rng.randint(1, 2)]
        wrong = moved = 0
        for key, value in zip(picked, store.get(NS, picked)):
            if value is not None:
                moved += len(value)
                wrong += bytes(value) != payload_for(key, block_size(key))
        return wrong, moved
    if op == "lookup":
        found = store.lookup(NS, keys)
        return int(not 0 <= found <= len(keys)), 0
    store.delete(NS, [keys[rng.randrange(len(keys))]])
    return 0, 0


def worker(run_dir: Path, store_path: Path, wid: int, n_ops: int) -> None:
    rng = random.Random(wid * 7919)
    latencies: dict[str, list[float]] = {op: [] for op in OPS}
    errors = wrong = 0
    moved_bytes = 0
    with ucm_db.open(store_path, **OPTIONS) as store:
        for _ in range(n_ops):
            op = rng.choices(OPS, OP_WEIGHTS)[0]
            keys = chain_keys(rng.randrange(CHAINS))
            started = time.perf_counter()
            try:
                bad, moved = run_op(store, op, keys, rng)
            except Exception as exc:  # noqa: BLE001 - counted and reported, then go on
                errors += 1
                record_failure(run_dir, f"worker {op} raised", error=f"{type(exc).__name__}: {exc}", tb=traceback.format_exc())
                continue
            latencies[op].append(time.perf_counter() - started)
            wrong += bad
            moved_bytes += moved
            if bad:
                record_failure(run_dir, f"worker {op}: wrong bytes", keys=[k.hex() for k in keys])
    result = {"errors": errors, "wrong": wrong, "moved_bytes": moved_bytes, "latencies": latencies}
    (run_dir / f"worker-{wid}.json").write_text(json.dumps(result))


def inspector(run_dir: Path, store_path: Path) -> None:
    """Loops until killed: stats invariants and index check on snapshots."""
    rounds = 0
    with ucm_db.open(store_path, **OPTIONS) as store:
        while True:
            stats = store.stats()
            if stats.stored_bytes > CAPACITY_BYTES:
                record_failure(run_dir, "inspector: over capacity", stored=stats.stored_bytes)
            for problem in store._tier.check():
                record_failure(run_dir, "inspector: index problem", problem=problem)
            rounds += 1
            write_counter(run_dir / "inspector.rounds", rounds)
            time.sleep(0.05)


def cli_inspector(run_dir: Path, store_path: Path) -> None:
    """Loops until killed over the real CLI. A process of its own: LMDB lets
    one process open an environment once, and the CLI opens its own."""
    from click.testing import CliRunner

    from ucm_db.tools.cli import cli

    runner = CliRunner()
    rounds = 0
    while True:
        for args in (["inspect", str(store_path), "--json"], ["verify", str(store_path), "--json", "--sample", "8"]):
            result = runner.invoke(cli, args)
            if result.exit_code != 0:
                record_failure(run_dir, f"ucm-db {args[0]} exit {result.exit_code}", output=result.output[-2000:])
        rounds += 1
        write_counter(run_dir / "cli.rounds", rounds)


def percentile_ms(values: list[float], q: float) -> float:
    return round(float(np.percentile(values, q)) * 1e3, 2) if values else 0.0


def concurrent_load(run_dir: Path, *, workers: int, n_ops: int, watchdog_s: float) -> dict[str, Any]:
    store_path = run_dir / "store"
    ucm_db.open(store_path, **OPTIONS).close()
    started = time.monotonic()
    inspector_pid = fork_call(inspector, run_dir, store_path, log_path=run_dir / "inspector.log")
    cli_pid = fork_call(cli_inspector, run_dir, store_path, log_path=run_dir / "cli.log")
    pids = {wid: fork_call(worker, run_dir, store_path, wid, n_ops, log_path=run_dir / f"worker-{wid}.log") for wid in range(workers)}
    try:
        deadline = started + watchdog_s
        for wid, pid in pids.items():
            status = wait_pid(pid, max(1.0, deadline - time.monotonic()))
            assert status is not None, f"worker {wid} still running after {watchdog_s} s: deadlock?\n{tail(run_dir / f'worker-{wid}.log')}"
            assert status == 0, f"worker {wid} failed ({status}):\n{tail(run_dir / f'worker-{wid}.log')}"
        # The inspectors start beside four busy workers; on a loaded machine the
        # workers can finish first. Give each inspector time for one round.
        for name in ("inspector", "cli"):
            wait_counter(run_dir / f"{name}.rounds", 1, timeout_s=INSPECTOR_GRACE_S)
        assert wait_pid(inspector_pid, 0) is None, f"inspector died:\n{tail(run_dir / 'inspector.log')}"
        assert wait_pid(cli_pid, 0) is None, f"CLI inspector died:\n{tail(run_dir / 'cli.log')}"
    finally:
        for pid in [inspector_pid, cli_pid, *pids.values()]:
            kill_and_reap(pid)
    seconds = time.monotonic() - started
    failures = read_failures(run_dir)
    assert failures == [], f"{len(failures)} failures, first: {failures[:3]}"
    results = [json.loads((run_dir / f"worker-{wid}.json").read_text()) for wid in range(workers)]
    with ucm_db.open(store_path, **OPTIONS) as store:
        stats = store.stats()
        assert store._tier.check() == []
    report: dict[str, Any] = {
        "workers": workers, "ops_per_worker": n_ops, "seconds": round(seconds, 1),
        "errors": sum(r["errors"] for r in results), "wrong": sum(r["wrong"] for r in results),
        "moved_GiB": round(sum(r["moved_bytes"] for r in results) / (1 << 30), 2),
        "evictions": stats.evictions, "inspector_rounds": read_counter(run_dir / "inspector.rounds"),
        "cli_rounds": read_counter(run_dir / "cli.rounds"),
    }
    for op in OPS:
        values = [v for r in results for v in r["latencies"][op]]
        report[op] = {"n": len(values), "p50_ms": percentile_ms(values, 50), "p99_ms": percentile_ms(values, 99), "max_ms": percentile_ms(values, 100)}
    print(f"\nconcurrent load: {json.dumps(report)}")
    return report


def test_concurrent_load(tmp_path: Path) -> None:
    report = concurrent_load(tmp_path, workers=4, n_ops=1000, watchdog_s=300)
    assert report["errors"] == 0 and report["wrong"] == 0
    assert report["evictions"] > 0, "capacity never reached: eviction was not exercised"
    assert report["inspector_rounds"] >= 1 and report["cli_rounds"] >= 1


@pytest.mark.long
def test_concurrent_load_long(tmp_path: Path) -> None:
    report = concurrent_load(tmp_path, workers=4, n_ops=20_000, watchdog_s=6 * 3600)
    assert report["errors"] == 0 and report["wrong"] == 0 and report["evictions"] > 0
