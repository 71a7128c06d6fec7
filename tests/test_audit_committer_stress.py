"""Audit of ``save_process``: many small saves through the real background
writer, a staging pool that frees and remaps shared buffers all the time
(tiny buffers, a tiny free bound), and a real commit process, some killed
mid-run; every stored unit must hold its own bytes (a buffer reused before
the child read it would give a key another save's bytes), and every save
is counted once (saved, dropped or failed).

Real parts: the store (LMDB), the commit process, shared memfd buffers,
the writer thread and staging pool. The unit keys are a list with
``parent()``: the writer reads nothing else of ``UnitKeys``."""

from __future__ import annotations

import hashlib
import logging
import os
import random
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

import ucm_db  # noqa: E402
import ucm_db.committer as committer_module  # noqa: E402
from ucm_db.committer import CommitProcess  # noqa: E402
from ucm_db.connector.metrics import Counters  # noqa: E402
from ucm_db.connector.worker.staging import StagingPool  # noqa: E402
from ucm_db.connector.worker.writer import BackgroundWriter, SaveJob  # noqa: E402
from ucm_db.errors import CommitProcessError  # noqa: E402

from tests.test_audit_committer_hangs import _in_thread as in_thread  # noqa: E402

NS = ucm_db.Namespace(model="audit-committer-stress", kv_dtype="bfloat16", block_size=4)
OPTIONS = {"capacity_bytes": 256 << 20, "codec": "none"}
UNIT_BYTES = 4096
HEADS = 2
HANG_S = 120.0


class _Keys(list):  # type: ignore[type-arg]
    def parent(self) -> bytes | None:
        return None


def _expected(key: bytes) -> bytes:
    return hashlib.blake2b(key, digest_size=64).digest() * (UNIT_BYTES // 64)


def _shared_staging(committer: CommitProcess):  # type: ignore[no-untyped-def]
    def new_staging(rows: int) -> torch.Tensor:
        if committer.alive:
            try:
                buffer = committer.share(rows * HEADS * UNIT_BYTES)
                return torch.frombuffer(buffer.memory, dtype=torch.uint8).view(rows, HEADS, UNIT_BYTES)
            except CommitProcessError:
                pass
        return torch.empty(rows, HEADS, UNIT_BYTES, dtype=torch.uint8)
    return new_staging


def _run(path: Path, jobs: int, kill_at: set[int], stop_at: int = -1, max_pending_bytes: int = 512 << 10,
         resume: bool = True, drain: bool = True) -> tuple[dict[str, float], list[bytes]]:
    """Submits ``jobs`` saves as a model thread would; kills the child at
    each job of ``kill_at``, stops it (SIGSTOP) at ``stop_at`` until every
    job was submitted (for good: not ``resume``). Returns the counters and
    the keys stored."""
    rng = random.Random(7)
    store = ucm_db.open(path, **OPTIONS)
    committer = CommitProcess(path, OPTIONS)
    counters = Counters()
    pool = StagingPool(_shared_staging(committer), max_free_bytes=3 * HEADS * UNIT_BYTES)
    writer = BackgroundWriter(store, lambda row: ucm_db.Framed(row, (UNIT_BYTES,)), counters, max_pending_bytes,
                              committer=committer, frame_bytes=(UNIT_BYTES,))
    keys_sent: list[bytes] = []
    try:
        return _check(store, counters, writer, committer, keys_sent, resume and stop_at >= 0, drain,
                      _in_thread(lambda: _submit(committer, pool, writer, rng, jobs, kill_at, stop_at, keys_sent)))
    finally:
        if committer._process.poll() is None:  # a test that failed: no stopped child left behind
            committer._process.kill()


def _check(store: ucm_db.Store, counters: Counters, writer: BackgroundWriter, committer: CommitProcess, keys_sent: list[bytes],
           resume: bool, drain: bool, submitted: dict[str, Any]) -> tuple[dict[str, float], list[bytes]]:
    if resume:
        os.kill(committer.pid, signal.SIGCONT)
    assert "hung" not in submitted, "the model thread blocked on the commit process"
    assert "error" not in submitted, submitted
    closed = _in_thread(lambda: (writer.drain() if drain else None, writer.close()))
    assert "hung" not in closed, "drain or close hung on the commit process"
    stored = store.get(NS, keys_sent)
    wrong = [key.hex() for key, got in zip(keys_sent, stored) if got is not None and bytes(got) != _expected(key)]
    store.close()
    assert wrong == []
    counts = dict(counters.totals.data)
    assert counts["saved_blocks"] + counts["saves_dropped"] + counts["save_errors"] == submitted["value"]  # each save counted once
    return counts, [key for key, got in zip(keys_sent, stored) if got is not None]


def _in_thread(action: Callable[[], Any]) -> dict[str, Any]:
    return in_thread(action, HANG_S)


def _submit(committer: CommitProcess, pool: StagingPool, writer: BackgroundWriter, rng: random.Random, jobs: int,
            kill_at: set[int], stop_at: int, keys_sent: list[bytes]) -> int:
    """The model thread's part: stages and submits ``jobs`` saves; returns their blocks."""
    blocks_sent = 0
    for n in range(jobs):
        if n == stop_at:
            os.kill(committer.pid, signal.SIGSTOP)
        if n in kill_at and committer.alive:
            os.kill(committer.pid, signal.SIGKILL)
        blocks = rng.choice([1, 1, 2, 3, 5, 8])
        block_keys = NS.block_keys(list(range(n * 100, n * 100 + blocks * 4)))
        chains = tuple(_Keys(hashlib.blake2b(k + bytes([h]), digest_size=32).digest() for k in block_keys) for h in range(HEADS))
        lease = pool.take(blocks)
        for h, chain in enumerate(chains):
            for i, key in enumerate(chain):
                lease.staging[i, h].copy_(torch.frombuffer(bytearray(_expected(key)), dtype=torch.uint8))
        writer.submit(SaveJob(NS, chains, lease.staging, release=lease.release, held_bytes=lease.held_bytes))  # type: ignore[arg-type]
        keys_sent.extend(key for chain in chains for key in chain)
        blocks_sent += blocks
        if stop_at < 0 and rng.random() < 0.05 and n < jobs - 100:  # the last 100 are still queued at the end
            writer.drain()
    return blocks_sent


def test_many_small_saves_through_recycled_shared_buffers_keep_their_own_bytes(tmp_path: Path) -> None:
    counts, stored = _run(tmp_path / "s", 1500, kill_at=set())
    assert counts.get("save_errors", 0) == 0
    assert len(stored) == HEADS * counts["saved_blocks"]


def test_saves_with_the_child_killed_mid_run_keep_their_own_bytes_and_are_all_counted(tmp_path: Path) -> None:
    counts, stored = _run(tmp_path / "s", 600, kill_at={150})
    assert counts.get("save_errors", 0) == 0
    assert len(stored) == HEADS * counts["saved_blocks"]


def test_a_stopped_child_never_blocks_the_model_thread_and_its_saves_are_dropped_and_counted(tmp_path: Path) -> None:
    """The audit's F1 in the writer: saves taking new shared buffers while the
    child is stopped; the model thread blocked in ``share`` once ~140 MAPs
    filled the socket. Now they are staged, dropped when the queue is full
    (counted), and committed once the child runs again."""
    counts, stored = _run(tmp_path / "s", 1500, kill_at=set(), stop_at=10, max_pending_bytes=8 << 20)
    assert counts["saves_dropped"] > 0 and counts.get("save_errors", 0) == 0
    assert len(stored) == HEADS * counts["saved_blocks"]


def test_a_child_stopped_for_good_is_given_up_and_drain_and_close_return(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    """The audit's F2 in the writer: a producer drains every step and the
    worker's shutdown closes the writer; a child that never answers hung
    both. Past the reply timeout it is killed and the saves commit in the worker."""
    monkeypatch.setattr(committer_module, "REPLY_TIMEOUT_S", 2.0, raising=False)
    with caplog.at_level(logging.WARNING):
        counts, stored = _run(tmp_path / "s", 200, kill_at=set(), stop_at=5, max_pending_bytes=8 << 20, resume=False)
    assert "saves now commit in the worker process" in caplog.text
    assert counts.get("save_errors", 0) == 0 and counts["saved_blocks"] > 0
    assert len(stored) == HEADS * counts["saved_blocks"]


def test_closing_the_writer_with_saves_queued_commits_them_all_through_the_child(tmp_path: Path) -> None:
    """Engine shutdown with jobs queued: ``close`` without a drain commits every queued save (writer invariant)."""
    counts, stored = _run(tmp_path / "s", 400, kill_at=set(), max_pending_bytes=64 << 20, drain=False)
    assert counts.get("save_errors", 0) == 0 and counts.get("saves_dropped", 0) == 0
    assert counts["save_commit_cpu_s"] > 0 and len(stored) == HEADS * counts["saved_blocks"]
