"""Eviction of the local block index inside a write transaction: least
recently used chain tails first (a put's eviction, ``compact``'s).

:class:`Eviction` is held by :class:`~ucm_db.index.writes.IndexWriter`;
it works inside the caller's transaction and commits nothing: the caller's
:class:`~ucm_db.index.accounting.Changes` carries the counters.

Invariants:
    * Only chain tails (blocks without a live child) go, least recently
      used first; a pinned tail (:mod:`ucm_db.index.pins`) and a block of
      ``protected`` (a put's own batch and the blocks of its call stored
      already) never go. Blocks with children met on the way are filed
      again as used now, so each is passed over once, not at every victim.
    * A victim is removed with its descendants (prefix invariant) in the
      same transaction. A victim whose record was read whole while the
      scan found it a tail (no live child, no pin record) and which nothing
      in the transaction removed since is removed by its own entries alone
      (:func:`~ucm_db.index.removal.remove_tail`): the child links and pin
      records the general removal reads are known absent then. Any other
      (a damaged record, a quarantine on the way) takes the general
      removal (:func:`~ucm_db.index.removal.remove_tree`).
    * Victims come out in the same order, and the index ends in the same
      state, whichever removal takes them.
    * Records that only some stores hold (pin records, the upload queue,
      evented blocks' fields) are looked for once per eviction, before its
      first victim (:class:`Holdings`): where a table or prefix holds none,
      no victim's lookup there can find one (an eviction only removes, and
      a put writes its own before it evicts), so none is made.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from ucm_db.engines.base import Txn
from ucm_db.index import changefeed, damage, pins
from ucm_db.index.accounting import Changes
from ucm_db.index.damage import Damage
from ucm_db.index.entries import LRU_PREFIX, PIN_PREFIX, BlockEntry, BlockMeta, TierLimits, lru_key, meta_and_parent, refiled_record
from ucm_db.index.removal import remove_tail, remove_tree

_LRU_PREFIX_BYTES = LRU_PREFIX.size
INFO = "info"


class PutProtection:
    """What a put's eviction never removes: ``key in`` it holds for the
    batch's keys and the call's blocks stored already (a set: the victim
    check). Their ancestors need no check there (never tails, see
    :meth:`Eviction.evict_tails`); :meth:`covers` answers for them too,
    for a damaged record the scan would quarantine with its descendants.
    Its walk to the roots (one metadata read a level) runs on first use
    only, so an intact index never pays it."""

    def __init__(self, txn: Txn, entries: Sequence[BlockEntry], keys: set[bytes], present: Sequence[bytes]) -> None:
        self._txn = txn
        self._entries = entries
        self._keys = keys
        self._present = present
        self._ancestors: set[bytes] | None = None

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def covers(self, key: bytes) -> bool:
        """Whether ``key`` is protected or an ancestor of a protected block."""
        if key in self._keys:
            return True
        if self._ancestors is None:
            self._ancestors = self._walk()
        return key in self._ancestors

    def _walk(self) -> set[bytes]:
        ancestors: set[bytes] = set()
        starts = [entry.parent for entry in self._entries] + [meta_and_parent(self._txn.get("meta", key))[1]
                                                               for key in self._present]
        for current in starts:
            while current is not None and current not in self._keys and current not in ancestors:
                ancestors.add(current)
                current = meta_and_parent(self._txn.get("meta", current))[1]
        return ancestors


@dataclass(frozen=True, slots=True)
class Holdings:
    """Which of the records an eviction's victims may have exist at all in
    the transaction (module invariants): any pin record, any queued upload,
    any evented block's fields."""

    pins: bool
    uploads: bool
    evented: bool

    @classmethod
    def read(cls, txn: Txn) -> Holdings:
        def any_under(table: str, prefix: bytes = b"") -> bool:
            return next(iter(txn.scan(table, prefix)), None) is not None
        return cls(any_under(INFO, PIN_PREFIX), any_under("uploads"), any_under(INFO, changefeed.FIELDS_PREFIX))


class Eviction:
    """LRU eviction of chain tails (module invariants), over the index's
    :class:`~ucm_db.index.damage.Damage` and the tier's shared limits."""

    def __init__(self, damage: Damage, limits: TierLimits) -> None:
        self.damage = damage
        self.limits = limits
        #: LRU entries scanned in this process (a block with children is
        #: read once, then filed as used: tests check that).
        self.entries_scanned = 0

    def evict_tails(self, txn: Txn, changes: Changes, target_bytes: int, protected: PutProtection | None,
                    max_blocks: int | None = None, *, victims: list[bytes]) -> int:
        """Evicts unprotected LRU chain tails (with their descendants) until
        at most ``target_bytes`` are stored, about ``max_blocks`` went, or
        none is left; returns blocks evicted (counted in the totals'
        evictions). Each victim is appended to ``victims`` before it is
        removed.

        A put's protected blocks' ancestors need no listing: in an intact
        index every ancestor of a stored block has a live child (the
        ``children`` link written with that child, this transaction's
        too), so it is never a tail, and only tails are evicted."""
        evicted = 0
        feed_max_records = self.limits.feed_max_records
        holdings: Holdings | None = None
        while changes.totals.stored_bytes > target_bytes and (max_blocks is None or evicted < max_blocks):
            if holdings is None:
                holdings = Holdings.read(txn)
            victim, meta = self._oldest_tail(txn, changes, protected, holdings.pins)
            if victim is None:
                break
            victims.append(victim)
            if meta is not None:
                count = remove_tail(txn, changes, victim, meta, feed_max_records=feed_max_records,
                                    uploads=holdings.uploads, evented=holdings.evented)
            else:
                count = remove_tree(txn, changes, victim, feed_max_records=feed_max_records)
            evicted += count
            changes.totals.evictions += count
        return evicted

    def _oldest_tail(self, txn: Txn, changes: Changes, protected: PutProtection | None,
                     any_pins: bool) -> tuple[bytes | None, BlockMeta | None]:
        """The least recently used unprotected block without children (None
        if none), with its record where :func:`remove_tail` may take it
        (module invariants; None: the general removal). Blocks with
        children met on the way are filed again as used now (their chains
        are in use: a block gains children only when a put continues it),
        the ancestors of the put's own batch too, so each is passed over
        once, not at every eviction, and goes only once it is a tail. Stale
        LRU entries (no block) are dropped. A pinned tail is filed again too
        (its ancestors are pinned: pins.py). A damaged record met on the way
        is quarantined with its descendants, unless it lies above the put's
        own blocks (:meth:`PutProtection.covers`): then it is left for a
        read or ``verify`` to find. ``any_pins``: whether any pin record
        exists (:class:`Holdings`)."""
        refile: list[tuple[bytes, bytes]] = []
        stale: list[bytes] = []
        victim = victim_meta = None
        get = txn.get
        scanned = 0
        for lru, _ in txn.scan("lru"):
            scanned += 1
            key = bytes(lru[_LRU_PREFIX_BYTES:])
            if not damage.has_live_children(txn, key):
                if protected is not None and key in protected:
                    continue  # the batch's own tail: the newest entries, met only when little else is left
                data = get("meta", key)
                if data is None:
                    stale.append(bytes(lru))
                    continue
                if not any_pins or not pins.is_pinned(txn, key):
                    victim = key
                    # Read now: a value's view dies with the transaction's next write.
                    victim_meta = damage.meta_or_none(data)
                    break
            refile.append((bytes(lru), key))
        self.entries_scanned += scanned
        for lru in stale:
            txn.delete("lru", lru)
        if refile and not self._refile(txn, changes, refile, protected):
            victim_meta = None  # a quarantine on the way may have taken the victim: the general removal reads again
        return victim, victim_meta

    def _refile(self, txn: Txn, changes: Changes, refile: list[tuple[bytes, bytes]], protected: PutProtection | None) -> bool:
        """Files ``refile`` (LRU entry, key) again as used now; a damaged
        record among them is quarantined. Returns False where a quarantine
        ran (it removes a subtree)."""
        now = time.time_ns()
        get, put, delete = txn.get, txn.put, txn.delete
        intact = True
        for lru, key in refile:
            data = get("meta", key)
            refiled = None if data is None else refiled_record(data, now)
            if refiled is not None:  # a whole record: rewritten as used now, no BlockMeta made
                namespace_id, depth, access_ns, record = refiled
                delete("lru", lru)
                put("lru", lru_key(access_ns, depth, key), b"")
                put("meta", key, record)
                counts = changes.ns(namespace_id)
                if counts[3] < access_ns:
                    counts[3] = access_ns
                continue
            if data is not None and protected is not None and protected.covers(key):
                continue  # damaged above the put's own blocks: its quarantine would take them
            delete("lru", lru)
            if data is not None:
                self.damage.meta_or_clear(txn, changes, key)  # a damaged record: quarantined with its descendants
                intact = False
        return intact
