"""The serving index's writes: puts, eviction, removal and reader activity
of :class:`~ucm_db.index.local.LocalTier` (the table layout and
invariants are in :mod:`ucm_db.index.local`).

Invariants:
    * Each public method is one write transaction; the totals and
      per-namespace counters change in it with the blocks (``Changes``).
    * Prefix invariant: a put refuses a block whose parent is missing;
      removing a block removes its descendants in the same transaction.
    * Eviction takes unprotected chain tails, least recently used first;
      a put never evicts its own batch, the blocks of its call that were
      stored already, or an ancestor of either; nothing evicts a pinned
      block (:mod:`ucm_db.index.pins`: a pinned tail is passed over like a
      block with children, so only pinned and protected blocks left means
      ``StoreFullError``).
    * Removing a block (delete, eviction, quarantine) takes its pins with
      it in the same transaction (:func:`ucm_db.index.pins.release_above`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Container, Sequence

from ucm_db.crashpoints import crashpoint
from ucm_db.errors import MissingAncestorError, StoreFullError
from ucm_db.index import changefeed, damage, namespace_guard, pins, records
from ucm_db.index.accounting import NS_DESC_PREFIX, Changes
from ucm_db.engines.base import Txn
from ucm_db.index.reads import IndexReads, in_namespace
from ucm_db.index.entries import LRU_PREFIX, BlockEntry, BlockMeta, DamagedMeta, PendingActivity, PutResult, lru_key


class IndexWrites(IndexReads):
    """The writes of the local block index (see module invariants)."""

    def delete(self, keys: Sequence[bytes], *, namespace_id: bytes | None = None) -> int:
        """Removes ``keys`` and their descendants; with ``namespace_id``,
        only keys stored under that namespace, and never a descendant
        stored under another one (:class:`ForeignNamespaceError`, nothing
        removed)."""
        def run(txn: Txn) -> int:
            changes = Changes(txn)
            mine = [k for k in keys if in_namespace(txn.get("meta", k), namespace_id)]
            if namespace_id is not None:
                for key in mine:
                    namespace_guard.require_tree_in_namespace(txn, key, namespace_id)
            removed = sum(self.remove_tree(txn, changes, k) for k in mine)
            changes.commit()
            return removed
        return damage.delete_around_damage(self, keys, namespace_id, lambda: self.engine.write(run))

    def put_blocks(
        self,
        entries: Sequence[BlockEntry],
        *,
        namespace_desc: tuple[bytes, bytes] | None = None,
        enqueue_upload: bool = False,
        activity: Callable[[bool], PendingActivity | None] | None = None,
        protect: Sequence[bytes] = (),
    ) -> PutResult:
        """Atomically stores a batch, then evicts LRU blocks over capacity,
        never a block of the batch, one of ``protect`` (blocks of the same
        call that were stored already), or an ancestor of either.

        Raises:
            MissingAncestorError: a block's parent is neither stored nor
                earlier in the batch (nothing is written).
            ForeignNamespaceError: a block or its parent is stored under
                another namespace than the entry's (nothing is written).
            StoreFullError: the batch alone exceeds the capacity.
        """
        def run(txn: Txn) -> PutResult:
            changes = Changes(txn)
            result = PutResult()
            now = time.time_ns()
            in_batch: set[bytes] = set()
            depths: dict[bytes, int] = {}
            if namespace_desc is not None and txn.get("info", NS_DESC_PREFIX + namespace_desc[0]) is None:
                records.put_checked(txn, NS_DESC_PREFIX + namespace_desc[0], namespace_desc[1])
            for entry in entries:
                in_batch.add(entry.key)
                existing = damage.meta_or_clear(self, txn, changes, entry.key)
                if existing is not None:
                    if existing.namespace_id != entry.namespace_id:
                        namespace_guard.require_same(txn, existing.pack(), entry.namespace_id, entry.key, "block")
                    result.already_present += 1
                    depths[entry.key] = existing.depth
                    continue
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
                if enqueue_upload:
                    txn.put("uploads", entry.key, entry.namespace_id)
                if entry.event_fields is not None:
                    changefeed.stored(txn, entry.key, entry.namespace_id, depth, entry.event_fields, self.feed_max_records)
                changes.add(meta, +1)
                result.stored += 1
            # Reads buffered so far: applied where this attempt evicts, which must
            # see them (``activity`` is told either way: background.ReadsForEviction).
            pending = activity(changes.totals.stored_bytes > self.capacity_bytes) if activity is not None else None
            if pending is not None:
                self._apply_activity(txn, changes, pending)
            result.evicted = self._evict_over_capacity(txn, changes, protected=_LazyAncestors(txn, entries, in_batch, protect))
            changes.commit()
            crashpoint("local.before_commit")
            return result
        return self.engine.write(run)

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
        return parent_meta.depth

    def _evict_over_capacity(self, txn: Txn, changes: Changes, *, protected: Container[bytes]) -> int:
        """Evicts LRU chain tails until the totals fit the capacity, never a
        ``protected`` block (a put's batch and the batch's ancestors:
        evicting an ancestor would take the new blocks with it).

        Raises:
            StoreFullError: only protected blocks are left to evict; the
                caller's transaction then writes nothing.
        """
        evicted = 0
        while changes.totals.stored_bytes > self.capacity_bytes:
            victim = self._oldest_tail(txn, changes, protected)
            if victim is None:
                pinned = pins.pinned_bytes(txn, changes)
                raise StoreFullError(
                    f"the batch and its ancestors need {changes.totals.stored_bytes} bytes but capacity_bytes is "
                    f"{self.capacity_bytes}" + (f" and {pinned} bytes are pinned" if pinned else "") + "; nothing was stored",
                    hint="raise capacity_bytes or put smaller batches" + (
                        ", or unpin chains (Store.unpin, `ucm-db unpin`): pinned blocks are never evicted" if pinned else ""),
                )
            count = self.remove_tree(txn, changes, victim)
            evicted += count
            changes.totals.evictions += count
        return evicted

    def _oldest_tail(self, txn: Txn, changes: Changes, protected: Container[bytes]) -> bytes | None:
        """The least recently used unprotected block without children, or
        None. Blocks with children met on the way are filed again as used
        now (their chains are in use: a block gains children only when a
        put continues it), so each is passed over once, not at every
        eviction, and goes only once it is a tail. Stale LRU entries (no
        block) are dropped. An unprotected block has a tail below it: a
        protected block's ancestors are protected too. A pinned tail is
        filed again too (its ancestors are pinned: pins.py)."""
        refile: list[tuple[bytes, bytes]] = []
        stale: list[bytes] = []
        victim = None
        for lru, _ in txn.scan("lru"):
            self.eviction_entries_scanned += 1
            key = bytes(lru[LRU_PREFIX.size:])
            if key in protected:
                continue
            if not damage.has_live_children(txn, key):
                if txn.get("meta", key) is None:
                    stale.append(bytes(lru))
                    continue
                if not pins.is_pinned(txn, key):
                    victim = key
                    break
            refile.append((bytes(lru), key))
        for lru in stale:
            txn.delete("lru", lru)
        now = time.time_ns()
        for lru, key in refile:
            txn.delete("lru", lru)
            meta = damage.meta_or_clear(self, txn, changes, key)
            if meta is None:
                continue
            meta.access_ns = max(meta.access_ns, now)
            txn.put("lru", lru_key(meta.access_ns, meta.depth, key), b"")
            txn.put("meta", key, meta.pack())
            counts = changes.ns(meta.namespace_id)
            counts[3] = max(counts[3], meta.access_ns)
        return victim

    def remove_tree(self, txn: Txn, changes: Changes, key: bytes) -> int:
        """Removes ``key`` and all its descendants; returns blocks removed."""
        pins.release_above(txn, changes, key)
        stack = [key]
        removed = 0
        while stack:
            current = stack.pop()
            stack.extend(child[32:] for child, _ in list(txn.scan("children", current)))
            removed += self._remove_one(txn, changes, current)
        return removed

    def _remove_one(self, txn: Txn, changes: Changes, key: bytes) -> int:
        data = txn.get("meta", key)
        if data is None:
            return 0
        try:
            meta = BlockMeta.unpack(data)
        except DamagedMeta as exc:
            return damage.detach(txn, changes, key, exc.fields, exc, feed_max_records=self.feed_max_records)
        txn.delete("meta", key)
        txn.delete("blocks", key)
        txn.delete("heads", key)
        txn.delete("lru", lru_key(meta.access_ns, meta.depth, key))
        txn.delete("uploads", key)
        for child, _ in list(txn.scan("children", key)):
            txn.delete("children", child)
        if meta.parent is not None:
            txn.delete("children", meta.parent + key)
        changefeed.removed(txn, key, self.feed_max_records)
        pins.drop(txn, changes, key)
        changes.add(meta, -1)
        return 1

    def apply_activity(self, activity: PendingActivity) -> None:
        """Writes pending touches and hit/miss counts in one transaction."""
        if activity.empty():
            return
        def run(txn: Txn) -> None:
            changes = Changes(txn)
            self._apply_activity(txn, changes, activity)
            changes.commit()
        self.engine.write(run)

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
                meta = damage.meta_or_clear(self, txn, changes, current)
                if meta is None:
                    break
                if meta.access_ns < access_ns:
                    txn.delete("lru", lru_key(meta.access_ns, meta.depth, current))
                    txn.put("lru", lru_key(access_ns, meta.depth, current), b"")
                    meta.access_ns = access_ns
                meta.hits += int(hit)
                hit = False
                txn.put("meta", current, meta.pack())
                counts = changes.ns(meta.namespace_id)
                counts[3] = max(counts[3], access_ns)
                if current in visited:
                    break  # its own hit counted; its ancestors were walked already
                visited.add(current)
                current = meta.parent


class _LazyAncestors:
    """``key in protected`` for a put's eviction: the batch's keys, the
    call's blocks that were stored already (``present``), or an ancestor
    of either. The ancestor walk (one metadata read per level) runs only if
    eviction asks, i.e. only in a full store."""

    def __init__(self, txn: Txn, entries: Sequence[BlockEntry], in_batch: set[bytes], present: Sequence[bytes] = ()) -> None:
        self._txn = txn
        self._entries = entries
        self._keys: set[bytes] | None = None
        self._in_batch = in_batch
        self._present = present

    def __contains__(self, key: object) -> bool:
        if key in self._in_batch:
            return True
        if self._keys is None:
            self._keys = self._walk()
        return key in self._keys

    def _walk(self) -> set[bytes]:
        ancestors: set[bytes] = set()
        for current in [entry.parent for entry in self._entries] + list(self._present):
            while current is not None and current not in self._in_batch and current not in ancestors:
                ancestors.add(current)
                meta = damage.stored_meta(self._txn, current)
                current = meta.parent if meta is not None else None
        return ancestors
