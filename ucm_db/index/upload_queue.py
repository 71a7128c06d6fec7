"""The durable remote upload queue of the local tier: the ``uploads`` table
(key -> namespace id), filled by puts in their own commit and drained by
the remote wing's uploader (:mod:`ucm_db.remote.uploader`).

Invariants:
    * A key is queued in the transaction that stores its block (a
      provisional block's in the one that settles its tag, while it is still
      stored: :mod:`ucm_db.index.provisional`; again by the confirmation of
      its retraction, when it was stored again since: the remote delete may
      have taken its upload) and leaves the
      queue when it is uploaded or its block is removed: the queue never
      names a block that was never stored.
    * A key has one row, the row of the block stored under it now: a block
      removed and put again is queued anew. So the uploader removes a row
      by what it read (:meth:`UploadQueue.mark_uploaded` given
      ``created_ns``), checked in the transaction that removes it, never
      the row of a block stored since.
    * Beside the uploads, the remote's other work: the retractions of
      deleted blocks (:mod:`ucm_db.index.retractions`), read and confirmed
      here for the uploader (:mod:`ucm_db.remote.retraction`).
"""

from __future__ import annotations

import time
from collections.abc import Container, Iterable, Mapping, Sequence
from dataclasses import dataclass

from ucm_db.engines.base import Buffer, Engine, Txn
from ucm_db.index import provisional, retractions
from ucm_db.index.damage import meta_or_none
from ucm_db.index.retractions import RETRACTION_GRACE_S, Retraction


@dataclass(frozen=True, slots=True)
class QueuedAs:
    """What :meth:`UploadQueue.queued_as` read of one key, in one transaction."""

    #: The stored block's ``created_ns`` (what the row's removal checks).
    created_ns: int
    #: The ``retracted_ns`` of the key's retraction then; None: none
    #: (:func:`ucm_db.index.retractions.recorded_ns`).
    retracted_ns: int | None


class UploadQueue:
    """Reads and drains the ``uploads`` table of ``engine`` (puts fill it:
    :meth:`ucm_db.index.writes.IndexWriter.put_blocks`)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def pending_uploads(self, limit: int | None = None, skip: Container[bytes] = ()) -> list[bytes]:
        """Queued keys in key order, at most ``limit``, passing over ``skip``
        (rows the uploader knows wait below a held block: they never fill a
        batch in place of others)."""
        def run(txn: Txn) -> list[bytes]:
            out = []
            for key, _ in txn.scan("uploads"):
                if key in skip:
                    continue
                out.append(key)
                if limit is not None and len(out) >= limit:
                    break
            return out
        return self.engine.read(run)

    def queued(self, keys: Iterable[bytes]) -> set[bytes]:
        """Which of ``keys`` are still queued."""
        keys = list(keys)
        return set(self.engine.read(lambda txn: [k for k in keys if txn.get("uploads", k) is not None]))

    def queued_as(self, blobs: Mapping[bytes, Buffer]) -> dict[bytes, QueuedAs]:
        """Those keys of ``blobs`` (key -> joined blob) still queued for the
        block the blob is (the stored head, which names the key, the sizes
        and the checksum, is the blob's first bytes), each with that block's
        ``created_ns`` and the key's retraction, read in the same
        transaction: what a write-through put may send and dequeue, and
        which retractions its upload may not reopen (the block was stored
        after them: :func:`ucm_db.index.retractions.reopen`). A key
        deleted and put again since is queued for another block: the put's
        blob is then not what it stores (the audit's write-through finding)."""
        def run(txn: Txn) -> dict[bytes, QueuedAs]:
            out: dict[bytes, QueuedAs] = {}
            for key, blob in blobs.items():
                meta, head = meta_or_none(txn.get("meta", key)), txn.get("heads", key)
                if meta is None or head is None or txn.get("uploads", key) is None:
                    continue
                if memoryview(blob)[: len(head)] == memoryview(head):
                    out[key] = QueuedAs(meta.created_ns, retractions.recorded_ns(txn, key))
            return out
        return self.engine.read(run)

    def mark_uploaded(self, keys: Iterable[bytes] | Mapping[bytes, int | None]) -> None:
        """Removes the rows of ``keys``.

        Given a mapping ``key -> created_ns`` of the block the caller read
        (``None``: it found none stored), a row is removed only while it is
        still that block's: the key's block has that ``created_ns``, or no
        block is stored (the row is stale). A block removed and put again
        since keeps its new row (audit F7: the uploader found a key gone, it
        was put again before the batch ended, and removing by key dropped
        the new row, so the block was never uploaded).
        """
        if not isinstance(keys, Mapping):
            listed = list(keys)
            self.engine.write(lambda txn: [txn.delete("uploads", k) for k in listed])
            return
        read = dict(keys)

        def run(txn: Txn) -> None:
            for key, created_ns in read.items():
                current = meta_or_none(txn.get("meta", key))
                if current is None or current.created_ns == created_ns:
                    txn.delete("uploads", key)
        self.engine.write(run)

    # -- retractions (ucm_db/index/retractions.py) -----------------------------
    def retractions_due(self, limit: int | None = None) -> list[Retraction]:
        """Pending retractions (remote delete not confirmed), at most
        ``limit``; confirmed ones past :data:`RETRACTION_GRACE_S` are dropped
        on the way (one write, only when there are any)."""
        expired_before_ns = time.time_ns() - int(RETRACTION_GRACE_S * 1e9)

        def run(txn: Txn) -> tuple[list[Retraction], list[bytes]]:
            due: list[Retraction] = []
            expired: list[bytes] = []
            for item in retractions.scan(txn):
                if item.confirmed_ns == 0 and (limit is None or len(due) < limit):
                    due.append(item)
                elif item.confirmed_ns and item.confirmed_ns < expired_before_ns:
                    expired.append(item.key)
            return due, expired
        due, expired = self.engine.read(run)
        if expired:
            self.engine.write(lambda txn: retractions.drop(txn, expired))
        return due

    def confirm_retracted(self, done: Sequence[Retraction]) -> None:
        """Confirms the retractions whose remote objects are deleted
        (:func:`ucm_db.index.retractions.confirm`)."""
        if done:
            now_ns = time.time_ns()
            self.engine.write(lambda txn: retractions.confirm(txn, done, now_ns))

    def reopen_retracted(self, keys: Sequence[bytes], read: Mapping[bytes, int | None]) -> int:
        """Reopens the retractions of ``keys`` recorded (again) since their
        upload read them (``read``: key -> the ``retracted_ns`` it saw, None
        or left out: none; :func:`ucm_db.index.retractions.reopen`); one
        read when none is recorded."""
        if not self.retracted(keys):
            return 0
        now_ns = time.time_ns()
        return self.engine.write(lambda txn: retractions.reopen(txn, keys, read, now_ns))

    def first_retracted(self, keys: Sequence[bytes]) -> int | None:
        """Index of the first of ``keys`` whose retraction is recorded, or None."""
        return self.engine.read(lambda txn: retractions.first_retracted(txn, keys))

    def held(self, keys: Sequence[bytes]) -> set[bytes]:
        """Those of ``keys`` whose upload a provisional put holds (its tag
        not settled: :func:`ucm_db.index.provisional.held_among`)."""
        return self.engine.read(lambda txn: provisional.held_among(txn, keys)) if keys else set()

    def retracted(self, keys: Sequence[bytes]) -> set[bytes]:
        """Those of ``keys`` whose retraction is recorded."""
        return self.engine.read(lambda txn: retractions.retracted_among(txn, keys))
