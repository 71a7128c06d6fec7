"""Loads that run beside the engine's steps (``load_mode: "async"``).

vLLM keeps a request whose hit loads asynchronously in its
WAITING_FOR_REMOTE_KVS state, blocks allocated, while it runs other
requests' steps; it schedules the request once a worker names it in
``get_finished``. So a load costs the request its own wait, not every
running request a longer step.

Invariants:
    * One thread loads requests one at a time, in the order their steps
      submitted them; nothing else writes into their blocks meanwhile
      (vLLM neither schedules nor caches them until they are reported).
    * Every submitted request is reported finished exactly once, after the
      last copy into its blocks, and the block ids that failed to load are
      handed out by the same :meth:`AsyncLoader.take_finished` call, as vLLM
      requires (a failed block is reported no later than its request); so
      are the requests any of whose blocks failed
      (:meth:`AsyncLoader.take_finished_requests`: a hybrid model's
      failures are reported per request, hybrid.py).
    * A load that raises fails all of its blocks (they are recomputed); it
      never stops the thread.
    * :meth:`AsyncLoader.close` waits for the running load only; requests
      not started are dropped (the engine is shutting down).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence

from ucm_db import cpu_placement
from ucm_db.connector.metadata import BlockTransfer

logger = logging.getLogger(f"vllm.{__name__}")  # under "vllm" so vLLM's log handler prints it

#: A load: copies one request's transfer into the KV caches and returns the
#: block ids that failed.
LoadFn = Callable[[BlockTransfer], set[int]]


class AsyncLoader:
    """A background thread loading whole requests' hits."""

    def __init__(self, load: LoadFn) -> None:
        self._load = load
        self._cond = threading.Condition()
        self._queue: deque[BlockTransfer] = deque()
        self._finished: list[str] = []
        self._failed_blocks: set[int] = set()
        self._failed_requests: set[str] = set()  # finished, with a failed block
        self._in_flight = 0  # submitted and not yet taken as finished
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="ucm-db-async-loader", daemon=True)
        self._thread.start()

    def submit(self, transfers: Sequence[BlockTransfer]) -> None:
        """Queues one step's async loads (one transfer per request, as the
        scheduler plans them)."""
        with self._cond:
            self._queue.extend(transfers)
            self._in_flight += len(transfers)
            self._cond.notify_all()

    @property
    def in_flight(self) -> int:
        """Requests submitted and not yet taken as finished."""
        with self._cond:
            return self._in_flight

    def take_finished(self, wait_s: float = 0.0) -> tuple[set[str], set[int]]:
        """Requests whose loads ended since the last call, and the block ids
        of theirs that failed. With ``wait_s`` > 0 and loads in flight but
        none finished, waits up to that long for one (an engine with nothing
        else to run polls here instead of spinning)."""
        finished, _, failed = self._take(wait_s)
        return finished, failed

    def take_finished_requests(self, wait_s: float = 0.0) -> tuple[set[str], set[str]]:
        """Requests whose loads ended since the last call, and those of them
        with a block that failed (``wait_s`` as :meth:`take_finished`)."""
        finished, failed, _ = self._take(wait_s)
        return finished, failed

    def _take(self, wait_s: float) -> tuple[set[str], set[str], set[int]]:
        with self._cond:
            if wait_s > 0 and not self._finished and self._in_flight:
                self._cond.wait_for(lambda: bool(self._finished) or self._closed, timeout=wait_s)
            finished, self._finished = self._finished, []
            failed_requests, self._failed_requests = self._failed_requests, set()
            failed, self._failed_blocks = self._failed_blocks, set()
            self._in_flight -= len(finished)
            return set(finished), failed_requests, failed

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._queue.clear()
            self._cond.notify_all()
        self._thread.join()

    def _run(self) -> None:
        cpu_placement.place_current_thread()
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._queue) or self._closed)
                if self._closed:
                    return
                transfer = self._queue.popleft()
            try:
                failed = self._load(transfer)
            except Exception:  # noqa: BLE001 - a failed load must become recompute, not a dead loader
                logger.exception("ucm-db: loading KV blocks of request %s failed; they will be recomputed", transfer.req_id)
                failed = set(transfer.block_ids)
            with self._cond:
                self._failed_blocks.update(failed)
                if failed:
                    self._failed_requests.add(transfer.req_id)
                self._finished.append(transfer.req_id)
                self._cond.notify_all()
