"""Fault-injecting and latency-adding fsspec filesystem, for the tests.

``ucmfault://`` wraps any fsspec filesystem and injects the faults a real
remote produces: added latency, timeouts, connection errors, a remote that
hangs (is "down"), truncated reads and bit-flipped reads. The product knows
nothing of it: a test calls :func:`register` (the remote tests' conftest
does, and so does a child process that opens such a store), after which a
store opens it through its ordinary config::

    ucm_db.open(path, remote="ucmfault://bucket/kv", remote_options={
        "target_protocol": "s3", "target_options": {"endpoint_url": ...},
        "plan": FaultPlan(read_error_rate=0.2, bitflip_rate=0.1, seed=1)})

(``plan`` may also be given as a dict of :class:`FaultPlan` fields, which
survives JSON, e.g. for a subprocess.)

Invariants:
    * Paths pass to the target unchanged; "not found" passes through as is
      (a fault is never disguised as a miss, nor a miss as a fault).
    * Writes go through :func:`~ucm_db.remote.tier.write_whole` on the
      target, so a wrapped local directory keeps its atomic rename.
    * Faults are drawn from a seeded RNG: a run is reproducible for a given
      sequence of calls (threads can reorder the draws).
    * A hang waits on :meth:`FaultPlan.heal` (or ``hang_s``), so tests can
      release stuck threads instead of leaving them behind.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from typing import Any

import fsspec
from fsspec.spec import AbstractFileSystem

from ucm_db.errors import ConfigError
from ucm_db.remote.tier import write_whole

PROTOCOL = "ucmfault"


class FaultPlan:
    """What to inject; mutable at run time (e.g. take the remote down).

    A plain class, not a dataclass: it holds live shared state (a lock, an
    event), and config snapshots copy dataclasses field by field.

    Attributes:
        latency_s: added to every request.
        read_error_rate: share of reads raising ConnectionError.
        write_error_rate: share of writes raising ConnectionError.
        timeout_rate: share of requests that sleep ``timeout_s`` and raise
            TimeoutError.
        timeout_s: how long such a request takes before failing.
        truncate_rate: share of reads returning a random prefix.
        bitflip_rate: share of reads with one random bit flipped.
        down: every request hangs until :meth:`heal` or ``hang_s``, then
            raises TimeoutError.
        hang_s: longest a hang lasts.
        slow_read_bytes, slow_read_s: a read asking for more than
            ``slow_read_bytes`` (a whole object; 0: none) first sleeps
            ``slow_read_s``: fetches slow while presence probes (small
            ranged reads) stay fast.
        kill_after_removes: SIGKILL this process right after its nth file
            removal (0: never): a crash point inside a caller's delete loop
            (remote GC), with no hook in the product.
        seed: RNG seed.
        injected: how many faults of each kind were injected.
        writes_in_flight: ``pipe_file`` calls under way now (latency included).
        max_writes_in_flight: the most that were ever under way at once: how
            many uploads a caller overlapped (a gauge, not a fault).
    """

    FIELDS = ("latency_s", "read_error_rate", "write_error_rate", "timeout_rate", "timeout_s",
              "truncate_rate", "bitflip_rate", "down", "hang_s", "slow_read_bytes", "slow_read_s", "kill_after_removes",
              "seed")

    def __init__(
        self, *, latency_s: float = 0.0, read_error_rate: float = 0.0, write_error_rate: float = 0.0,
        timeout_rate: float = 0.0, timeout_s: float = 0.05, truncate_rate: float = 0.0,
        bitflip_rate: float = 0.0, down: bool = False, hang_s: float = 30.0, slow_read_bytes: int = 0,
        slow_read_s: float = 0.0, kill_after_removes: int = 0, seed: int = 0,
    ) -> None:
        self.latency_s = latency_s
        self.read_error_rate = read_error_rate
        self.write_error_rate = write_error_rate
        self.timeout_rate = timeout_rate
        self.timeout_s = timeout_s
        self.truncate_rate = truncate_rate
        self.bitflip_rate = bitflip_rate
        self.down = down
        self.hang_s = hang_s
        self.slow_read_bytes = slow_read_bytes
        self.slow_read_s = slow_read_s
        self.kill_after_removes = kill_after_removes
        self.seed = seed
        self.injected: dict[str, int] = {}
        self.writes_in_flight = 0
        self.max_writes_in_flight = 0
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._healed = threading.Event()

    def __repr__(self) -> str:
        return "FaultPlan(" + ", ".join(f"{name}={getattr(self, name)!r}" for name in self.FIELDS) + ")"

    def __deepcopy__(self, memo: dict[int, Any]) -> FaultPlan:
        # A plan is shared, live state (config snapshots deep-copy options).
        return self

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FaultPlan:
        unknown = sorted(set(data) - set(cls.FIELDS))
        if unknown:
            raise ConfigError(f"unknown fault plan field(s) {', '.join(unknown)}", hint=f"valid: {', '.join(cls.FIELDS)}")
        return cls(**data)

    def take_down(self) -> None:
        self._healed.clear()
        self.down = True

    def heal(self) -> None:
        """Brings the remote back and releases every hung request."""
        self.down = False
        self._healed.set()

    def clear(self) -> None:
        """No more faults (the remote behaves normally)."""
        self.heal()
        self.read_error_rate = self.write_error_rate = self.timeout_rate = 0.0
        self.truncate_rate = self.bitflip_rate = self.latency_s = self.slow_read_s = 0.0

    def chance(self, rate: float) -> bool:
        if rate <= 0:
            return False
        with self._lock:
            return self._rng.random() < rate

    def count(self, what: str) -> None:
        with self._lock:
            self.injected[what] = self.injected.get(what, 0) + 1

    def write_started(self) -> None:
        with self._lock:
            self.writes_in_flight += 1
            self.max_writes_in_flight = max(self.max_writes_in_flight, self.writes_in_flight)

    def write_finished(self) -> None:
        with self._lock:
            self.writes_in_flight -= 1

    def randint(self, lo: int, hi: int) -> int:
        with self._lock:
            return self._rng.randint(lo, hi)

    # -- fault points --------------------------------------------------------
    def before(self, error_rate: float) -> None:
        """Latency, hangs, timeouts and errors before a request."""
        if self.latency_s:
            time.sleep(self.latency_s)
        if self.down:
            self.count("hang")
            self._healed.wait(self.hang_s)
            raise TimeoutError("injected: remote down")
        if self.chance(self.timeout_rate):
            self.count("timeout")
            time.sleep(self.timeout_s)
            raise TimeoutError("injected: request timed out")
        if self.chance(error_rate):
            self.count("error")
            raise ConnectionError("injected: connection reset")

    def mangle(self, data: bytes) -> bytes:
        """Truncates or bit-flips a read's bytes, by the plan's rates."""
        if data and self.chance(self.truncate_rate):
            self.count("truncate")
            return data[: self.randint(0, len(data) - 1)]
        if data and self.chance(self.bitflip_rate):
            self.count("bitflip")
            at = self.randint(0, len(data) * 8 - 1)
            flipped = bytearray(data)
            flipped[at // 8] ^= 1 << (at % 8)
            return bytes(flipped)
        return data


class FaultyFileSystem(AbstractFileSystem):  # type: ignore[misc]
    """fsspec filesystem delegating to a target through a :class:`FaultPlan`."""

    protocol = (PROTOCOL,)
    cachable = False  # each store gets its own plan

    def __init__(
        self,
        target_protocol: str = "memory",
        target_options: dict[str, Any] | None = None,
        plan: FaultPlan | dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.target = fsspec.filesystem(target_protocol, **dict(target_options or {}))
        if isinstance(plan, dict):
            plan = FaultPlan.from_dict(plan)
        self.plan = plan if plan is not None else FaultPlan()

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        self.plan.before(self.plan.read_error_rate)
        span = None if end is None else end - (start or 0)
        if self.plan.slow_read_bytes and (span is None or span > self.plan.slow_read_bytes):
            self.plan.count("slow_read")
            time.sleep(self.plan.slow_read_s)
        data = self.target.cat_file(path, start=start, end=end, **kwargs)
        return self.plan.mangle(bytes(data))

    def pipe_file(self, path: str, value: bytes, **kwargs: Any) -> None:
        self.plan.write_started()
        try:
            self.plan.before(self.plan.write_error_rate)
            write_whole(self.target, path, bytes(value))
        finally:
            self.plan.write_finished()

    def exists(self, path: str, **kwargs: Any) -> bool:
        self.plan.before(self.plan.read_error_rate)
        return bool(self.target.exists(path))

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        self.plan.before(self.plan.read_error_rate)
        return dict(self.target.info(path, **kwargs))

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
        self.plan.before(self.plan.read_error_rate)
        return self.target.ls(path, detail=detail, **kwargs)

    def find(self, path: str, **kwargs: Any) -> Any:
        self.plan.before(self.plan.read_error_rate)
        return self.target.find(path, **kwargs)

    def rm_file(self, path: str) -> None:
        self.plan.before(self.plan.write_error_rate)
        self.target.rm_file(path)
        if self.plan.kill_after_removes:
            self.plan.count("remove")
            if self.plan.injected["remove"] == self.plan.kill_after_removes:
                os.kill(os.getpid(), signal.SIGKILL)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self.target.makedirs(path, exist_ok=exist_ok)

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        self.target.mkdir(path, create_parents=create_parents, **kwargs)


def register() -> None:
    """Registers ``ucmfault://`` with fsspec in this process (idempotent)."""
    fsspec.register_implementation(PROTOCOL, FaultyFileSystem, clobber=True)
