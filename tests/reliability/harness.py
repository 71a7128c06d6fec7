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
* Under capacity pressure (:class:`EvictionOracle`) the lines also carry
  wall-clock times (the clock of the store's LRU) and the oracle knows which
  acknowledged blocks an eviction may legally have removed: LRU order is
  put order, except for blocks a reader touched (logged as touch windows) and
  a put's own batch and ancestors, which its eviction never removes. A block
  is *protected* while fewer bytes than the capacity (or a running
  compaction's target) were put or touched after it; a protected block that
  is missing is lost.
"""

from __future__ import annotations

import bisect
import contextlib
import faulthandler
import hashlib
import json
import os
import random
import signal
import subprocess
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

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
def log_line(path: Path, line: str) -> None:
    """Appends one line to a child's log with one write (a cut or a kill
    leaves whole lines, or the last one torn, never two interleaved)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def segment_keys(label: str, n_blocks: int) -> list[bytes]:
    return NS.block_keys(chain_tokens(label, n_blocks))


def segment_payloads(keys: list[bytes]) -> list[bytes]:
    return [payload_for(k, size_for(k, 512, 24 << 10)) for k in keys]


def write_cut_segments(store: ucm_db.Store, log_path: Path, cycle: int, rng: random.Random, durability: str, rounds: int) -> None:
    """The power-cut writers' loop: chains of 2-6 blocks put in two parts,
    each logged before (``I``) and after (``A``) its put; under ``group`` a
    flush now and then, logged (``S``) once it returned."""
    for i in range(rounds):
        label = f"c{cycle}-{i}"
        n = rng.randint(2, 6)
        keys = segment_keys(label, n)
        cut_at = rng.randint(1, n - 1)
        log_line(log_path, f"I {label} {n} 0 {cut_at}")
        store.put(NS, keys[:cut_at], segment_payloads(keys[:cut_at]))
        log_line(log_path, f"A {label} {n} 0 {cut_at}")
        log_line(log_path, f"I {label} {n} {cut_at} {n}")
        store.put(NS, keys[cut_at:], segment_payloads(keys[cut_at:]), parent=keys[cut_at - 1])
        log_line(log_path, f"A {label} {n} {cut_at} {n}")
        if durability == "group" and rng.random() < 0.3:
            store.flush()
            log_line(log_path, "S")


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
    """Append-only intent/ack log of one writer incarnation.

    Tokens other than 64 hex digits (``t=`` times, ``p=`` parents, ``e=``
    eviction counts) are read only by :func:`read_eviction_oracle`.
    """

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def _line(self, tag: str, keys: Iterable[bytes], *extra: str) -> None:
        os.write(self._fd, (" ".join((tag, *extra, *(k.hex() for k in keys))) + "\n").encode())

    def intent(self, keys: Iterable[bytes], *, parent: bytes | None = None, timed: bool = False, oversize: bool = False) -> None:
        """Keys about to be put; ``oversize``: more than the capacity, so the
        put must be refused (if its process dies, it still stored nothing)."""
        extra = (f"t={time.time_ns()}", f"p={parent.hex() if parent else '-'}") if timed else ()
        self._line("I", keys, *extra, *(("x=oversize",) if oversize else ()))

    def ack(self, keys: Iterable[bytes], *, evicted: int | None = None) -> None:
        extra = (f"t={time.time_ns()}", f"e={evicted}") if evicted is not None else ()
        self._line("A", keys, *extra)

    def refused(self, keys: Iterable[bytes]) -> None:
        """The put raised StoreFullError: none of ``keys`` may be stored."""
        self._line("R", keys)

    def touch_open(self, keys: Iterable[bytes]) -> None:
        """Reads that may touch ``keys`` (and their ancestors) start now."""
        self._line("T", keys, f"t={time.time_ns()}")

    def touch_close(self) -> None:
        self._line("U", (), f"t={time.time_ns()}")

    def evict_open(self, target_bytes: int) -> None:
        """A compaction evicting down to ``target_bytes`` starts now."""
        self._line("E", (), f"t={time.time_ns()}", f"target={target_bytes}")

    def evict_close(self) -> None:
        self._line("F", (), f"t={time.time_ns()}")

    def missing_after_ack(self, keys: Iterable[bytes]) -> None:
        """Blocks of a chain whose put just returned were found missing."""
        self._line("M", keys, f"t={time.time_ns()}")


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
            if tag not in ("A", "I"):
                continue
            keys = {bytes.fromhex(h) for h in hexes if len(h) == 64}
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
    stored = set(store._tier.iterate())
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
        "index_problems": store._tier.check()[:10], "stored_blocks": len(stored),
        "quarantined": store.stats().quarantined, "evictions": store.stats().evictions,
    }


# -- oracle under capacity pressure ----------------------------------------------------
#: End time of an operation whose process died inside it (it may have committed).
NEVER_NS = 1 << 63
#: Upper bound of a block's stored bytes beyond its raw payload (codec head,
#: plane lengths): sizes in the eviction oracle are upper bounds.
STORED_OVERHEAD_BYTES = 128


@dataclass
class PutRecord:
    keys: list[bytes]
    parent: bytes | None
    start_ns: int
    end_ns: int = NEVER_NS  #: the ack, else the writer's death, else never
    evicted: int | None = None
    refused: bool = False


@dataclass
class EvictionOracle:
    """Everything the writers, readers and compactions logged (see
    :class:`OracleWriter`)."""

    puts: list[PutRecord] = field(default_factory=list)
    parent: dict[bytes, bytes | None] = field(default_factory=dict)
    intent_ns: dict[bytes, int] = field(default_factory=dict)
    acked: set[bytes] = field(default_factory=set)
    intended: set[bytes] = field(default_factory=set)
    refused: set[bytes] = field(default_factory=set)
    touches: list[tuple[int, int, list[bytes]]] = field(default_factory=list)
    compactions: list[tuple[int, int, int]] = field(default_factory=list)
    compactions_killed: int = 0
    missing_after_ack: list[tuple[int, list[bytes]]] = field(default_factory=list)
    torn_lines: int = 0

    def ancestors_and_self(self, key: bytes) -> list[bytes]:
        out, seen = [], set()
        current: bytes | None = key
        while current is not None and current not in seen:
            seen.add(current)
            out.append(current)
            current = self.parent.get(current)
        return out


def record_death(run_dir: Path, pid: int) -> None:
    """Notes that ``pid`` is dead by now (called after reaping it): what it
    left unfinished in its log ended before this time."""
    line = f"{pid} {time.time_ns()}\n".encode()
    fd = os.open(run_dir / "deaths.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def _deaths(run_dir: Path) -> dict[int, int]:
    try:
        lines = (run_dir / "deaths.log").read_text().splitlines()
    except FileNotFoundError:
        return {}
    return {int(pid): int(t) for pid, t in (line.split() for line in lines if line.strip())}


def read_eviction_oracle(run_dir: Path) -> EvictionOracle:
    """Reads every process's log (a torn last line is ignored). A log named
    ``oracle-<role>-<pid>.log`` whose process is recorded dead has its
    unfinished put, touch or compaction end at the death; otherwise never."""
    oracle = EvictionOracle()
    deaths = _deaths(run_dir)
    for path in sorted(run_dir.glob("oracle-*.log")):
        pid = path.stem.rpartition("-")[2]
        died_ns = deaths.get(int(pid), NEVER_NS) if pid.isdigit() else NEVER_NS
        data = path.read_bytes()
        complete, _, torn = data.rpartition(b"\n")
        oracle.torn_lines += bool(torn)
        put: PutRecord | None = None
        touch: tuple[int, list[bytes]] | None = None
        compaction: tuple[int, int] | None = None
        for line in complete.split(b"\n"):
            if not line:
                continue
            tag, *tokens = line.decode().split(" ")
            attrs = dict(t.split("=", 1) for t in tokens if "=" in t)
            keys = [bytes.fromhex(t) for t in tokens if len(t) == 64]
            now = int(attrs.get("t", NEVER_NS))
            if tag == "I":
                parent = None if attrs.get("p", "-") == "-" else bytes.fromhex(attrs["p"])
                put = PutRecord(keys, parent, now, died_ns, refused=attrs.get("x") == "oversize")
                oracle.puts.append(put)
                if put.refused:
                    oracle.refused.update(keys)
                oracle.intended.update(keys)
                for i, key in enumerate(keys):
                    oracle.parent.setdefault(key, keys[i - 1] if i else parent)
                    oracle.intent_ns.setdefault(key, now)
            elif tag == "A" and put is not None:
                put.end_ns, put.evicted = now, int(attrs.get("e", 0))
                oracle.acked.update(keys)
                put = None
            elif tag == "R" and put is not None:
                put.refused, put.end_ns = True, 0
                oracle.refused.update(keys)
                put = None
            elif tag == "T":
                touch = (now, keys)
            elif tag == "U" and touch is not None:
                oracle.touches.append((touch[0], now, touch[1]))
                touch = None
            elif tag == "E":
                compaction = (now, int(attrs["target"]))
            elif tag == "F" and compaction is not None:
                oracle.compactions.append((compaction[0], now, compaction[1]))
                compaction = None
            elif tag == "M":
                oracle.missing_after_ack.append((now, keys))
        if touch is not None:  # died (or still) inside the reads: they may have touched
            oracle.touches.append((touch[0], died_ns, touch[1]))
        if compaction is not None:
            oracle.compactions.append((compaction[0], died_ns, compaction[1]))
            oracle.compactions_killed += 1
    return oracle


class EvictionRule:
    """Which acknowledged blocks an eviction may legally have removed.

    LRU order is put order, changed by touches (which make a block and its
    ancestors newer) and by refiles: an eviction that passes a block with
    children files it again as used now (``ucm_db/index/writes.py``,
    ``_oldest_tail``), which no process logs. A put's eviction takes LRU
    blocks except its own batch and the batch's ancestors (at most
    ``max_chain_bytes``); a compaction evicts LRU blocks down to its target.
    So block B can be gone only if, counting upper bounds of stored sizes,
    the blocks put or touched after B's put started (including operations
    whose process died in them) plus the blocks refiled since then plus B
    plus a chain's ancestors exceed the capacity, or plus B exceed a
    compaction's target that ran after B's put started.

    Refiles are read from the store: blocks still stored whose put ended
    before B's started but whose access time is later (:func:`refiled_after`).
    A block refiled after B's put and evicted since is not seen, so a
    missing block can rarely be reported that such a block pushed out.
    """

    def __init__(self, oracle: EvictionOracle, *, size_range: tuple[int, int], capacity_bytes: int, max_chain_bytes: int) -> None:
        self.oracle = oracle
        self.size_range = size_range
        self.capacity_bytes = capacity_bytes
        self.max_chain_bytes = max_chain_bytes
        last_newer: dict[bytes, int] = {}
        for put in oracle.puts:
            if not put.refused:
                for key in put.keys:
                    last_newer[key] = max(last_newer.get(key, 0), put.end_ns)
        for _start, end, keys in oracle.touches:
            for key in keys:
                for k in oracle.ancestors_and_self(key):
                    last_newer[k] = max(last_newer.get(k, 0), end)
        #: per key, the last logged moment that made it newer (its put's end, a touch of it or a descendant)
        self.last_newer_ns = last_newer
        ordered = sorted(last_newer.items(), key=lambda kv: kv[1])
        self._ends = [end for _, end in ordered]
        sizes = [self.size_bytes(k) for k, _ in ordered]
        self._suffix_bytes = [0] * (len(sizes) + 1)
        for i in range(len(sizes) - 1, -1, -1):
            self._suffix_bytes[i] = self._suffix_bytes[i + 1] + sizes[i]

    def size_bytes(self, key: bytes) -> int:
        return size_for(key, *self.size_range) + STORED_OVERHEAD_BYTES

    def newer_bytes(self, key: bytes, before_ns: int = NEVER_NS) -> int:
        """Upper bound of the bytes put or touched after ``key``'s put started
        (by operations that started before ``before_ns``)."""
        since = self.oracle.intent_ns[key]
        if before_ns >= NEVER_NS:
            return self._suffix_bytes[bisect.bisect_right(self._ends, since)]
        newer: set[bytes] = set()
        for put in self.oracle.puts:
            if not put.refused and put.end_ns > since and put.start_ns < before_ns:
                newer.update(put.keys)
        for start, end, keys in self.oracle.touches:
            if end > since and start < before_ns:
                for k in keys:
                    newer.update(self.oracle.ancestors_and_self(k))
        return sum(self.size_bytes(k) for k in newer)

    def may_be_evicted(self, key: bytes, before_ns: int = NEVER_NS, refiled_bytes: int = 0) -> bool:
        """``refiled_bytes``: blocks refiled after ``key``'s put started (class docstring)."""
        newer = self.newer_bytes(key, before_ns) + refiled_bytes + self.size_bytes(key)
        if newer + self.max_chain_bytes > self.capacity_bytes:
            return True
        since = self.oracle.intent_ns[key]
        return any(end > since and start < before_ns and newer > target for start, end, target in self.oracle.compactions)


def read_untouched(store: ucm_db.Store, keys: list[bytes]) -> list[bytes | None | str]:
    """Decoded payloads read below the Store API (no LRU touch); None where
    absent, the error text where corrupt."""
    from ucm_db import codec

    out: list[bytes | None | str] = []
    for start in range(0, len(keys), 256):
        batch = keys[start : start + 256]

        def visit(i: int, head: memoryview, body: memoryview, batch: list[bytes] = batch) -> bytes | str:
            try:
                return bytes(codec.decode_parts(head, body, batch[i]))
            except ucm_db.CorruptBlockError as exc:
                return f"corrupt: {exc}"

        out.extend(store._tier.read_blocks(batch, visit))
    return out


def refiled_after(oracle: EvictionOracle, rule: EvictionRule, stored: list[bytes], metas: list[Any]) -> Callable[[bytes], int]:
    """Bytes (upper bounds) of the stored blocks the store refiled after a
    key's put started: the last logged put or touch that made them newer
    ended before it, their access time is later (:class:`EvictionRule`)."""
    # (last time the oracle saw the block made newer, its access time in the store, its size)
    used = [(rule.last_newer_ns[k], m.access_ns, rule.size_bytes(k))
            for k, m in zip(stored, metas) if m is not None and k in rule.last_newer_ns]

    def bytes_after(key: bytes) -> int:
        since = oracle.intent_ns[key]
        return sum(size for logged_ns, access_ns, size in used if logged_ns <= since < access_ns)
    return bytes_after


def check_store_under_pressure(
    store: ucm_db.Store, run_dir: Path, *, size_range: tuple[int, int], capacity_bytes: int, max_chain_bytes: int, final: bool,
) -> dict[str, Any]:
    """Compares a store under capacity pressure with the eviction oracle.

    Violations: an acknowledged block missing that no eviction could have
    removed (``lost``); wrong or corrupt bytes of any stored block; a block
    nobody put; a block of a put refused with StoreFullError; a chain
    missing right after its put returned when no eviction could explain it;
    a stored block whose parent is not stored (at the final check, when no
    writer runs). Reads go below the Store API, so checking touches nothing.
    """
    # Writers may still run: list first (an intent is logged before its put),
    # read the acknowledged blocks, then read the logs again, so every
    # operation that could have evicted a block before it was read is known.
    stored = list(store._tier.iterate())
    stored_metas = store._tier.metas(stored)
    acked = sorted(read_eviction_oracle(run_dir).acked)
    values = read_untouched(store, acked)
    oracle = read_eviction_oracle(run_dir)
    rule = EvictionRule(oracle, size_range=size_range, capacity_bytes=capacity_bytes, max_chain_bytes=max_chain_bytes)
    refiled = refiled_after(oracle, rule, stored, stored_metas)
    lost, wrong, strict = [], [], 0
    for key, value in zip(acked, values):
        protected = not rule.may_be_evicted(key, refiled_bytes=refiled(key))
        strict += protected
        if value is None and protected:
            lost.append(key.hex())
        elif value is not None and value != payload_for(key, size_for(key, *size_range)):
            wrong.append(key.hex())
    unknown = [k.hex() for k in set(stored) - oracle.intended]
    refused_present = [k.hex() for k in set(stored) & oracle.refused]
    others = sorted(set(stored) & oracle.intended - oracle.acked)
    wrong += [k.hex() for k, v in zip(others, read_untouched(store, others))
              if v is not None and v != payload_for(k, size_for(k, *size_range))]
    unexplained = [k.hex() for t, keys in oracle.missing_after_ack for k in keys if not rule.may_be_evicted(k, t, refiled(k))]
    orphans: list[str] = []
    if final:
        present = set(stored)
        orphans = [k.hex() for k, m in zip(stored, stored_metas) if m is not None and m.parent is not None and m.parent not in present]
    stats = store.stats()
    evicted_logged = sum(p.evicted or 0 for p in oracle.puts)
    return {
        "acked": len(acked), "strictly_checked": strict, "lost": lost[:10], "n_lost": len(lost), "wrong": wrong[:10],
        "n_wrong": len(wrong), "unknown": unknown[:10], "n_unknown": len(unknown), "refused_present": refused_present[:10],
        "refused": len(oracle.refused), "missing_after_ack": len(oracle.missing_after_ack), "unexplained_missing_after_ack": unexplained[:10],
        "orphans": orphans[:10], "index_problems": store._tier.check()[:10], "stored_blocks": len(stored),
        "quarantined": stats.quarantined, "evictions": stats.evictions, "evictions_logged_by_puts": evicted_logged,
        "compactions": len(oracle.compactions), "compactions_killed": oracle.compactions_killed, "touch_windows": len(oracle.touches), "torn_lines": oracle.torn_lines,
        "in_flight": len(oracle.intended - oracle.acked - oracle.refused),
    }


@contextlib.contextmanager
def mounted_tmpfs(mount_point: Path, size_mib: int) -> Iterator[Path]:
    """A tmpfs of ``size_mib`` mounted at ``mount_point`` (created) for a
    real full disk; the test is skipped where mounting needs a privilege it
    lacks. Unmounted (lazily) on exit."""
    mount_point.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(mount_point)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN): {proc.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def put_until_refused(store: ucm_db.Store, keys: list[bytes], block_bytes: int) -> tuple[int, ucm_db.TierError]:
    """Puts ``keys[1:]`` one block at a time onto ``keys[0]`` (stored
    already) until a put is refused; returns the blocks acknowledged,
    ``keys[0]`` included, and the refusal. Fails if none is refused."""
    for i in range(1, len(keys)):
        try:
            store.put(NS, keys[i:i + 1], [payload_for(keys[i], block_bytes)], parent=keys[i - 1])
        except ucm_db.TierError as refusal:
            return i, refusal
    raise AssertionError(f"all {len(keys)} puts were acknowledged")


def put_once_taken_again(store: ucm_db.Store, keys: list[bytes], index: int, block_bytes: int, why: str,
                         timeout_s: float = 30.0) -> None:
    """Puts ``keys[index]`` (onto ``keys[index - 1]``), retrying while it is
    refused, for at most ``timeout_s``; fails with ``why`` after that."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            store.put(NS, keys[index:index + 1], [payload_for(keys[index], block_bytes)], parent=keys[index - 1])
            return
        except ucm_db.TierError:
            assert time.monotonic() < deadline, f"puts still refused {timeout_s:g} s after {why}"
            time.sleep(0.05)
