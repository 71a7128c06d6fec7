"""Audit of the writer's commit route (connector/worker/commit_route.py)
when a round does not commit in the commit process, with a real child
(ucm_db.committer), a real LMDB store and the writer's real void records
(connector/worker/voids.py).

Findings:
    * A child found dead as the round's request was written (SIGKILLed
      between rounds: the write fails, nothing of it reached the child) made
      the route report every key of the round as stored: the void a step
      later deleted units another engine had stored first (valid blocks
      lost). Now only what the worker's own put stored is the round's.
    * A round whose request is over the wire's 64 MiB limit killed the
      child (it read the length and ended), so the engine committed in the
      worker for the rest of its life. Now that round commits whole in the
      worker (a round is one transaction, never split) and the child takes
      the next round.
"""

from __future__ import annotations

import fcntl
import logging
import os
import signal
import struct
import termios
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

import ucm_db  # noqa: E402
from ucm_db.committer import CommitProcess, SharedBuffer, wire  # noqa: E402
from ucm_db.connector.worker.commit_route import CommitRoute  # noqa: E402
from ucm_db.connector.worker.voids import SaveVoids, VoidJob, VoidTag  # noqa: E402
from ucm_db.keys.units import KVGrid, UnitKeys  # noqa: E402

NS = ucm_db.Namespace(model="audit-commit-route", kv_dtype="bfloat16", block_size=4)
OPTIONS = {"capacity_bytes": 256 << 20, "codec": "none"}
UNIT_BYTES = 4096
FRAME_BYTES = (UNIT_BYTES,)
HEADS, BLOCKS = 2, 5
GRID = KVGrid(HEADS, 1)


@dataclass
class _Job:
    """A save job as the route reads one (writer.py's SaveJob): its unit
    chains (one per head) and its staging rows ``[blocks, heads, unit_bytes]``."""

    namespace: ucm_db.Namespace
    chains: tuple[UnitKeys, ...]
    staging: torch.Tensor
    buffer: SharedBuffer  # kept mapped until the job is done, as the writer's pool does


def _job(committer: CommitProcess, tokens: list[int], fill: int) -> _Job:
    """A save of ``BLOCKS`` blocks of every head, staged in a buffer shared with ``committer``."""
    block_keys = NS.block_keys(tokens)
    buffer = committer.share(len(block_keys) * HEADS * UNIT_BYTES)
    staging = torch.frombuffer(buffer.memory, dtype=torch.uint8).view(len(block_keys), HEADS, UNIT_BYTES)
    staging.fill_(fill)
    return _Job(NS, tuple(UnitKeys(block_keys, GRID, span) for span in GRID.head_spans()), staging, buffer)


def _route(store: ucm_db.Store, committer: CommitProcess) -> CommitRoute:
    return CommitRoute(store, lambda row: ucm_db.Framed(row, FRAME_BYTES), None, committer, FRAME_BYTES)


def _round(job: _Job) -> list[tuple[Any, int]]:
    return [(job, j) for j in range(len(job.chains))]


def _other_engine_stores(store: ucm_db.Store, job: _Job, blocks: int) -> bytes:
    """Another engine stored head 0 of the job's first ``blocks`` blocks
    first (its own bytes, 0xEE): returns those bytes."""
    theirs = bytes([0xEE]) * UNIT_BYTES
    keys = job.chains[0][:blocks]
    store.put(NS, list(keys), [theirs] * blocks, parent=keys.parent())
    return theirs


def _wait_dead(pid: int) -> None:
    """Until the child ``pid`` has exited, every thread of it (its socket
    closed), without reaping it (its CommitProcess does). Its main thread
    shows as a zombie while others may still be exiting with the socket
    open: a test that waited for that saw the round's write succeed."""
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)


def _void(store: ucm_db.Store, job: _Job, stored: list[bytes]) -> None:
    """The writer's records of a voidable save's round, then its void (voids.py)."""
    voids, save = SaveVoids(store), ("req", job.chains[0][0], BLOCKS)
    voids.begin_round(True)
    tag = VoidTag(save, 1)
    voids.stored(stored, SimpleNamespace(void_tag=tag))
    voids.end_round([(tag, job.chains)])
    voids.delete(VoidJob(NS, save, BLOCKS, step=2))


def test_a_child_dead_before_the_round_leaves_the_other_engine_s_units_to_it(tmp_path: Path) -> None:
    """The child is SIGKILLed between rounds; the next round finds it gone
    as its request is written (nothing of it reached the child) and commits
    in the worker, which stores head 0's block 4 and head 1: the route
    returns those, and the round's void keeps the 4 units another engine
    stored first."""
    with ucm_db.open(tmp_path / "s", **OPTIONS) as store:
        committer = CommitProcess(tmp_path / "s", OPTIONS)
        route = _route(store, committer)
        job = _job(committer, list(range(4 * BLOCKS)), fill=0x11)
        theirs = _other_engine_stores(store, job, 4)
        os.kill(committer.pid, signal.SIGKILL)
        _wait_dead(committer.pid)
        assert committer.alive  # not found gone yet: the round's put finds it
        stored = route.put(_round(job), None)
        assert route.committer is None  # lost, and closed
        _void(store, job, stored)
        assert store.get(NS, list(job.chains[0][:4])) == [theirs] * 4, "the void deleted the other engine's units"
        ours = [job.chains[0][4], *job.chains[1]]
        assert store.get(NS, ours) == [None] * len(ours)  # ours (wrong KV) are gone
        assert sorted(stored) == sorted(ours)
        route.close()


def _outq_bytes(sock: Any) -> int:
    """Bytes written to the socket its peer has not read yet (SIOCOUTQ)."""
    return int(struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0])


def _wait_for(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, "waited 30 s"
        time.sleep(0.01)


def test_a_child_killed_after_the_request_reached_it_counts_as_having_stored_every_key(tmp_path: Path) -> None:
    """The other side of the rule: the child (stopped) has the whole
    request in its socket when it is killed; it may have committed it, so
    the route reports every key of the round, the other engine's too
    (wrong KV left stored is worse than a lost save: voids.py)."""
    with ucm_db.open(tmp_path / "s", **OPTIONS) as store:
        committer = CommitProcess(tmp_path / "s", OPTIONS)
        route = _route(store, committer)
        job = _job(committer, list(range(4 * BLOCKS)), fill=0x22)
        _other_engine_stores(store, job, 4)
        sock = committer._sock  # private: the test watches what the child has not read yet
        _wait_for(lambda: _outq_bytes(sock) == 0)  # the child read the buffer's MAP: the request is the next thing written
        os.kill(committer.pid, signal.SIGSTOP)
        result: dict[str, list[bytes]] = {}
        thread = threading.Thread(target=lambda: result.update(stored=route.put(_round(job), None)), daemon=True)
        thread.start()
        _wait_for(lambda: _outq_bytes(sock) > 0)  # the request (one small write) is whole in the stopped child's socket
        os.kill(committer.pid, signal.SIGKILL)
        thread.join(60)
        assert not thread.is_alive()
        assert route.committer is None
        assert sorted(result["stored"]) == sorted(key for chain in job.chains for key in chain)
        route.close()


def _huge_events(job: _Job) -> dict[bytes, ucm_db.BlockEventFields]:
    """Event fields of head 0's units whose JSON passes the wire's limit:
    a round of ~1M unit keys (a long prompt's save of many heads) does so
    with plain keys; fields of long token lists do it with few keys, which
    the store commits in a second here."""
    per_key_tokens = wire.MAX_PAYLOAD_BYTES // (8 * BLOCKS) + 1  # 8 hex digits a token
    tokens = (1,) * per_key_tokens
    return {key: ucm_db.BlockEventFields(block_hash=i + 1, parent_block_hash=i or None, token_ids=tokens, block_size=len(tokens))
            for i, key in enumerate(job.chains[0])}


def test_a_round_over_the_wire_limit_commits_whole_in_the_worker_and_the_child_serves_on(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A round whose request passes 64 MiB commits in the worker, in one
    transaction, with its event fields; the child lives, and the next
    (normal) round commits there, not in the worker."""
    with ucm_db.open(tmp_path / "s", **OPTIONS) as store:
        committer = CommitProcess(tmp_path / "s", OPTIONS)
        route = _route(store, committer)
        here: list[int] = []
        put_here = store.put_segments

        def counted(*args: Any, **kwargs: Any) -> Any:  # a spy: the worker's own puts, committed as they were
            here.append(1)
            return put_here(*args, **kwargs)
        store.put_segments = counted  # type: ignore[method-assign]
        big = _job(committer, list(range(4 * BLOCKS)), fill=0x33)
        every = [key for chain in big.chains for key in chain]
        with caplog.at_level(logging.WARNING):
            stored = route.put(_round(big), _huge_events(big))
        assert sorted(stored) == sorted(every) and len(here) == 1  # committed here, once, whole
        assert store.get(NS, every) == [bytes([0x33]) * UNIT_BYTES] * len(every)
        assert route.committer is committer and committer.alive, "an oversized round cost the commit process"
        assert "such a round commits in the worker process" in caplog.text
        os.kill(committer.pid, 0)  # the same child, still running
        small = _job(committer, list(range(1000, 1000 + 4 * BLOCKS)), fill=0x44)
        stored = route.put(_round(small), None)
        assert len(here) == 1, "the round after an oversized one did not go to the commit process"
        assert route.child_cpu_s > 0.0
        assert sorted(stored) == sorted(key for chain in small.chains for key in chain)
        assert store.get(NS, list(small.chains[1])) == [bytes([0x44]) * UNIT_BYTES] * BLOCKS
        route.close()
        assert not committer.alive
