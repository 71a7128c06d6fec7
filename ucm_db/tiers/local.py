"""The local block index: blocks, metadata, LRU order and accounting.

:class:`LocalTier` keeps encoded blocks in an :class:`~ucm_db.tiers.base.Engine`
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
  of their puts and removals (:mod:`ucm_db.tiers.changefeed`), written by
  the same transactions as the blocks

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
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from typing import Any, TypeVar

from ucm_db.crashpoints import crashpoint
from ucm_db.errors import MissingAncestorError, StoreFullError
from ucm_db.events import FEED_MAX_RECORDS
from ucm_db.tiers import accounting, changefeed, chunked, damage, index_audit, namespace_guard, records
from ucm_db.tiers.accounting import (  # noqa: F401 - NS_*/TOTALS_KEY re-exported for tools and tests
    NS_COUNTS, NS_COUNTS_PREFIX, NS_DESC_PREFIX, TOTALS_KEY, Changes, Totals, damaged_records, parse_description, recount,
)
from ucm_db.tiers.base import Buffer, Engine, Tier, TierCapabilities, Txn
from ucm_db.tiers.index_types import (  # noqa: F401 - re-exported: the index's value types
    LRU_PREFIX, MAX_DEPTH, META, NO_PARENT, BlockEntry, BlockMeta, DamagedMeta, PendingActivity, PutResult, body_of, lru_key,
)

T = TypeVar("T")
#: Entries a maintenance write transaction scans at most: a compact beside
#: live writers holds their lock for milliseconds at a time, not for the walk.
MAINTENANCE_CHUNK_KEYS = 4096
logger = logging.getLogger("ucm_db")


class LocalTier(Tier):
    """Block index over a transactional engine (see module invariants)."""

    def __init__(self, engine: Engine, *, capacity_bytes: int) -> None:
        self.engine = engine
        self.capacity_bytes = capacity_bytes
        #: LRU entries eviction has read in this process (it reads a block
        #: with children once, then files it as used: tests check that).
        self.eviction_entries_scanned = 0
        #: Change feed records kept (:mod:`ucm_db.tiers.changefeed`).
        self.feed_max_records = FEED_MAX_RECORDS

    @property
    def capabilities(self) -> TierCapabilities:
        return TierCapabilities(
            persistent=self.engine.persistent, transactional=True,
            multi_process=self.engine.multi_process, sorted_iteration=True,
        )

    # -- Tier interface ----------------------------------------------------
    def get_batch(self, keys: Sequence[bytes]) -> list[bytes | None]:
        return self.read_blobs(keys)

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        return self.engine.read(lambda txn: [txn.get("meta", k) is not None for k in keys])

    def present_for_put(self, keys: Sequence[bytes], namespace_desc: tuple[bytes, bytes]) -> list[bool]:
        """Whether each key is stored, for a put into the namespace
        ``namespace_desc`` (its id and JSON description); a damaged record
        is not (the put replaces it).

        Raises:
            ForeignNamespaceError: a key is stored under another namespace
                (:mod:`ucm_db.tiers.namespace_guard`).
        """
        namespace_id = namespace_desc[0]

        def run(txn: Txn) -> list[bool]:
            present = []
            damaged = False
            for key in keys:
                meta = txn.get("meta", key)
                # A length and 16 bytes compared on the put's hot path. A damaged
                # record (wrong length; impossible sizes under other namespace
                # bytes) reads as absent, and so does every key after it (its
                # descendants): the put quarantines it with its descendants and
                # stores them all again.
                whole = meta is not None and len(meta) == META.size and not damaged
                if meta is not None and whole and meta[:16] != namespace_id:
                    if namespace_guard.is_foreign(meta, namespace_id):
                        namespace_guard.require_same(txn, meta, namespace_id, key, "block", description=namespace_desc[1])
                    whole = False
                damaged = damaged or (meta is not None and not whole)
                present.append(whole)
            return present
        return self.engine.read(run)

    def delete(self, keys: Sequence[bytes], *, namespace_id: bytes | None = None) -> int:
        """Removes ``keys`` and their descendants; with ``namespace_id``,
        only keys stored under that namespace, and never a descendant
        stored under another one (:class:`ForeignNamespaceError`, nothing
        removed)."""
        def run(txn: Txn) -> int:
            changes = Changes(txn)
            mine = [k for k in keys if _in_namespace(txn.get("meta", k), namespace_id)]
            if namespace_id is not None:
                for key in mine:
                    namespace_guard.require_tree_in_namespace(txn, key, namespace_id)
            removed = sum(self._remove_tree(txn, changes, k) for k in mine)
            changes.commit()
            return removed
        return damage.delete_around_damage(self, keys, namespace_id, lambda: self.engine.write(run))

    def iterate(self) -> Iterator[bytes]:
        return iter(self.engine.read(lambda txn: [k for k, _ in txn.scan("meta")]))

    def close(self) -> None:
        self.engine.close()

    # -- reads ---------------------------------------------------------------
    def read_blocks(self, keys: Sequence[bytes], visit: Callable[[int, memoryview, memoryview], T]) -> list[T | None]:
        """Runs ``visit(i, head, body)`` inside one read transaction for each
        key present; ``None`` where absent. The views are valid only during
        visit. A block whose head is missing is visited with an empty head
        (the codec then finds it corrupt)."""
        def run(blocks: list[tuple[memoryview, memoryview] | None]) -> list[T | None]:
            return [None if b is None else visit(i, b[0], b[1]) for i, b in enumerate(blocks)]
        return self.with_blocks(keys, run)

    def with_blocks(
        self, keys: Sequence[bytes], fn: Callable[[list[tuple[memoryview, memoryview] | None]], T],
        *, namespace_id: bytes | None = None,
    ) -> T:
        """Calls ``fn`` with every key's ``(head, body)`` (None where absent,
        or, given ``namespace_id``, stored under another namespace) inside
        one read transaction, and returns its result.

        The views stay valid until ``fn`` returns, from any thread: ``fn`` may
        hand them to worker threads (parallel decode without copying the
        stored bytes out first) as long as it waits for them.
        """
        def run(txn: Txn) -> T:
            blocks: list[tuple[memoryview, memoryview] | None] = []
            for key in keys:
                stored = txn.get("blocks", key)
                if stored is None or (namespace_id is not None and not _in_namespace(txn.get("meta", key), namespace_id)):
                    blocks.append(None)
                    continue
                head = memoryview(txn.get("heads", key) or b"")
                blocks.append((head, body_of(head, memoryview(stored))))
            return fn(blocks)
        return self.engine.read(run)

    def read_blobs(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Blocks as joined blobs (head + body), for remote objects and archives."""
        return self.read_blocks(keys, lambda _i, head, body: b"".join([head, body]))

    def count_prefix(self, keys: Sequence[bytes], *, namespace_id: bytes | None = None) -> int:
        """Number of leading keys present (given ``namespace_id``: present
        under that namespace): a binary search (prefix invariant). Given
        ``namespace_id``, the first key is read too (one more read): a
        chain that older code let continue under another namespace is then
        0 for that namespace, not over-claimed."""
        def run(txn: Txn) -> int:
            lo, hi = 0, len(keys)
            while lo < hi:
                mid = (lo + hi) // 2
                if _in_namespace(txn.get("meta", keys[mid]), namespace_id):
                    lo = mid + 1
                else:
                    hi = mid
            if lo > 1 and namespace_id is not None and not _in_namespace(txn.get("meta", keys[0]), namespace_id):
                return 0  # lo == 1: keys[0] was the search's last hit
            return lo
        return self.engine.read(run)

    def metas(self, keys: Sequence[bytes]) -> list[BlockMeta | None]:
        return self.engine.read(lambda txn: [_meta_or_none(txn.get("meta", k)) for k in keys])

    def totals(self) -> Totals:
        """The store's totals (recounted from the metadata if the record
        is damaged; ``verify --fix`` rewrites it)."""
        return self.engine.read(Totals.read_or_recompute)

    def namespace_counts(self) -> dict[bytes, tuple[int, int, int, int]]:
        """(blocks, raw bytes, stored bytes, last use ns) per namespace id;
        recounted from the metadata if any record is damaged."""
        def run(txn: Txn) -> dict[bytes, tuple[int, int, int, int]]:
            out: dict[bytes, tuple[int, int, int, int]] = {}
            for name, value in records.scan_checked(txn, NS_COUNTS_PREFIX, size=NS_COUNTS.size):
                if value is None:
                    logger.warning("ucm-db: info record %r is damaged; recounting namespaces from the metadata", name)
                    return {ns: tuple(c) for ns, c in recount(txn)[1].items()}  # type: ignore[misc]
                out[name[len(NS_COUNTS_PREFIX):]] = NS_COUNTS.unpack(value)
            return out
        return self.engine.read(run)

    def namespace_descriptions(self) -> dict[bytes, dict[str, Any]]:
        """The recorded description of each namespace id; a damaged one
        reads as ``{"damaged": reason}``."""
        def run(txn: Txn) -> dict[bytes, dict[str, Any]]:
            out: dict[bytes, dict[str, Any]] = {}
            for name, value in records.scan_checked(txn, NS_DESC_PREFIX):
                out[name[len(NS_DESC_PREFIX):]] = parse_description(value)
            return out
        return self.engine.read(run)

    def info_get(self, name: bytes) -> bytes | None:
        return self.engine.read(lambda txn: _bytes_or_none(txn.get("info", name)))

    def info_put(self, name: bytes, value: bytes) -> None:
        self.engine.write(lambda txn: txn.put("info", name, value))

    # -- writes ----------------------------------------------------------------
    def put_blocks(
        self,
        entries: Sequence[BlockEntry],
        *,
        namespace_desc: tuple[bytes, bytes] | None = None,
        enqueue_upload: bool = False,
        activity: PendingActivity | None = None,
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
            if activity is not None:
                self._apply_activity(txn, changes, activity)
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
                raise StoreFullError(
                    f"the batch and its ancestors need {changes.totals.stored_bytes} bytes but capacity_bytes is "
                    f"{self.capacity_bytes}; nothing was stored"
                )
            count = self._remove_tree(txn, changes, victim)
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
        protected block's ancestors are protected too."""
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

    def _remove_tree(self, txn: Txn, changes: Changes, key: bytes) -> int:
        """Removes ``key`` and all its descendants; returns blocks removed."""
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

    def quarantine(self, key: bytes, reason: str, still_corrupt: Callable[[memoryview, memoryview], bool]) -> bool:
        """Moves a corrupt block (and its descendants) out of the store.

        ``still_corrupt(head, body)`` re-checks the block inside the write
        transaction, so a block another process has meanwhile replaced is
        left alone. A block whose record is damaged, or whose stored bytes
        disagree with its record, goes whatever ``still_corrupt`` says; one
        whose payload cannot be deleted (a damaged page) goes leaving that
        payload stuck (:mod:`ucm_db.tiers.damage`).
        """
        return damage.quarantine(self, key, reason, still_corrupt)

    def quarantine_records(self) -> dict[bytes, dict[str, Any]]:
        return self.engine.read(lambda txn: {k: json.loads(bytes(v)) for k, v in txn.scan("quarantine")})

    # -- upload queue ------------------------------------------------------------
    def pending_uploads(self, limit: int | None = None) -> list[bytes]:
        def run(txn: Txn) -> list[bytes]:
            out = []
            for key, _ in txn.scan("uploads"):
                out.append(key)
                if limit is not None and len(out) >= limit:
                    break
            return out
        return self.engine.read(run)

    def mark_uploaded(self, keys: Iterable[bytes]) -> None:
        keys = list(keys)
        self.engine.write(lambda txn: [txn.delete("uploads", k) for k in keys])

    # -- checks ----------------------------------------------------------------
    def check(self) -> list[str]:
        """Consistency problems of the index (empty list when healthy), from
        one snapshot in sorted scans (:mod:`ucm_db.tiers.index_audit`)."""
        return self.engine.read(lambda txn: _problems(txn, index_audit.audit(txn)))

    # -- checked info records ------------------------------------------------------
    def damaged_records(self) -> list[tuple[str, str]]:
        """(name, reason) of every damaged info record (empty when healthy)."""
        return self.engine.read(damaged_records)

    def recompute_totals(self) -> Totals:
        """Rewrites the totals and per-namespace counters from the block
        metadata (keeping the event counters if their record is whole);
        returns the new totals."""
        def run(txn: Txn) -> Totals:
            totals, per_namespace = recount(txn)
            try:
                old = Totals.read(txn)
                totals.evictions, totals.quarantined, totals.hits, totals.misses = (
                    old.evictions, old.quarantined, old.hits, old.misses,
                )
            except records.DamagedRecord:
                pass
            for name, _ in list(txn.scan("info", NS_COUNTS_PREFIX)):
                records.delete_checked(txn, bytes(name))
            totals.write(txn)
            for namespace_id, counts in per_namespace.items():
                records.put_checked(txn, NS_COUNTS_PREFIX + namespace_id, NS_COUNTS.pack(*counts))
            return totals
        return self.engine.write(run)

    def seal_records(self) -> int:
        """Adds checksums to the settings, counter and description records
        written by older code (see :mod:`ucm_db.tiers.records`); returns how
        many."""
        return self.engine.write(accounting.seal_records)  # counters recounted before sealing (issue 26 item 18)

    # -- maintenance primitives (for ucm_db.maintenance; each one transaction) --
    def scan_metas(self, namespaces: set[bytes] | None = None) -> dict[bytes, BlockMeta]:
        """Metadata of every block (of ``namespaces``, None = all), from one snapshot."""
        def run(txn: Txn) -> dict[bytes, BlockMeta]:
            metas = ((bytes(k), damage.meta_or_none(v)) for k, v in txn.scan("meta"))  # damaged records left out
            return {k: m for k, m in metas if m is not None and (namespaces is None or m.namespace_id in namespaces)}
        return self.engine.read(run)

    def visit_stored(
        self, keys: Sequence[bytes], visit: Callable[[bytes, Buffer | None, Buffer | None, Buffer | None], T],
    ) -> list[T]:
        """``visit(key, meta record, head, stored value)`` for each key inside
        one read transaction (None for what is missing); the buffers are valid
        only during the call."""
        return self.engine.read(lambda txn: [visit(k, txn.get("meta", k), txn.get("heads", k), txn.get("blocks", k)) for k in keys])

    def evict_lru(self, target_bytes: int, max_blocks: int) -> int:
        """Evicts least recently used blocks (with their descendants) until at
        most ``target_bytes`` are stored or about ``max_blocks`` went; returns
        blocks evicted (counted in the totals' evictions)."""
        def run(txn: Txn) -> int:
            changes = Changes(txn)
            evicted = 0
            while changes.totals.stored_bytes > target_bytes and evicted < max_blocks:
                victim = self._oldest_tail(txn, changes, ())
                if victim is None:
                    break
                count = self._remove_tree(txn, changes, victim)
                evicted += count
                changes.totals.evictions += count
            changes.commit()
            return evicted
        return self.engine.write(run)

    def sample_keys(self, count: int, *, seed: int = 0) -> list[bytes]:
        """About ``count`` distinct stored keys chosen at random by ``seed``,
        sorted, in O(count) reads whatever the store's size (random prefix
        probes, :func:`ucm_db.tiers.chunked.sample_keys`)."""
        return chunked.sample_keys(self.engine, "meta", count, total_keys=self.totals().blocks, seed=seed)

    def drop_quarantine_records(self, *, chunk_keys: int = MAINTENANCE_CHUNK_KEYS) -> int:
        """Deletes every quarantine record but those of stuck payloads
        (:mod:`ucm_db.tiers.damage`: the rewrite drops them), at most about
        ``chunk_keys`` per write transaction; returns how many went."""
        return self._drop_where("quarantine", lambda txn, key: not damage.is_stuck(txn, key), chunk_keys)

    def drop_orphans(self, *, chunk_keys: int = MAINTENANCE_CHUNK_KEYS) -> dict[str, int]:
        """Deletes index entries whose block has no metadata; returns counts
        per table.

        A read-only audit in sorted scans (:func:`ucm_db.tiers.index_audit.audit`)
        first tells which tables may hold such entries; only those are
        walked again entry by entry, each write transaction scanning at most
        about ``chunk_keys`` entries of one table
        (:func:`ucm_db.tiers.chunked.partitions`). So a large store neither
        holds the writer lock for long nor builds a big transaction, and an
        entry is judged and deleted in the same transaction."""
        return self._drop_suspect(self.engine.read(lambda txn: index_audit.audit(txn).suspect), chunk_keys)

    def drop_orphans_and_check(self, *, chunk_keys: int = MAINTENANCE_CHUNK_KEYS) -> tuple[dict[str, int], list[str]]:
        """:meth:`drop_orphans`, then :meth:`check`: the counts dropped per
        table and the index's problems afterwards. One audit serves both when
        nothing was dropped (the usual case), which halves the work of a
        compact on a large store."""
        def audit(txn: Txn) -> tuple[set[str], list[str]]:
            found = index_audit.audit(txn)
            return found.suspect, _problems(txn, found)

        suspect, problems = self.engine.read(audit)
        dropped = self._drop_suspect(suspect, chunk_keys)
        return dropped, (self.check() if any(dropped.values()) else problems)

    def _drop_suspect(self, suspect: set[str], chunk_keys: int) -> dict[str, int]:
        return {table: self._drop_where(table, _ORPHAN[table], chunk_keys) if table in suspect else 0 for table in _ORPHAN}

    def _drop_where(self, table: str, dead: Callable[[Txn, bytes], bool], chunk_keys: int) -> int:
        """Deletes the entries of ``table`` that ``dead(txn, key)`` picks, one
        write transaction per partition of at most about ``chunk_keys`` keys."""
        def run(txn: Txn, prefix: bytes) -> int:
            doomed = [k for k, _ in txn.scan(table, prefix) if dead(txn, k)]
            for key in doomed:
                txn.delete(table, key)
            return len(doomed)
        return sum(self.engine.write(lambda txn: run(txn, p)) for p in chunked.partitions(self.engine, table, chunk_keys))


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


def _problems(txn: Txn, found: index_audit.Audit) -> list[str]:
    """The problems :meth:`LocalTier.check` reports, given the audit of ``txn``."""
    problems: list[str] = [f"info record {name!r} is damaged: {reason}" for name, reason in damaged_records(txn)]
    try:
        totals = Totals.read(txn)
    except records.DamagedRecord:
        totals = Totals(-1, -1, -1)
    problems += found.problems + index_audit.namespace_problems(txn, found)
    if (found.blocks, found.raw_bytes, found.stored_bytes) != (totals.blocks, totals.raw_bytes, totals.stored_bytes):
        problems.append(f"totals {totals} disagree with metadata ({found.blocks}, {found.raw_bytes}, {found.stored_bytes})")
    return problems


def _stored(txn: Txn, key: bytes) -> bool:
    return txn.get("meta", key) is not None


def _lru_dead(txn: Txn, lru: bytes) -> bool:
    meta = damage.stored_meta(txn, lru[-32:])
    if meta is None:
        return True
    return lru_key(meta.access_ns, meta.depth, lru[-32:]) != lru


#: Per index table, whether an entry is orphaned (its block has no metadata).
_ORPHAN: dict[str, Callable[[Txn, bytes], bool]] = {
    "blocks": lambda txn, k: not _stored(txn, k) and not damage.is_stuck(txn, k),
    "heads": lambda txn, k: not _stored(txn, k),
    "uploads": lambda txn, k: not _stored(txn, k),
    "children": lambda txn, k: not (_stored(txn, k[:32]) and _stored(txn, k[32:])),
    "lru": _lru_dead,
}


def _in_namespace(meta: Buffer | None, namespace_id: bytes | None) -> bool:
    """Whether a ``meta`` record exists and, given ``namespace_id``, names
    that namespace (its first 16 bytes)."""
    if meta is None:
        return False
    return namespace_id is None or bytes(meta[:16]) == namespace_id


def _meta_or_none(data: Buffer | None) -> BlockMeta | None:
    return damage.meta_or_none(data)


def _bytes_or_none(data: Buffer | None) -> bytes | None:
    return None if data is None else bytes(data)
