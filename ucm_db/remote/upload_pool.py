"""The uploader's thread pool (:mod:`ucm_db.remote.uploader`): its remote
calls (uploads, ancestor checks, manifests, retractions' deletes), counted
while they run, so that the uploader lets go of the store directory's
election only once every call it started has ended.

Why: stopping (a store's close) must not wait for a remote that hangs, so
the calls in flight are left running. The audit that taught it (r3): the
election lock was let go at once, and the next uploader of the store
directory (the store opened again, another process of it) confirmed the
retraction of a block whose upload was still in flight; the upload landed
after, and other nodes served the deleted (wrong) KV. A retraction's
confirmation follows every upload that could have read the block before its
delete only if every such upload ran under the election it is confirmed
under (:mod:`ucm_db.remote.retraction`).

Invariants:
    * :meth:`UploadPool.shutdown_then` cancels the calls not started and
      runs its callback (the uploader's release of the election) once the
      last running call has ended: at once when none runs, else on the
      thread of the last to end. A call that never ends (a remote that never
      answers) keeps it held until this process ends, when the kernel
      releases the lock; meanwhile no uploader of the store directory runs.
    * The calls run on daemon threads (:mod:`ucm_db.remote.daemon_pool`):
      the interpreter's exit does not wait for them, so a process whose
      remote hangs still exits once its main returns. The lock is let go
      only by the callback above or by the process's end, and a call left
      running dies with the process: no upload of this process lands after
      the next uploader took the election (beyond a request the remote had
      received whole when the process ended, as after a kill).
    * :meth:`UploadPool.run` returns None as soon as ``stop`` is set,
      leaving its calls running (counted as above): the uploader's stop for
      its batches, the store's close beginning for a write-through put's
      calls (a put waiting on a hung remote must not hold close up).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, wait
from typing import Any, TypeVar

from ucm_db.cpu_placement import place_current_thread
from ucm_db.remote.daemon_pool import DaemonPool

#: How often :meth:`UploadPool.run` looks at its stop flag.
STOP_POLL_S = 0.1

T = TypeVar("T")


class UploadPool:
    """A thread pool that counts its running calls (module invariants).

    Args:
        workers: calls run at once.
    """

    def __init__(self, workers: int) -> None:
        self._pool = DaemonPool(workers, "ucm-db-upload", place_current_thread)
        self._lock = threading.Lock()
        self._running = 0  # submitted and not ended (done or cancelled)
        self._on_idle: Callable[[], None] | None = None

    @property
    def running(self) -> int:
        """Calls submitted that have not ended."""
        with self._lock:
            return self._running

    def submit(self, call: Callable[..., T], *args: Any) -> Future[T]:
        """Runs ``call(*args)`` on the pool."""
        with self._lock:
            self._running += 1
        try:
            future = self._pool.submit(call, *args)
        except BaseException:
            self._ended()
            raise
        future.add_done_callback(self._ended)
        return future

    def run(self, calls: list[Callable[[], str | None]], stop: threading.Event) -> list[str | None] | None:
        """Runs remote calls at once; returns their errors (None for a
        success; an exception is returned as its text), or None when
        ``stop`` is set first: a hung remote must not hold up close(), and
        the caller touches nothing local after stop."""
        futures = [self.submit(_catching, call) for call in calls]
        while not stop.is_set():
            _done, pending = wait(futures, timeout=STOP_POLL_S)
            if not pending:
                return [f.result() for f in futures]
        return None

    def shutdown_then(self, on_idle: Callable[[], None]) -> int:
        """Takes no more calls, cancels those not started, and runs
        ``on_idle`` once none runs (now, or when the last ends); returns
        how many were still running."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            running = self._running
            if running:
                self._on_idle = on_idle
        if not running:
            on_idle()
        return running

    def _ended(self, _future: object = None) -> None:
        with self._lock:
            self._running -= 1
            on_idle = self._on_idle if self._running == 0 else None
            if on_idle is not None:
                self._on_idle = None
        if on_idle is not None:
            on_idle()


def _catching(call: Callable[[], str | None]) -> str | None:
    try:
        return call()
    except Exception as exc:  # noqa: BLE001 - any failure keeps the rows queued
        return f"{type(exc).__name__}: {exc}"
