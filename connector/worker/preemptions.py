"""Saves not yet copied out of the KV cache, and the preemption guard over them.

vLLM frees a preempted request's KV blocks at once; the next step may hand
them to another request and write them. A save reads its blocks when it
copies them out of the KV cache, so a save still waiting for its copy when
its request is preempted would read another request's KV under its own
keys. vLLM calls the connector's ``handle_preemptions`` at the start of
every step, with the step's metadata, before it loads or computes anything:
that hook is the guard (:meth:`PendingSaves.drop`).

Today a worker queues the copy of every save of a step within the step
(``wait_for_save``), so nothing is pending when the guard runs and nothing
is dropped. Beside KV caches on an accelerator the copy then runs on a save
stream, after the call: vLLM's stream waits on the device for its gathers
(:mod:`ucm_db.connector.device_saves`), so every later write into a freed
block, a preempted request's included, lands after the read; in host time
the guard is the device's order, not ``done``. A copy moved out of the
step on the host must go through :class:`PendingSaves` (``take`` /
``done``) and is then guarded.

Invariants:
    * :meth:`PendingSaves.drop` returns only when no save of the named
      requests is queued (dropped, counted) or being copied (waited for):
      after it, no copy reads a block those requests held.
    * Saves are copied in the order they were added (a chain's parent
      segment before its child).
    * Thread-safe: one lock guards the queue and the in-flight set.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Collection, Iterable

from ucm_db.connector.metadata import BlockTransfer


class PendingSaves:
    """Saves handed to a worker whose blocks are not copied out yet."""

    def __init__(self) -> None:
        self._queue: deque[BlockTransfer] = deque()
        self._copying: list[BlockTransfer] = []
        self._changed = threading.Condition(threading.Lock())

    def add(self, transfers: Iterable[BlockTransfer]) -> None:
        with self._changed:
            self._queue.extend(transfers)

    def take(self) -> BlockTransfer | None:
        """The next save to copy (marked in flight until :meth:`done`), or None."""
        with self._changed:
            if not self._queue:
                return None
            transfer = self._queue.popleft()
            self._copying.append(transfer)
            return transfer

    def done(self, transfer: BlockTransfer) -> None:
        """Its blocks' copy is queued: later writes into the KV cache land after it (module docstring)."""
        with self._changed:
            self._copying.remove(transfer)
            self._changed.notify_all()

    def drop(self, req_ids: Collection[str]) -> int:
        """Drops the queued saves of ``req_ids`` (preempted: their blocks are
        freed) and waits for their copies in flight; returns blocks dropped."""
        if not req_ids:
            return 0
        with self._changed:
            kept = [t for t in self._queue if t.req_id not in req_ids]
            dropped = sum(len(t.block_ids) for t in self._queue if t.req_id in req_ids)
            self._queue = deque(kept)
            self._changed.wait_for(lambda: not any(t.req_id in req_ids for t in self._copying))
            return dropped

    def __len__(self) -> int:
        with self._changed:
            return len(self._queue) + len(self._copying)
