"""The serving index's writes: puts, eviction, removal and reader activity
of the local block index (the table layout and invariants are in
:mod:`ucm_db.index.local`).

:class:`IndexWriter` is built over the engine, the tier's shared
:class:`~ucm_db.index.entries.TierLimits` (capacity, change feed length,
read at each put) and the :class:`~ucm_db.index.damage.Damage` it reads
records through (a damaged one is quarantined on the way).

Invariants:
    * Each public method is one write transaction; the totals and
      per-namespace counters change in it with the blocks (``Changes``).
    * Prefix invariant: a put refuses a block whose parent is missing;
      removing a block removes its descendants in the same transaction.
    * A put reads each block's presence in its own write transaction: a
      block stored already (in the entry's namespace) is left as it is,
      one stored under another namespace refuses the put, a damaged record
      is quarantined (with its descendants) and the block stored anew.
    * Eviction takes unprotected chain tails, least recently used first;
      a put never evicts its own batch, the blocks of its call that were
      stored already, or an ancestor of either (an ancestor of a stored
      block has a live child, so it is never a tail); nothing evicts a pinned
      block (:mod:`ucm_db.index.pins`: a pinned tail is passed over like a
      block with children, so only pinned and protected blocks left means
      ``StoreFullError``).
    * Removing a block (delete, eviction, quarantine) takes its pins with
      it in the same transaction (:func:`ucm_db.index.pins.release_above`).
    * A touch writes the touched block's recency exactly; its ancestors'
      only where it is older than the touch by more than
      ``ANCESTOR_RECENCY_SLACK_NS`` (the walk up stops at the first
      ancestor within it). An ancestor's recency never decides an
      eviction while it has children (the scan files it again as used
      now), so this only spares rewriting a long prefix each time it is
      read again.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

from ucm_db.crashpoints import crashpoint
from ucm_db.errors import MissingAncestorError, StoreFullError
from ucm_db.index import changefeed, damage, descriptions, namespace_guard, pins, records, retractions
from ucm_db.index import provisional as provisional_marks
from ucm_db.index.accounting import NS_DESC_PREFIX, Changes
from ucm_db.engines.base import Engine, Txn
from ucm_db.index.damage import Damage
from ucm_db.index.eviction import Eviction, PutProtection
from ucm_db.index.reads import in_namespace
from ucm_db.index.removal import remove_tree
from ucm_db.index.entries import (
    BlockEntry, BlockMeta, PendingActivity, PutResult, TierLimits, lru_key,
)

#: How much older than a touch an ancestor's recency may stay (module doc):
#: a prefix of 512 blocks in 4 chains read again within it costs a flush
#: one write per touched block instead of 2048 (17-34 ms of the reading
#: process's maintenance thread on the development machine).
ANCESTOR_RECENCY_SLACK_NS = 30 * 1_000_000_000


class IndexWriter:
    """The writes of the local block index (see module invariants)."""

    def __init__(self, engine: Engine, limits: TierLimits, damage: Damage) -> None:
        self.engine = engine
        self.limits = limits
        self.damage = damage
        self.eviction = Eviction(damage, limits)  # eviction.py

    @property
    def eviction_entries_scanned(self) -> int:
        """LRU entries eviction has read in this process (it reads a block
        with children once, then files it as used: tests check that)."""
        return self.eviction.entries_scanned

    def delete(self, keys: Sequence[bytes], *, namespace_id: bytes | None = None, retract: bool = False) -> int:
        """Removes ``keys`` and their descendants; with ``namespace_id``,
        only keys stored under that namespace, and never a descendant
        stored under another one (:class:`ForeignNamespaceError`, nothing
        removed). ``retract``: records, in the same transaction, a
        retraction of every block removed, and with ``namespace_id`` of
        every one of ``keys`` not stored here (evicted: its remote object
        may serve other nodes still) (:mod:`ucm_db.index.retractions`)."""
        def run(txn: Txn) -> int:
            changes = Changes(txn)
            records_read = [txn.get("meta", k) for k in keys]  # views: tested before this transaction writes
            mine = [k for k, data in zip(keys, records_read) if in_namespace(data, namespace_id)]
            absent = [k for k, data in zip(keys, records_read) if data is None]
            if namespace_id is not None:
                for key in mine:
                    namespace_guard.require_tree_in_namespace(txn, key, namespace_id)
            if retract:
                now_ns = time.time_ns()
                retractions.record_trees(txn, mine, now_ns)
                if namespace_id is not None:
                    retractions.record_absent(txn, absent, namespace_id, now_ns)
            removed = sum(self._remove_tree(txn, changes, k) for k in mine)
            changes.commit()
            return removed
        return self.damage.delete_around(keys, namespace_id, lambda: self.engine.write(run))

    def put_blocks(
        self,
        entries: Sequence[BlockEntry],
        *,
        namespace_desc: tuple[bytes, bytes] | None = None,
        enqueue_upload: bool = False,
        activity: Callable[[bool], PendingActivity | None] | None = None,
        protect: Sequence[bytes] = (),
        guard: Callable[[Txn], None] | None = None,
        stored: list[BlockEntry] | None = None,
        provisional: Mapping[bytes, bytes] | None = None,
        hold_provisional_uploads: bool = False,
    ) -> PutResult:
        """Atomically stores a batch, then evicts LRU blocks over capacity,
        never a block of the batch, one of ``protect`` (blocks of the same
        call that were stored already), or an ancestor of either. A block
        of the batch stored already (in its namespace) is left as it is and
        counted in ``already_present``: the presence check of a put is this
        transaction's own.

        Args:
            guard: run first inside the write transaction; what it raises
                refuses the put (nothing written): the store's epoch gate.
            stored: once the put committed, the entries it stored are
                appended (not those found stored already): what the store
                counts for durability and uploads.
            provisional: tag by key: a block of these that this put stores
                is provisional under its tag; the transaction marks each
                chain root of them (:mod:`ucm_db.index.provisional`).
            hold_provisional_uploads: with ``enqueue_upload``, the upload
                of a provisional block is held until its tag's settle
                instead of queued (a write-back store's: a write-through
                put uploads what it stored before it returns).

        Raises:
            MissingAncestorError: a block's parent is neither stored nor
                earlier in the batch (nothing is written).
            ForeignNamespaceError: a block or its parent is stored under
                another namespace than the entry's (nothing is written).
            StoreFullError: the batch alone exceeds the capacity.
        """
        limits = self.limits

        def run(txn: Txn, victims: list[bytes]) -> tuple[PutResult, list[BlockEntry]]:
            if guard is not None:
                guard(txn)
            changes = Changes(txn)
            result = PutResult()
            now = time.time_ns()
            in_batch: set[bytes] = set()
            depths: dict[bytes, int] = {}
            new: list[BlockEntry] = []
            tagged: dict[bytes, bytes] = {}  # provisional blocks this put stored -> their tag
            maybe_stuck = damage.any_quarantined(txn)  # usually none: then no block needs refuse_stuck's read
            if namespace_desc is not None and descriptions.needs_writing(txn, namespace_desc[0]):  # none, or a placeholder
                records.put_checked(txn, NS_DESC_PREFIX + namespace_desc[0], namespace_desc[1])
            for entry in entries:
                in_batch.add(entry.key)
                existing = self.damage.meta_or_clear(txn, changes, entry.key)
                if existing is not None:
                    if existing.namespace_id != entry.namespace_id:
                        namespace_guard.require_same(txn, existing.pack(), entry.namespace_id, entry.key, "block")
                    result.already_present += 1
                    depths[entry.key] = existing.depth
                    continue
                if maybe_stuck:
                    damage.refuse_stuck(txn, entry.key)
                depth = self._depth_of_parent(txn, entry, depths) + 1
                depths[entry.key] = depth
                meta = BlockMeta(entry.namespace_id, entry.parent, depth, entry.raw_bytes, entry.stored_bytes, now, now, 0)
                txn.put("heads", entry.key, entry.head)
                txn.put("blocks", entry.key, entry.body)
                crashpoint("local.after_payload_write")
                txn.put("meta", entry.key, meta.pack())
                txn.put("lru", lru_key(now, depth, entry.key), b"")
                if entry.parent is not None:
                    txn.put("children", entry.parent + entry.key, b"")
                tag = provisional.get(entry.key) if provisional is not None else None
                if enqueue_upload and tag is not None and hold_provisional_uploads:  # queued by the tag's settle
                    provisional_marks.hold(txn, tag, entry.key, entry.namespace_id, now)
                elif enqueue_upload:
                    txn.put("uploads", entry.key, entry.namespace_id)
                if tag is not None:
                    if entry.parent is None or tagged.get(entry.parent) != tag:
                        provisional_marks.mark(txn, tag, entry.key, entry.namespace_id)
                    tagged[entry.key] = tag
                if entry.event_fields is not None:
                    changefeed.stored(txn, entry.key, entry.namespace_id, depth, entry.event_fields, limits.feed_max_records)
                changes.add(meta, +1)
                new.append(entry)
            result.stored = len(new)
            # Reads buffered so far: applied where this attempt evicts, which must
            # see them (``activity`` is told either way: background.ReadsForEviction).
            pending = activity(changes.totals.stored_bytes > limits.capacity_bytes) if activity is not None else None
            if pending is not None:
                self._apply_activity(txn, changes, pending)
            protected = PutProtection(txn, entries, in_batch.union(protect) if protect else in_batch, protect)
            result.evicted = self._evict_over_capacity(txn, changes, protected=protected, victims=victims)
            changes.commit()
            crashpoint("local.before_commit")
            return result, new
        result, new = self.damage.write_evicting(run)
        if stored is not None:
            stored.extend(new)
        return result

    def _depth_of_parent(self, txn: Txn, entry: BlockEntry, depths: dict[bytes, int]) -> int:
        if entry.parent is None:
            return -1
        if entry.parent in depths:
            return depths[entry.parent]
        parent_meta = damage.stored_meta(txn, entry.parent)
        if parent_meta is None:
            raise MissingAncestorError(
                f"block {entry.key.hex()[:16]} has parent {entry.parent.hex()[:16]}, which is not stored"
            )
        if parent_meta.namespace_id != entry.namespace_id:
            namespace_guard.require_same(txn, parent_meta.pack(), entry.namespace_id, entry.parent, "parent")
        if parent_meta.parent is not None:
            # A lost link (verify names it) would let the grandparent go as a tail, orphaning the chain
            # this put continues: restored from the parent's own record, as ``verify --fix`` does.
            damage.restore_link(txn, entry.parent, parent_meta.parent)
        return parent_meta.depth

    def _evict_over_capacity(self, txn: Txn, changes: Changes, *, protected: PutProtection, victims: list[bytes]) -> int:
        """Evicts LRU chain tails until the totals fit the capacity, never a
        ``protected`` block (a put's batch and the blocks of its call stored
        already). Their ancestors need no listing: in an intact index every
        ancestor of a stored block has a live child (the ``children`` link
        written with that child, this transaction's too), so it is never a
        tail, and only tails are evicted. Listing them cost a walk of each
        chain to its root per put, and passing them over unfiled rescanned
        them at every victim: a long chain continued in a full store paid
        its depth twice per save. A lost link (``ucm-db verify`` names it,
        ``--fix`` restores it) lets an ancestor above it go as a tail, by
        any put's eviction; a put restores the one above its stored parent
        (:meth:`_depth_of_parent`), not those further up.

        Raises:
            StoreFullError: only protected blocks are left to evict; the
                caller's transaction then writes nothing.
        """
        capacity_bytes = self.limits.capacity_bytes
        evicted = self.eviction.evict_tails(txn, changes, capacity_bytes, protected, victims=victims)
        if changes.totals.stored_bytes > capacity_bytes:
            pinned = pins.pinned_bytes(txn, changes)
            raise StoreFullError(
                f"the batch and its ancestors need {changes.totals.stored_bytes} bytes but capacity_bytes is "
                f"{capacity_bytes}" + (f" and {pinned} bytes are pinned" if pinned else "") + "; nothing was stored",
                hint="raise capacity_bytes or put smaller batches" + (
                    ", or unpin chains (Store.unpin, `ucm-db unpin`): pinned blocks are never evicted" if pinned else ""),
            )
        return evicted

    def evict_lru(self, target_bytes: int, max_blocks: int) -> int:
        """Evicts least recently used blocks (with their descendants) until at
        most ``target_bytes`` are stored or about ``max_blocks`` went; returns
        blocks evicted (counted in the totals' evictions). A maintenance
        primitive (``compact``'s eviction)."""
        def run(txn: Txn, victims: list[bytes]) -> int:
            changes = Changes(txn)
            evicted = self.eviction.evict_tails(txn, changes, target_bytes, None, max_blocks, victims=victims)
            changes.commit()
            return evicted
        return self.damage.write_evicting(run)

    def _remove_tree(self, txn: Txn, changes: Changes, key: bytes) -> int:
        return remove_tree(txn, changes, key, feed_max_records=self.limits.feed_max_records)

    def apply_activity(self, activity: PendingActivity) -> None:
        """Writes pending touches and hit/miss counts in one transaction."""
        if activity.empty():
            return
        def run(txn: Txn) -> None:
            changes = Changes(txn)
            self._apply_activity(txn, changes, activity)
            changes.commit()
        self.engine.write(run)

    def info_put(self, name: bytes, value: bytes) -> None:
        """Writes one ``info`` record as given (no checksum added)."""
        self.engine.write(lambda txn: txn.put("info", name, value))

    def _apply_activity(self, txn: Txn, changes: Changes, activity: PendingActivity) -> None:
        changes.totals.hits += activity.hits
        changes.totals.misses += activity.misses
        visited: set[bytes] = set()
        # Newest first: a walk stops at a block an earlier (newer) walk
        # visited, so an older touch never hides a newer one's ancestors.
        for key, access_ns in sorted(activity.touched.items(), key=lambda item: item[1], reverse=True):
            hit = True
            current: bytes | None = key
            while current is not None and (current not in visited or hit):
                meta = self.damage.meta_or_clear(txn, changes, current)
                if meta is None:
                    break
                if not hit and meta.access_ns >= access_ns - ANCESTOR_RECENCY_SLACK_NS:
                    break  # recent enough, and (in all likelihood) so are its own ancestors
                if meta.access_ns < access_ns:
                    txn.delete("lru", lru_key(meta.access_ns, meta.depth, current))
                    txn.put("lru", lru_key(access_ns, meta.depth, current), b"")
                    meta.access_ns = access_ns
                if hit:
                    meta.hits += 1 + activity.earlier_rounds.get(current, 0)
                hit = False
                txn.put("meta", current, meta.pack())
                counts = changes.ns(meta.namespace_id)
                counts[3] = max(counts[3], access_ns)
                if current in visited:
                    break  # its own hit counted; its ancestors were walked already
                visited.add(current)
                current = meta.parent
