"""Shared machinery of the reliability suite: real processes, payloads, oracle.

* Processes are real: :func:`fork_call` forks the test process (ucm_db is
  already imported, so a child starts in milliseconds) and the child opens
  its own store after the fork, as a user's worker process would. Children
  are killed with SIGKILL, which runs no cleanup at all.
* Payloads are a pure function of the key (:func:`payload_for`), so any
  process can tell right bytes from wrong ones without shared state.
* The oracle is one append-only file per writer incarnation: an ``I`` line
  (intent: keys about to be put) before ``Store.put`` and an ``A`` line (ack)
  after it returned. A line is one ``os.write`` to an ``O_APPEND`` descriptor,
  so a kill leaves at most a torn last line, which the reader ignores. No
  fsync: only processes die here, never the kernel, so the page cache keeps
  every completed write.
"""

from __future__ import annotations

import faulthandler
import hashlib
import json
import os
import random
import signal
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import ucm_db
from ucm_db import Namespace

NS = Namespace(model="reliability-suite", kv_dtype="bfloat16", block_size=4)
CHUNK_BYTES = 64 * 1024


# -- payloads -------------------------------------------------------------------
def size_for(key: bytes, lo_bytes: int, hi_bytes: int) -> int:
    """A deterministic even size in [lo_bytes, hi_bytes] for ``key``."""
    span = (hi_bytes - lo_bytes) // 2
    return lo_bytes + 2 * (int.from_bytes(key[8:16], "little") % (span + 1))


def payload_for(key: bytes, size_bytes: int) -> bytes:
    """Deterministic bf16-like bytes for ``key``: a random low byte plane and
    a narrow exponent plane (so zstd's shuffle path really compresses), with
    every 64 KiB chunk distinct (a chunk served from elsewhere is wrong)."""
    rng = np.random.default_rng(int.from_bytes(key[:8], "little"))
    base = rng.integers(0, 256, size=min(size_bytes, CHUNK_BYTES), dtype=np.uint8)
    base[1::2] = (base[1::2] & 0x07) | 0x38
    if size_bytes <= CHUNK_BYTES:
        return base[:size_bytes].tobytes()
    rows = -(-size_bytes // CHUNK_BYTES)
    tiled = np.tile(base, (rows, 1))
    tiled[:, 0::2] ^= (np.arange(rows, dtype=np.uint32) * 37 % 251).astype(np.uint8)[:, None]
    return tiled.reshape(-1)[:size_bytes].tobytes()


def chain_tokens(label: str, n_blocks: int, block_size: int = NS.block_size) -> list[int]:
    """Token ids of a chain named ``label`` (distinct labels, distinct keys)."""
    seed = int.from_bytes(hashlib.blake2b(label.encode(), digest_size=8).digest(), "little")
    rng = random.Random(seed)
    return [rng.randrange(1 << 31) for _ in range(n_blocks * block_size)]


# -- processes ------------------------------------------------------------------
def fork_call(fn: Callable[..., Any], *args: Any, log_path: Path) -> int:
    """Runs ``fn(*args)`` in a forked child; returns its pid.

    The child's stdout/stderr go to ``log_path``; it exits 0 if ``fn``
    returned, 1 if it raised (traceback in the log). It never returns into
    the test process's code.
    """
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        # A child killed by a fatal signal is an outcome the parent records;
        # pytest's faulthandler would print its stack to the terminal.
        faulthandler.disable()
        random.seed(os.urandom(16))
        fn(*args)
        code = 0
    except BaseException:  # noqa: BLE001 - report everything, then die
        traceback.print_exc()
    finally:
        os._exit(code)


def wait_pid(pid: int, timeout_s: float) -> int | None:
    """Exit status (negative: killed by that signal), or None on timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # already reaped
            return 0
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            return None
        time.sleep(0.005)


def kill_and_reap(pid: int) -> int:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    status = wait_pid(pid, 30.0)
    assert status is not None, f"process {pid} survived SIGKILL for 30 s"
    return status


def run_child(fn: Callable[..., Any], *args: Any, log_path: Path, timeout_s: float) -> int:
    """Runs ``fn`` in a child and waits; a timeout kills it and fails (a
    hang is a deadlock for this suite)."""
    pid = fork_call(fn, *args, log_path=log_path)
    status = wait_pid(pid, timeout_s)
    if status is None:
        kill_and_reap(pid)
        raise AssertionError(f"child {fn.__name__} hung for {timeout_s} s (deadlock?); log:\n{tail(log_path)}")
    return status


def tail(path: Path, chars: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def record_failure(run_dir: Path, what: str, **details: Any) -> None:
    """Appends a failure record that survives the recording process's death."""
    line = json.dumps({"what": what, "pid": os.getpid(), **details}) + "\n"
    fd = os.open(run_dir / "failures.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def write_counter(path: Path, value: int) -> None:
    """Publishes ``value`` atomically (temp file + rename): a SIGKILL at any
    instant leaves the previous value or the new one, never an empty file."""
    scratch = path.with_name(f".{path.name}.{os.getpid()}")
    scratch.write_text(str(value))
    os.replace(scratch, path)


def read_counter(path: Path) -> int:
    """The last value :func:`write_counter` published at ``path``; 0 if none."""
    try:
        return int(path.read_text())
    except FileNotFoundError:
        return 0


def wait_counter(path: Path, at_least: int, timeout_s: float) -> int:
    """Polls :func:`read_counter` until it reaches ``at_least`` or time runs out."""
    deadline = time.monotonic() + timeout_s
    while (value := read_counter(path)) < at_least and time.monotonic() < deadline:
        time.sleep(0.05)
    return value


def read_failures(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "failures.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# -- oracle ---------------------------------------------------------------------
class OracleWriter:
    """Append-only intent/ack log of one writer incarnation."""

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def _line(self, tag: str, keys: Iterable[bytes]) -> None:
        os.write(self._fd, (tag + " " + " ".join(k.hex() for k in keys) + "\n").encode())

    def intent(self, keys: Iterable[bytes]) -> None:
        self._line("I", keys)

    def ack(self, keys: Iterable[bytes]) -> None:
        self._line("A", keys)


@dataclass
class OracleState:
    acked: set[bytes] = field(default_factory=set)
    intended: set[bytes] = field(default_factory=set)
    torn_lines: int = 0

    @property
    def in_flight(self) -> set[bytes]:
        return self.intended - self.acked


def read_oracle(run_dir: Path) -> OracleState:
    """Reads every writer's log; a torn last line (no newline) is ignored."""
    state = OracleState()
    for path in sorted(run_dir.glob("oracle-*.log")):
        data = path.read_bytes()
        complete, _, torn = data.rpartition(b"\n")
        state.torn_lines += bool(torn)
        for line in complete.split(b"\n"):
            if not line:
                continue
            tag, *hexes = line.decode().split(" ")
            keys = {bytes.fromhex(h) for h in hexes if h}
            (state.acked if tag == "A" else state.intended).update(keys)
    return state


# -- store checks ---------------------------------------------------------------
def check_store_against_oracle(
    store: ucm_db.Store, run_dir: Path, *, size_range: tuple[int, int], sample: int | None = None
) -> tuple[OracleState, dict[str, Any]]:
    """Compares a store with the oracle; returns problem counts and sizes.

    Every acked key must read back exactly; every stored key must have been
    intended (nothing appears from nowhere); in-flight keys may be absent or
    whole, never wrong. ``sample`` limits how many acked keys are read.
    The store is listed before the oracle is read: writers may still run,
    and an intent is always logged before its put.
    """
    stored = set(store.tier.iterate())
    state = read_oracle(run_dir)
    acked = sorted(state.acked)
    if sample is not None and len(acked) > sample:
        acked = random.sample(acked, sample)
    lost, wrong = [], []
    for start in range(0, len(acked), 256):
        batch = acked[start : start + 256]
        for key, value in zip(batch, store.get(NS, batch)):
            if value is None:
                lost.append(key.hex())
            elif bytes(value) != payload_for(key, size_for(key, *size_range)):
                wrong.append(key.hex())
    unknown = [k.hex() for k in stored - state.intended - state.acked]
    in_flight = sorted(state.in_flight & stored)
    in_flight_wrong = [
        k.hex() for k, v in zip(in_flight, store.get(NS, in_flight) if in_flight else [])
        if v is not None and bytes(v) != payload_for(k, size_for(k, *size_range))
    ]
    return state, {
        "acked_checked": len(acked), "lost": lost[:10], "n_lost": len(lost), "wrong": wrong[:10],
        "n_wrong": len(wrong), "unknown": unknown[:10], "n_unknown": len(unknown),
        "in_flight_present": len(in_flight), "in_flight_wrong": in_flight_wrong,
        "index_problems": store.tier.check()[:10], "stored_blocks": len(stored),
        "quarantined": store.stats().quarantined, "evictions": store.stats().evictions,
    }
