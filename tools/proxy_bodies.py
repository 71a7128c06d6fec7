"""The PD proxy's worker pool for large request bodies: a body over
``offload_body_bytes`` is parsed and encoded (:func:`~ucm_db.tools.proxy_request.prepare`)
in a worker process, never on the event loop (:class:`BodyPool`, whose
invariants say how).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import threading
import time
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from ucm_db.tools.proxy_request import BadRequest, Prepared, ProxyBusy, prepare
from ucm_db.tools.proxy_upstreams import MIB

#: How long a stopping proxy waits for a body worker to take its stop message before terminating it.
WORKER_STOP_WAIT_S = 5.0
#: How long a dead worker's exit code may take to appear where the pool's manager thread reaped it.
EXIT_CODE_WAIT_S = 0.5


class BodyPool:
    """Prepares a body over ``offload_body_bytes`` in a worker process; a
    smaller one on the event loop (a few ms at most).

    Invariants:
        * The C JSON parser holds the GIL for a whole call, so a thread
          would stall every other stream as the event loop would: a large
          body is parsed and encoded in a process of a pool started on first
          need (``spawn``: no copy of the server's event loop or sockets),
          of ``workers`` processes. A spawned worker imports the main
          module: a program serving :func:`~ucm_db.tools.proxy.build_app`
          itself starts it under ``if __name__ == "__main__":`` (``ucm-db
          proxy`` and ``python -m ucm_db.tools.proxy`` do).
        * What crosses the pipe is the raw body one way and
          :func:`prepare_in_worker`'s bytes, str and int the other: never an
          object graph of the body.
        * A worker's answer is :func:`prepare`'s to the byte: the same
          requests, the same 400 for the same bad body, before any server is
          called.
        * Large bodies in flight (waiting for a worker or prepared by one)
          hold at most ``budget_bytes`` (one is always let in): past it the
          client gets 503 with ``Retry-After`` (:class:`ProxyBusy`), not an
          unbounded queue of bodies in memory. A body counts until its
          worker is done with it, even when its client left first.
        * A worker that dies while preparing bodies is a 503 for the
          requests it held (the message says how it ended: signal 9 is
          likely the out-of-memory killer). One that died idle costs no
          request: the body was not sent, a fresh pool takes it.
        * :meth:`close` waits for every worker to exit (terminating one
          that does not within :data:`WORKER_STOP_WAIT_S`): uvicorn re-raises
          SIGTERM after the lifespan ends, so no exit hook would stop them.

    Why a process pool: a thread does not help (the GIL), and a lower
    ``--max-body-mb`` alone does not either (measured on the event loop:
    1 MiB of ``logit_bias`` held it 140 ms, 24 MiB 3.3 s). The threshold,
    256 KiB, holds the loop at most ~20 ms (0.25 MiB of ``logit_bias``
    measured 20 ms to parse and encode); a 128K-token prompt sent as token
    ids (about 1 MiB) goes to a worker, whose round trip adds a few ms.
    """

    def __init__(self, offload_body_bytes: int, budget_bytes: int, workers: int) -> None:
        self.offload_body_bytes, self.budget_bytes, self.workers = offload_body_bytes, budget_bytes, workers
        self._pool: ProcessPoolExecutor | None = None
        self._held_bytes = 0
        self._lock = threading.Lock()  # done-callbacks run on the pool's own thread

    async def prepare(self, raw: bytes) -> Prepared:
        if len(raw) <= self.offload_body_bytes:
            return prepare(raw)
        with self._lock:
            if self._held_bytes and self._held_bytes + len(raw) > self.budget_bytes:
                raise ProxyBusy(f"{self._held_bytes / MIB:.0f} MiB of large request bodies are being prepared "
                                f"(the bound is {self.budget_bytes / MIB:g} MiB); retry shortly")
            self._held_bytes += len(raw)
        try:
            pool, future = self._submit(raw)
        except BrokenProcessPool as exc:
            self._release(len(raw))
            raise ProxyBusy("the workers preparing large request bodies cannot be started; retry shortly") from exc
        except BaseException:
            self._release(len(raw))
            raise
        future.add_done_callback(lambda _: self._release(len(raw)))
        try:
            status, message, members, prefill_fields, decode_fields, params, flags = await asyncio.wrap_future(future)
        except BrokenProcessPool as exc:
            codes = await asyncio.to_thread(_exit_codes, pool)
            raise self._dropped(pool, codes) from exc
        if status:
            raise BadRequest(status, message)
        return Prepared(members, prefill_fields, decode_fields, params if flags & 2 else None, bool(flags & 1))

    def close(self) -> None:
        """Stops the workers and waits for them to exit (blocking: call it
        off the event loop). A worker still running after
        :data:`WORKER_STOP_WAIT_S` is terminated: nothing outlives the proxy."""
        pool, self._pool = self._pool, None
        if pool is not None:
            _stop(pool)

    def _submit(self, raw: bytes) -> tuple[ProcessPoolExecutor, Future[Any]]:
        pool = self._pool or self._start()
        try:
            return pool, pool.submit(prepare_in_worker, raw)
        except BrokenProcessPool:
            # A worker died while idle: nothing was sent, so a fresh pool takes the body.
            self._discard(pool)
        pool = self._start()
        return pool, pool.submit(prepare_in_worker, raw)

    def _start(self) -> ProcessPoolExecutor:
        self._pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"))
        return self._pool

    def _discard(self, pool: ProcessPoolExecutor) -> None:
        if self._pool is pool:
            self._pool = None
            pool.shutdown(wait=False, cancel_futures=True)  # a broken pool's manager thread ends it itself

    def _dropped(self, pool: ProcessPoolExecutor, codes: list[int]) -> ProxyBusy:
        self._discard(pool)
        if -9 in codes:
            why = "was killed by signal 9 (out of memory?)"
        elif codes:
            why = "exited with " + ", ".join(f"signal {-c}" if c < 0 else f"code {c}" for c in codes)
        else:
            why = "died"
        return ProxyBusy(f"the worker preparing large request bodies {why} while preparing this one; retry shortly")

    def _release(self, size: int) -> None:
        with self._lock:
            self._held_bytes -= size


def prepare_in_worker(raw: bytes) -> tuple[int, str, bytes, bytes, bytes, bytes, int]:
    """:func:`prepare` in a worker: ``(status, message, members, prefill
    fields, decode fields, client params, flags)``; a status is a
    :class:`BadRequest`'s, 0 for none; flags: 1 stream, 2 client params sent."""
    try:
        done = prepare(raw)
    except BadRequest as exc:
        return exc.status, exc.message, b"", b"", b"", b"", 0
    except MemoryError:
        message = "the request body is too large to prepare in the proxy's memory; send a smaller one"
        return 413, message, b"", b"", b"", b"", 0
    flags = int(done.stream) | (2 if done.client_params is not None else 0)
    return 0, "", done.members, done.prefill_fields, done.decode_fields, done.client_params or b"", flags


def _workers_of(pool: ProcessPoolExecutor) -> list[multiprocessing.process.BaseProcess]:
    # ProcessPoolExecutor exposes neither its processes nor their exit codes; read its own table.
    return list((getattr(pool, "_processes", None) or {}).values())


def _exit_codes(pool: ProcessPoolExecutor) -> list[int]:
    """The non-zero exit codes of a broken pool's workers (blocking, briefly: its manager thread may
    see a worker's pipe close before the worker can be reaped, and terminates the others).

    That thread joins the workers too: where it reaped one between this thread's wait and its
    own ``waitpid`` (which then finds no child), the exit code reads None until that thread has
    stored it, so it is read again for a moment."""
    codes = set()
    for worker in _workers_of(pool):
        worker.join(WORKER_STOP_WAIT_S)
        deadline_s = time.monotonic() + EXIT_CODE_WAIT_S
        while worker.exitcode is None and time.monotonic() < deadline_s:
            time.sleep(0.005)
        if worker.exitcode:
            codes.add(worker.exitcode)
    return sorted(codes)


def _stop(pool: ProcessPoolExecutor) -> None:
    """``pool`` shut down and its workers gone: its manager thread sends each
    worker its stop message and joins it; one that has not exited within
    :data:`WORKER_STOP_WAIT_S` is terminated."""
    workers = _workers_of(pool)
    stopper = threading.Thread(target=pool.shutdown, kwargs={"wait": True, "cancel_futures": True},
                               name="ucm-db-body-pool-stop", daemon=True)
    stopper.start()
    stopper.join(WORKER_STOP_WAIT_S)
    for worker in workers:
        if worker.is_alive():
            worker.terminate()
            worker.join(WORKER_STOP_WAIT_S)
    stopper.join(WORKER_STOP_WAIT_S)
