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
* ``info/pin/``, ``info/pincount:``, ``info/pinby/``, ``info/pinsince:``:
  pinned blocks, their counters, the chain that made each pin and when each
  namespace's epoch last moved (:mod:`ucm_db.index.pins`), written by the
  same transactions as the blocks
* ``info/feed-id``: the change feed's identity (a reader's seq means
  something only in the feed of that id)

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

:class:`LocalTier` is a facade over parts it builds and holds, one module
per job, each a plain class with its dependencies given to its constructor
(no part reaches into another's private members):

* ``reads``:   :class:`~ucm_db.index.reads.IndexReader` (engine): the serving reads
* ``damage``:  :class:`~ucm_db.index.damage.Damage` (engine, limits): damaged
  records read in a write transaction, and quarantine
* ``writes``:  :class:`~ucm_db.index.writes.IndexWriter` (engine, limits, damage):
  puts, deletes, eviction, reader activity
* ``upkeep``:  :class:`~ucm_db.index.upkeep.IndexUpkeep` (engine): checks and
  maintenance primitives
* ``pinning``: :class:`~ucm_db.index.pinning.IndexPins` (engine): pin, unpin
* ``uploads``: :class:`~ucm_db.index.upload_queue.UploadQueue` (engine)

The state they share is the engine and one :class:`~ucm_db.index.entries.TierLimits`
(``limits``: capacity and change feed length, read at each use, so setting
``capacity_bytes`` or ``feed_max_records`` on the tier changes every part).
Removing a block with its descendants is :mod:`ucm_db.index.removal`'s, a
function the writer and the damage owner both call inside their own
transactions. The tier's public members are the parts' methods, bound once
when it is built; the :class:`~ucm_db.engines.base.Tier` interface's are
methods of the class that delegate to them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from ucm_db.engines.base import Engine, Tier, TierCapabilities
from ucm_db.index.damage import Damage
from ucm_db.index.entries import (  # noqa: F401 - re-exported: the index's value types its callers use
    BlockEntry, BlockMeta, PendingActivity, PutResult, TierLimits, body_of,
)
from ucm_db.index.pinning import IndexPins
from ucm_db.index.reads import IndexReader
from ucm_db.index.upkeep import IndexUpkeep
from ucm_db.index.upload_queue import UploadQueue
from ucm_db.index.writes import IndexWriter


class LocalTier(Tier):
    """Block index over a transactional engine (see module invariants): the
    facade of its parts."""

    def __init__(self, engine: Engine, *, capacity_bytes: int) -> None:
        self.engine = engine
        self.limits = TierLimits(capacity_bytes)
        self.reads = reads = IndexReader(engine)
        self.damage = damage = Damage(engine, self.limits)
        self.writes = writes = IndexWriter(engine, self.limits, damage)
        self.upkeep = upkeep = IndexUpkeep(engine)
        self.pinning = pinning = IndexPins(engine)
        self.uploads = uploads = UploadQueue(engine)
        # The serving reads (one read transaction each).
        self.present_for_put = reads.present_for_put
        self.read_blocks = reads.read_blocks
        self.with_blocks = reads.with_blocks
        self.read_blobs = reads.read_blobs
        self.count_prefix = reads.count_prefix
        self.with_snapshot = reads.with_snapshot
        self.metas = reads.metas
        self.totals = reads.totals
        self.namespace_counts = reads.namespace_counts
        self.namespace_descriptions = reads.namespace_descriptions
        self.info_get = reads.info_get
        # The writes (one write transaction each).
        self.put_blocks = writes.put_blocks
        self.apply_activity = writes.apply_activity
        self.evict_lru = writes.evict_lru
        self.info_put = writes.info_put
        # Quarantine and the maintenance primitives (docs/architecture.md).
        self.quarantine = damage.quarantine
        self.quarantine_records = damage.records
        self.check = upkeep.check
        self.damaged_records = upkeep.damaged_records
        self.recompute_totals = upkeep.recompute_totals
        self.restore_links = upkeep.restore_links
        self.seal_records = upkeep.seal_records
        self.scan_metas = upkeep.scan_metas
        self.visit_stored = upkeep.visit_stored
        self.sample_keys = upkeep.sample_keys
        self.drop_quarantine_records = upkeep.drop_quarantine_records
        self.drop_orphans = upkeep.drop_orphans
        self.drop_orphans_and_check = upkeep.drop_orphans_and_check
        # Pins and the upload queue.
        self.pin_chains = pinning.pin_chains
        self.unpin_chains = pinning.unpin_chains
        self.pin_counts = pinning.pin_counts
        self.pending_uploads = uploads.pending_uploads
        self.queued = uploads.queued
        self.mark_uploaded = uploads.mark_uploaded

    @property
    def capacity_bytes(self) -> int:
        """Stored bytes a put evicts down to (``limits``; a store sets it
        from its checked settings after opening)."""
        return self.limits.capacity_bytes

    @capacity_bytes.setter
    def capacity_bytes(self, value: int) -> None:
        self.limits.capacity_bytes = value

    @property
    def feed_max_records(self) -> int:
        """Change feed records kept (``limits``; :mod:`ucm_db.index.changefeed`)."""
        return self.limits.feed_max_records

    @feed_max_records.setter
    def feed_max_records(self, value: int) -> None:
        self.limits.feed_max_records = value

    @property
    def eviction_entries_scanned(self) -> int:
        """LRU entries eviction has read in this process (the writer's count)."""
        return self.writes.eviction_entries_scanned

    # The Tier interface (engines.base), methods of the class.
    @property
    def capabilities(self) -> TierCapabilities:
        return TierCapabilities(
            persistent=self.engine.persistent, transactional=True,
            multi_process=self.engine.multi_process, sorted_iteration=True,
        )

    def get_batch(self, keys: Sequence[bytes]) -> list[bytes | None]:
        return self.reads.read_blobs(keys)

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        return self.reads.exists(keys)

    def delete(self, keys: Sequence[bytes], *, namespace_id: bytes | None = None, retract: bool = False) -> int:
        """:meth:`IndexWriter.delete <ucm_db.index.writes.IndexWriter.delete>`."""
        return self.writes.delete(keys, namespace_id=namespace_id, retract=retract)

    def iterate(self) -> Iterator[bytes]:
        return self.reads.iterate()

    def close(self) -> None:
        self.engine.close()
