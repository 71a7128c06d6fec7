"""Audit of ucm_db.committer with real processes: a child that stops
reading (SIGSTOP, or a commit that takes long) must never block the
caller's model thread in :meth:`CommitProcess.share`, nor hang a put or
``close`` for good; a killed caller's child exits and frees the store.

Findings reproduced here (the audit of the commit process):
    * ``share`` wrote its MAP message blocking: with the child stopped,
      the 140th or so staging buffer blocked the model's thread until the
      child read again (for ever, if it never did). Writing it only while
      the socket polls writable was not enough while a MAP's head and
      payload were two writes: at some send buffer sizes the head filled
      the socket and the payload's write waited.
    * A put's reply was awaited without a bound: a stopped child hung the
      writer, every producer's per-step drain and the worker's shutdown.
    * The child exited only at its socket's end, which a process forked
      from the caller holds open after the caller died (an orphan holding
      the store).
    * ``close`` wrote CLOSE into a socket the stopped child no longer
      drained and waited for room (for ever; with the reply timeout, 300 s):
      now it writes CLOSE only if the socket takes it at once, waits
      CLOSE_TIMEOUT_S for the child's exit, then kills it.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ucm_db
import ucm_db.committer as committer_module
from ucm_db.committer import CommitProcess, SharedBuffer, SharedChain
from ucm_db.errors import CommitProcessError

NS = ucm_db.Namespace(model="audit-committer-hangs", kv_dtype="bfloat16", block_size=4)
OPTIONS = {"capacity_bytes": 64 << 20, "codec": "none"}
UNIT_BYTES = 4096
#: Longest a hang detector waits for what must return at once (generous: 2 shared cores).
HANG_S = 60.0


def _in_thread(action: Callable[[], Any], hang_s: float = HANG_S) -> dict[str, Any]:
    """Runs ``action`` on a thread; its result or error, or ``{"hung": True}`` after ``hang_s``."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = action()
        except Exception as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(hang_s)
    if thread.is_alive():
        out["hung"] = True
    return out


def _unit(key: bytes) -> bytes:
    return hashlib.blake2b(key, digest_size=64).digest() * (UNIT_BYTES // 64)


def _staged(buffer: SharedBuffer, keys: list[bytes]) -> None:
    rows = np.frombuffer(buffer.memory, dtype=np.uint8).reshape(-1, UNIT_BYTES)
    for i, key in enumerate(keys):
        rows[i] = np.frombuffer(_unit(key), dtype=np.uint8)


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_share_never_blocks_the_caller_while_the_child_reads_nothing(tmp_path: Path) -> None:
    with ucm_db.open(tmp_path / "s", **OPTIONS) as store, CommitProcess(tmp_path / "s", OPTIONS) as committer:
        os.kill(committer.pid, signal.SIGSTOP)
        try:
            # A model thread taking staging buffers while the writer waits on a stopped (or slow) child.
            shared = _in_thread(lambda: [committer.share(UNIT_BYTES) for _ in range(1000)])
        finally:
            os.kill(committer.pid, signal.SIGCONT)
        assert "hung" not in shared, "share() blocked the caller on a child that reads nothing"
        assert "error" not in shared and committer.alive  # a busy child is not a dead one
        buffers: list[SharedBuffer] = shared["value"]
        # Every buffer is usable once the child reads again: its map reaches the child before the put that names it.
        for n in (0, 500, 999):
            keys = list(NS.block_keys(list(range(n * 4, n * 4 + 4))))
            _staged(buffers[n], keys)
            committer.put_segments(NS, [SharedChain(ucm_db.BlockKeys(keys), buffers[n].id, 0, UNIT_BYTES, UNIT_BYTES)])
            assert [bytes(g) for g in store.get(NS, keys)] == [_unit(k) for k in keys]  # type: ignore[arg-type]


@pytest.mark.parametrize("send_buffer_bytes", range(8192, 11265, 384))
def test_share_never_blocks_whatever_the_sockets_send_buffer(tmp_path: Path, send_buffer_bytes: int) -> None:
    """Where the socket stops polling writable decides which write of a
    MAP fills it: one that wrote its head and payload apart blocked on the
    payload after the head filled it (a kernel's send buffer size is the
    host's; these sizes move that point across heads and payloads)."""
    with ucm_db.open(tmp_path / "s", **OPTIONS), CommitProcess(tmp_path / "s", OPTIONS) as committer:
        committer._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)
        os.kill(committer.pid, signal.SIGSTOP)
        try:
            shared = _in_thread(lambda: [committer.share(UNIT_BYTES) for _ in range(200)], hang_s=10.0)
        finally:
            os.kill(committer.pid, signal.SIGCONT)
        assert "hung" not in shared, f"share() blocked the caller (send buffer {send_buffer_bytes} bytes)"
        assert "error" not in shared and committer.alive


def test_a_stopped_child_is_given_up_after_the_reply_timeout_and_the_store_stays_writable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(committer_module, "REPLY_TIMEOUT_S", 2.0, raising=False)
    with ucm_db.open(tmp_path / "s", **OPTIONS) as store:
        committer = CommitProcess(tmp_path / "s", OPTIONS)
        buffer = committer.share(8 * UNIT_BYTES)
        keys = list(NS.block_keys(list(range(32))))
        _staged(buffer, keys)
        os.kill(committer.pid, signal.SIGSTOP)
        try:
            put = _in_thread(lambda: committer.put_segments(NS, [SharedChain(ucm_db.BlockKeys(keys), buffer.id, 0, UNIT_BYTES, UNIT_BYTES)]))
            assert "hung" not in put, "a put waited for ever on a stopped child"
            assert isinstance(put.get("error"), CommitProcessError) and not committer.alive
            assert not _running(committer.pid)  # killed and reaped: it cannot commit late from a reused buffer
        finally:
            if _running(committer.pid):
                os.kill(committer.pid, signal.SIGKILL)
                os.kill(committer.pid, signal.SIGCONT)
        closed = _in_thread(committer.close)
        assert "hung" not in closed and "error" not in closed
        # The caller commits the round itself, as the writer's route does (the child held no lock).
        store.put_segments(NS, [(ucm_db.BlockKeys(keys), [_unit(k) for k in keys])])
        assert [bytes(g) for g in store.get(NS, keys)] == [_unit(k) for k in keys]  # type: ignore[arg-type]


def test_close_returns_while_the_child_is_stopped_behind_a_full_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(committer_module, "CLOSE_TIMEOUT_S", 2.0)
    with ucm_db.open(tmp_path / "s", **OPTIONS):
        committer = CommitProcess(tmp_path / "s", OPTIONS)
        os.kill(committer.pid, signal.SIGSTOP)
        try:
            filled = _in_thread(lambda: [committer.share(UNIT_BYTES) for _ in range(1000)])
            closed = _in_thread(committer.close)
            assert "hung" not in filled and "hung" not in closed, "close() hung on a stopped child"
            assert not _running(committer.pid)
        finally:
            if _running(committer.pid):
                os.kill(committer.pid, signal.SIGKILL)
                os.kill(committer.pid, signal.SIGCONT)


_CALLER = """
import sys, time
from ucm_db.committer import CommitProcess
committer = CommitProcess(sys.argv[1], {"capacity_bytes": 8 << 20, "engine": "rocksdb"})
print(committer.pid, flush=True)
time.sleep(600)
"""


def test_a_killed_callers_child_exits_and_frees_a_single_process_store(tmp_path: Path) -> None:
    """RocksDB's LOCK admits one process: an orphaned child would keep a restarted engine out for good."""
    pytest.importorskip("rocksdict")
    path = tmp_path / "s"
    ucm_db.open(path, capacity_bytes=8 << 20, engine="rocksdb").close()
    caller = subprocess.Popen([sys.executable, "-c", _CALLER, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert caller.stdout is not None
        child_pid = int(caller.stdout.readline())
        with pytest.raises(ucm_db.UcmDbError):  # held by the child while its caller lives
            ucm_db.open(path, capacity_bytes=8 << 20, engine="rocksdb")
        os.kill(caller.pid, signal.SIGKILL)
        caller.wait(timeout=30)
        deadline = time.monotonic() + HANG_S
        while time.monotonic() < deadline and _running(child_pid):
            time.sleep(0.05)
        assert not _running(child_pid)
        with ucm_db.open(path, capacity_bytes=8 << 20, engine="rocksdb") as store:  # the restarted engine opens it
            assert store.stats() is not None
    finally:
        caller.kill()


_FORKING_CALLER = """
import os, sys, time
from ucm_db.committer import CommitProcess
committer = CommitProcess(sys.argv[1], {"capacity_bytes": 8 << 20})
sibling = os.fork()  # as a library's worker forked without exec would: it inherits the commit socket
if sibling == 0:
    time.sleep(600)
    os._exit(0)
print(committer.pid, sibling, flush=True)
time.sleep(600)
"""


def test_the_child_exits_with_its_caller_even_where_a_forked_process_holds_the_socket(tmp_path: Path) -> None:
    """Finding: the child waited for its socket's end only, which a process
    forked from the caller (holding a copy of the caller's end) delays for
    as long as it lives: an orphan child holding the store after the engine died."""
    caller = subprocess.Popen([sys.executable, "-c", _FORKING_CALLER, str(tmp_path / "s")], stdout=subprocess.PIPE, text=True)
    sibling = -1
    try:
        assert caller.stdout is not None
        child_pid, sibling = (int(pid) for pid in caller.stdout.readline().split())
        os.kill(caller.pid, signal.SIGKILL)
        caller.wait(timeout=30)
        deadline = time.monotonic() + HANG_S
        while time.monotonic() < deadline and _running(child_pid):
            time.sleep(0.1)
        assert not _running(child_pid), "the commit process outlived its caller"
        # Its hold on the store is gone too: maintenance's exclusive lock (storelock.py) is free to take.
        with open(tmp_path / "s" / "ucm-db.lock", "rb") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        caller.kill()
        if sibling > 0:
            os.kill(sibling, signal.SIGKILL)
