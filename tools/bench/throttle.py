"""A bandwidth-limited remote for benchmarks and tests: ``throttled://``.

:class:`ThrottledFileSystem` is a directory on the local disk served like an
object store (whole-object ``pipe_file`` writes, ranged ``cat_file`` reads),
with every byte in or out passing one token bucket of
``bandwidth_bytes_per_s`` shared by all threads, as one network link
would be. It is measuring code: nothing in the product imports it.

Example::

    register()
    ucm_db.open(path, remote="throttled://kv",
                remote_options={"path": "/srv/remote", "bandwidth_bytes_per_s": 100e6})
"""

from __future__ import annotations

import threading
import time
from typing import Any

import fsspec
from fsspec.implementations.dirfs import DirFileSystem
from fsspec.implementations.local import LocalFileSystem

PROTOCOL = "throttled"


class TokenBucket:
    """Admits bytes at ``rate`` per second across threads (bursts up to
    ``burst_s`` seconds of traffic)."""

    def __init__(self, rate: float, burst_s: float = 0.01) -> None:
        if rate <= 0:
            raise ValueError("bandwidth must be positive")
        self.rate = rate
        self._burst = rate * burst_s
        self._tokens = self._burst
        self._at = time.monotonic()
        self._lock = threading.Lock()

    def take(self, amount: int) -> None:
        """Blocks until ``amount`` bytes may pass."""
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self._burst, self._tokens + (now - self._at) * self.rate)
            self._at = now
            self._tokens -= amount
            wait_s = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if wait_s > 0:
            time.sleep(wait_s)


class ThrottledFileSystem(DirFileSystem):
    """A local directory behind a link of ``bandwidth_bytes_per_s``, each
    read or write request first waiting ``latency_s`` (its round trip; a
    missing object's too)."""

    protocol = PROTOCOL

    def __init__(self, path: str, bandwidth_bytes_per_s: float, latency_s: float = 0.0, **options: Any) -> None:
        super().__init__(path=path, fs=LocalFileSystem(auto_mkdir=True), **options)
        self.bucket = TokenBucket(float(bandwidth_bytes_per_s))
        if latency_s < 0:
            raise ValueError("latency must not be negative")
        self.latency_s = float(latency_s)

    def pipe_file(self, path: str, value: bytes, *args: Any, **kwargs: Any) -> Any:
        if self.latency_s:
            time.sleep(self.latency_s)
        self.bucket.take(len(value))
        return super().pipe_file(path, value, *args, **kwargs)

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> Any:
        if self.latency_s:
            time.sleep(self.latency_s)
        data = super().cat_file(path, start=start, end=end, **kwargs)
        self.bucket.take(len(data))
        return data


def register() -> None:
    """Makes ``throttled://`` URLs open a :class:`ThrottledFileSystem`."""
    fsspec.register_implementation(PROTOCOL, ThrottledFileSystem, clobber=True)
