"""The durable remote upload queue of the local tier: the ``uploads`` table
(key -> namespace id), filled by puts in their own commit and drained by
the remote wing's uploader (:mod:`ucm_db.remote.uploader`).

Invariants:
    * A key is queued in the transaction that stores its block and leaves
      the queue when it is uploaded or its block is removed: the queue
      never names a block that was never stored.
"""

from __future__ import annotations

from collections.abc import Iterable

from ucm_db.engines.base import Engine, Txn


class UploadQueue:
    """Reads and drains the ``uploads`` table of ``engine`` (puts fill it:
    :meth:`ucm_db.index.writes.IndexWriter.put_blocks`)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def pending_uploads(self, limit: int | None = None) -> list[bytes]:
        def run(txn: Txn) -> list[bytes]:
            out = []
            for key, _ in txn.scan("uploads"):
                out.append(key)
                if limit is not None and len(out) >= limit:
                    break
            return out
        return self.engine.read(run)

    def queued(self, keys: Iterable[bytes]) -> set[bytes]:
        """Which of ``keys`` are still queued."""
        keys = list(keys)
        return set(self.engine.read(lambda txn: [k for k in keys if txn.get("uploads", k) is not None]))

    def mark_uploaded(self, keys: Iterable[bytes]) -> None:
        keys = list(keys)
        self.engine.write(lambda txn: [txn.delete("uploads", k) for k in keys])
