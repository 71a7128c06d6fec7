"""The local block index: blocks, metadata, LRU order and accounting.

:class:`LocalTier` keeps encoded blocks in an :class:`~ucm_db.engines.base.Engine`
together with everything needed to manage them, all updated in the same
transaction as the payload:

* ``heads``:    key -> the block's head (sealed header + frame table)
* ``blocks``:   key -> the block's body (stored frames). Blocks written
  before store format 3 hold head and body joined; :func:`body_of` tells
  them apart by length, so such blocks read without being rewritten.
* ``meta``:     key -> :class:`BlockMeta` (namespace, parent, depth, sizes,
  access time, hits)
* ``lru``:      access_ns (BE) | inverted depth (BE) | key -> b"" (eviction order)
* ``children``: parent | child -> b"" (cascading deletes)
* ``info``:     totals, per-namespace counters and descriptions, settings
* ``quarantine``: key -> JSON record of a block found corrupt
* ``uploads``:  key -> b"" (durable remote upload queue)
* ``info/evf/``, ``info/feed/``: evented blocks' fields and the change feed
  of their puts and removals (:mod:`ucm_db.index.changefeed`), written by
  the same transactions as the blocks
* ``info/pin/``, ``info/pincount:``: pinned blocks and their counters
  (:mod:`ucm_db.index.pins`), written by the same transactions as the blocks

Invariants:
    * Prefix invariant: a stored block's parent is stored. Puts refuse a
      block whose parent is missing; deleting, evicting or quarantining a
      block removes its descendants in the same transaction. Presence along a
      chain is therefore monotone and lookup is a binary search.
    * Accounting: ``info/totals`` equals the sum over ``meta`` at every
      commit (checked by :meth:`LocalTier.check`).
    * Eviction takes chain tails only (blocks without children), least
      recently used first; on equal access time the deeper block first. A
      block with children met at the front of the LRU order is filed again
      as used now, so the newest block of a chain never goes with an old
      ancestor, and each eviction passes over such a block once.
    * Touching a block (a read) touches its ancestors.
    * Pins: a pinned block and its ancestors are never evicted; a pinned
      tail met at the front of the LRU order is filed again as used now,
      like a block with children (:mod:`ucm_db.index.pins`).

The class is assembled from one module per job: the serving index's reads
(:mod:`ucm_db.index.reads`) and writes
(:mod:`ucm_db.index.writes`), the maintenance primitives
(:mod:`ucm_db.index.upkeep`), pinning (:mod:`ucm_db.index.pinning`), the
upload queue (:mod:`ucm_db.index.upload_queue`); quarantine is
:mod:`ucm_db.index.damage`'s.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from ucm_db.events import FEED_MAX_RECORDS
from ucm_db.index import damage
from ucm_db.engines.base import Engine
from ucm_db.index.pinning import IndexPinning
from ucm_db.index.upkeep import IndexMaintenance
from ucm_db.index.entries import (  # noqa: F401 - re-exported: the index's value types its callers use
    BlockEntry, BlockMeta, PendingActivity, PutResult, body_of,
)
from ucm_db.index.upload_queue import UploadQueue


class LocalTier(IndexMaintenance, IndexPinning, UploadQueue):
    """Block index over a transactional engine (see module invariants)."""

    def __init__(self, engine: Engine, *, capacity_bytes: int) -> None:
        self.engine = engine
        self.capacity_bytes = capacity_bytes
        #: LRU entries eviction has read in this process (it reads a block
        #: with children once, then files it as used: tests check that).
        self.eviction_entries_scanned = 0
        #: Change feed records kept (:mod:`ucm_db.index.changefeed`).
        self.feed_max_records = FEED_MAX_RECORDS

    def quarantine(self, key: bytes, reason: str, still_corrupt: Callable[[memoryview, memoryview], bool]) -> bool:
        """Moves a corrupt block (and its descendants) out of the store.

        ``still_corrupt(head, body)`` re-checks the block inside the write
        transaction, so a block another process has meanwhile replaced is
        left alone. A block whose record is damaged, or whose stored bytes
        disagree with its record, goes whatever ``still_corrupt`` says; one
        whose payload cannot be deleted (a damaged page) goes leaving that
        payload stuck (:mod:`ucm_db.index.damage`).
        """
        return damage.quarantine(self, key, reason, still_corrupt)

    def quarantine_records(self) -> dict[bytes, dict[str, Any]]:
        return self.engine.read(lambda txn: {k: json.loads(bytes(v)) for k, v in txn.scan("quarantine")})
