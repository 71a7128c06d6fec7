"""Promotion of the same blocks by several processes at once keeps the local
tier's accounting exact (audit question; it holds: each promotion reads a
block's presence in its own write transaction, so a block another process
promoted first is left as it is and counted once).

Three real processes open one store directory and warm the same 20 chains
from one ``file://`` remote at the same time (a barrier starts them
together); the store must then hold what one warming process alone leaves:
the same blocks, the same stored bytes, and ``verify`` finds nothing wrong.
"""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any

import pytest

import ucm_db
from ucm_db import maintenance
from ucm_db.keys import Namespace

pytestmark = pytest.mark.timeout(180)
NS = Namespace(model="test/audit-promotion-concurrency", kv_dtype="bfloat16", block_size=4, layout="test")
PROMPTS = [list(range(1000 * i + 1, 1000 * i + 1 + 4 * 24)) for i in range(20)]
CAP = 256 << 20


def _warmer(store_dir: str, url: str, barrier: Any, out: Any) -> None:
    with ucm_db.open(store_dir, capacity_bytes=CAP, remote=url) as store:
        store.epoch(NS)
        barrier.wait(60)
        report = store.warm(NS, token_sequences=PROMPTS)
    out.put(report.to_dict())


def _totals(store_dir: Path) -> tuple[int, int]:
    with ucm_db.open(store_dir) as store:
        stats = store.stats()
        return stats.blocks, stats.stored_bytes


def test_three_processes_promoting_the_same_chains_count_each_block_once(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'remote'}"
    (tmp_path / "remote").mkdir()
    with ucm_db.open(tmp_path / "a", capacity_bytes=CAP, remote=url, remote_mode="write_through") as a:
        for i, prompt in enumerate(PROMPTS):
            a.put(NS, NS.block_keys(prompt), [bytes([i, j]) * 1500 for j in range(24)])
    ucm_db.open(tmp_path / "alone", capacity_bytes=CAP, remote=url).close()  # created before the race, as "shared" is
    ucm_db.open(tmp_path / "shared", capacity_bytes=CAP, remote=url).close()

    ctx = multiprocessing.get_context("spawn")
    barrier, out = ctx.Barrier(3), ctx.Queue()
    procs = [ctx.Process(target=_warmer, args=(str(tmp_path / "shared"), url, barrier, out)) for _ in range(3)]
    for p in procs:
        p.start()
    reports = [out.get(timeout=150) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    total = len(PROMPTS) * 24
    assert all(r["missing"] == 0 and r["failed"] == 0 and r["blocks"] == total for r in reports), reports

    with ucm_db.open(tmp_path / "alone", capacity_bytes=CAP, remote=url) as alone:
        assert alone.warm(NS, token_sequences=PROMPTS).fetched == total
    assert _totals(tmp_path / "shared") == _totals(tmp_path / "alone")
    assert _totals(tmp_path / "shared")[0] == total
    report = maintenance.verify(tmp_path / "shared")
    assert report.checked == total and not report.corrupt and not report.index_problems and not report.totals_recomputed
