"""The remote half of retractions: deleting the remote objects of blocks a
delete removed locally (:mod:`ucm_db.index.retractions` records them).

Invariants:
    * Children before parents: pending retractions are deleted deepest
      first, one depth at a time, and a depth with a failure ends the round
      before its parents: the remote never loses a parent while a child
      that was to go is still there (such a child would be served again the
      day its parent is uploaded again, recomputed).
    * Confirmed only by the uploader that drains the queue (the elected one,
      :mod:`ucm_db.remote.uploader`), between its upload batches: a batch
      that read a block before its local delete has landed before the pass
      that confirms the block's retraction. A store whose process is not
      elected deletes at once after its local delete (:meth:`RemoteRetractions.run`
      without ``confirm``) and leaves the retraction pending, so the elected
      uploader deletes the object again after its own batches.
    * Each delete leaves a tombstone first (:mod:`ucm_db.remote.tombstones`;
      once per retraction and process): other nodes then never upload the
      block again as the lost ancestor of a continuation of theirs. A failed
      tombstone write is a failed delete (the object stays).
    * A failed (or unfinished) delete leaves its retraction pending: the
      uploader's passes retry it after a backoff of their own (50 ms doubling
      to 5 s, as uploads'), forever, while uploads go on at their pace (a
      remote that refuses every delete must not slow them); meanwhile the
      block is never promoted into the local tier.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, wait
from functools import partial

from ucm_db.index.local import LocalTier
from ucm_db.index.retractions import Retraction
from ucm_db.remote.tier import RemoteRoot
from ucm_db.remote.tombstones import write_tombstone
from ucm_db.remote.upload_pool import UploadPool

#: How often a round waiting on its deletes looks at the stop flag.
STOP_POLL_S = 0.1
MIN_BACKOFF_S = 0.05
MAX_BACKOFF_S = 5.0
#: Retractions remembered as tombstoned (past it, the memory starts again).
MAX_TOMBSTONED = 1 << 16


class RemoteRetractions:
    """Deletes the remote objects of ``local``'s pending retractions from
    ``remote`` on ``pool`` (module invariants); counts what it deleted."""

    def __init__(self, local: LocalTier, remote: RemoteRoot, pool: UploadPool) -> None:
        self.local = local
        self.remote = remote
        self._pool = pool
        self.deleted = 0
        self.last_error: str | None = None
        self._retry_at = 0.0  # monotonic time before which the uploader's passes wait (after a failure)
        self._backoff_s = MIN_BACKOFF_S
        self._tombstoned: set[tuple[bytes, int]] = set()  # (key, retracted_ns) whose tombstone this process wrote

    def backing_off(self) -> bool:
        """Whether the last round failed less than its backoff ago."""
        return time.monotonic() < self._retry_at

    def pending(self) -> bool:
        """Whether a retraction waits for its remote delete (or its confirmation)."""
        return bool(self.local.uploads.retractions_due(limit=1))

    def run(self, *, confirm: bool, stop: threading.Event, deadline: float | None = None) -> tuple[int, int]:
        """One round over every pending retraction, deepest first, until a
        depth fails or ``deadline`` (monotonic) passes; ``confirm``: records
        the deletes done (the elected uploader only). Returns ``(deleted,
        failed or left)``."""
        due = self.local.uploads.retractions_due()
        done: list[Retraction] = []
        for depth in sorted({item.depth for item in due}, reverse=True):
            level = [item for item in due if item.depth == depth]
            errors = self._delete_level(level, stop, deadline)
            done += [item for item, error in zip(level, errors) if error is None]
            failures = [error for error in errors if error is not None]
            if failures:
                self.last_error = failures[0]
                break
        if confirm:
            self.local.uploads.confirm_retracted(done)
        self.deleted += len(done)
        left = len(due) - len(done)
        self._retry_at = time.monotonic() + self._backoff_s if left else 0.0
        self._backoff_s = min(self._backoff_s * 2, MAX_BACKOFF_S) if left else MIN_BACKOFF_S
        return len(done), left

    def _delete_level(self, level: list[Retraction], stop: threading.Event, deadline: float | None) -> list[str | None]:
        """Deletes one depth's objects in parallel; an error (or "unfinished") per item."""
        futures: list[Future[str | None]] = [self._pool.submit(partial(self._delete_one, item)) for item in level]
        while not stop.is_set():
            left_s = None if deadline is None else deadline - time.monotonic()
            if left_s is not None and left_s <= 0:
                break
            _done, pending = wait(futures, timeout=STOP_POLL_S if left_s is None else min(left_s, STOP_POLL_S))
            if not pending:
                break
        return [f.result() if f.done() and not f.cancelled() else "unfinished: deadline or stop" for f in futures]

    def _delete_one(self, item: Retraction) -> str | None:
        try:
            self._tombstone(item)  # before the delete: the object is never gone without it
            self.remote.tier(item.namespace_id).delete([item.key])
        except Exception as exc:  # noqa: BLE001 - any failure keeps the retraction pending
            return f"{type(exc).__name__}: {exc}"
        return None

    def _tombstone(self, item: Retraction) -> None:
        """Writes the tombstone of ``item`` unless this process did; first
        the namespace's manifest where this process wrote none (a block
        voided before its upload: the tombstone makes the namespace's
        directory, which gc and listings take for ucm-db's only with it)."""
        if (item.key, item.retracted_ns) in self._tombstoned:
            return
        if item.namespace_id not in self.remote.manifests_written:
            description = self.local.namespace_descriptions().get(item.namespace_id, {})
            self.remote.ensure_manifest(item.namespace_id, description)
        write_tombstone(self.remote, item.namespace_id, item.key, item.retracted_ns)
        if len(self._tombstoned) >= MAX_TOMBSTONED:
            self._tombstoned.clear()
        self._tombstoned.add((item.key, item.retracted_ns))
