"""Thread pools for remote calls whose threads never hold up the
interpreter's exit.

Why: :class:`concurrent.futures.ThreadPoolExecutor` joins its worker threads
when the interpreter exits (its module registers that hook), even after
``shutdown(wait=False)``. One remote call that never returns (an NFS mount
that stops answering, an S3 endpoint that accepts the connection and never
replies) kept a process that had closed its store, and returned from its
main, from ever exiting: it had to be killed.

Invariants:
    * Workers are daemon threads that nothing joins: the interpreter's exit
      never waits for them; a call still running then ends with the process
      (so a remote write it was making never lands after the process is
      gone, beyond a request the remote had received whole, as after a kill).
    * At most ``max_workers`` threads; one is started only when no idle one
      is waiting for work. Each runs ``initializer`` first.
    * :meth:`DaemonPool.shutdown` takes no more calls, cancels the queued
      ones (``cancel_futures``), and waits for the running ones only when
      ``wait`` is true; idle workers end.
    * :attr:`DaemonPool.busy` counts the calls running, for the close's log
      of what it abandons.
"""

from __future__ import annotations

import logging
import queue
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

_log = logging.getLogger("ucm_db")

#: A call queued: its future, the callable, its arguments.
_Work = tuple[Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class DaemonPool(Executor):
    """An executor on daemon threads (module invariants).

    Args:
        max_workers: threads at most.
        thread_name_prefix: names the threads ``<prefix>_<n>``.
        initializer: run first on each thread.
    """

    def __init__(self, max_workers: int, thread_name_prefix: str, initializer: Callable[[], object] | None = None) -> None:
        if max_workers < 1:
            raise ValueError("max_workers must be at least 1")
        self._max_workers = max_workers
        self._prefix = thread_name_prefix
        self._initializer = initializer
        self._queue: queue.SimpleQueue[_Work | None] = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)  # workers waiting for work
        self._lock = threading.Lock()
        self._threads: set[threading.Thread] = set()  # read by the store's close (ucm_db.store.state)
        self._busy = 0
        self._shut = False

    @property
    def busy(self) -> int:
        """Calls running now."""
        with self._lock:
            return self._busy

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        """Queues ``fn(*args, **kwargs)``; RuntimeError after shutdown."""
        future: Future[Any] = Future()
        with self._lock:
            if self._shut:
                raise RuntimeError("cannot schedule new futures after shutdown")
            self._queue.put((future, fn, args, kwargs))
            if not self._idle.acquire(blocking=False) and len(self._threads) < self._max_workers:
                self._start_thread()
        return future

    def _start_thread(self) -> None:
        def wake(_ref: object, q: queue.SimpleQueue[_Work | None] = self._queue) -> None:
            q.put(None)  # the pool was dropped without a shutdown: its workers end

        thread = threading.Thread(target=_work, args=(weakref.ref(self, wake), self._queue, self._initializer),
                                  name=f"{self._prefix}_{len(self._threads)}", daemon=True)
        thread.start()
        self._threads.add(thread)

    def _started(self, future: Future[Any]) -> bool:
        if not future.set_running_or_notify_cancel():
            return False
        with self._lock:
            self._busy += 1
        return True

    def _ended(self, ran: bool) -> None:
        if ran:
            with self._lock:
                self._busy -= 1
        self._idle.release()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._shut = True
        if cancel_futures:
            while True:
                try:
                    work = self._queue.get_nowait()
                except queue.Empty:
                    break
                if work is not None:
                    work[0].cancel()
        self._queue.put(None)  # each worker passes it on as it ends
        if wait:
            for thread in list(self._threads):
                thread.join()


def _work(pool_ref: weakref.ref[DaemonPool], work_queue: queue.SimpleQueue[_Work | None],
          initializer: Callable[[], object] | None) -> None:
    if initializer is not None:
        try:
            initializer()
        except Exception:  # noqa: BLE001 - a placement failure must not lose the pool's calls
            _log.debug("ucm-db: a remote pool thread's initializer failed", exc_info=True)
    while True:
        work = work_queue.get()
        if work is None:
            work_queue.put(None)  # wakes the next worker: shutdown (or the pool dropped)
            return
        _run(pool_ref, *work)
        del work


def _run(pool_ref: weakref.ref[DaemonPool], future: Future[Any], fn: Callable[..., Any], args: tuple[Any, ...],
         kwargs: dict[str, Any]) -> None:
    """Runs one queued call (unless cancelled), counted busy while it runs."""
    pool = pool_ref()
    started = pool._started(future) if pool is not None else future.set_running_or_notify_cancel()
    del pool  # a dropped pool is collected while its workers run or wait
    if started:
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - the caller reads it from the future
            future.set_exception(exc)
    pool = pool_ref()
    if pool is not None:
        pool._ended(started)
