"""Damaged blocks in the local index: what a reader, a writer and a
repair do with a block whose records cannot be trusted.

A block is *damaged* when its ``meta`` record fails
:meth:`~ucm_db.index.entries.BlockMeta.unpack` (wrong length, sizes no
block can have), when its stored bytes disagree with its metadata, or when
its payload does not decode. Damage is a miss and a quarantine, never an
exception out of a read, a put, a flush or a close.

:class:`Damage` is the one owner of reading records that may be damaged
inside a write transaction and of quarantine: the index's writer reads
through it (:meth:`Damage.meta_or_clear`) and the tier quarantines through
it. It removes a quarantined block's subtree itself
(:func:`ucm_db.index.removal.remove_tree`), so it calls back into no other
part of the index. The module's functions work inside a caller's
transaction.

Invariants:
    * Quarantining removes the block and its descendants (prefix invariant)
      and files a ``quarantine`` record, in one transaction; their pins go
      with them (:mod:`ucm_db.index.pins`). Entries that
      only the damaged record could name (its LRU entry, its parent's child
      link, when the record is too short to read) are left for eviction and
      ``compact`` to drop as stale; they never make a block count as stored.
    * A block whose sizes cannot be trusted is never subtracted from the
      counters: the transaction that removes it recounts them from the
      records that are whole (:meth:`Changes.recount`).
    * A payload whose page LMDB cannot free (a zeroed overflow page: the
      delete fails with ``MDB_CORRUPTED``) stays behind as a *stuck* entry,
      named by its quarantine record (``"payload_stuck": true``). It has no
      metadata, so it is never read; the audit does not call it an orphan;
      ``compact``'s rewrite copies the store without it. Until then a put of
      that very key is refused with a :class:`TierError` naming ``compact``
      (writing over the value would have to free the page too).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from ucm_db import codec
from ucm_db.errors import DamagedPageError, TierError
from ucm_db.index import pins
from ucm_db.index.accounting import Changes, Totals
from ucm_db.engines.base import Buffer, Engine, T, Txn
from ucm_db.index.entries import BlockMeta, DamagedMeta, TierLimits, body_of, lru_key
from ucm_db.index.removal import detach, remove_tree

logger = logging.getLogger("ucm_db")
#: Damaged blocks one evicting write sets aside before it gives up (:meth:`Damage.write_evicting`).
EVICTION_REPAIRS = 8
#: ``still_corrupt(head, body)``: re-checks a block inside the write transaction.
Recheck = Callable[[memoryview, memoryview], bool]
#: ``still_damaged(txn, meta)``: re-judges a whole record inside the write transaction (a writer may have healed it).
MetaRecheck = Callable[[Txn, BlockMeta], bool]
#: Reason filed for an orphan payload whose page the engine cannot free (:meth:`Damage.drop_orphan_payloads`).
ORPHAN_STUCK = "orphan payload (no metadata) on a damaged page the engine cannot free"


class Damage:
    """The owner of damaged records: reads a block's record inside a write
    transaction, quarantining it where it is damaged, and quarantines
    blocks (see module invariants). Built over ``engine`` and the tier's
    shared ``limits`` (the change feed's length)."""

    def __init__(self, engine: Engine, limits: TierLimits) -> None:
        self.engine = engine
        self.limits = limits
        #: Blocks :meth:`quarantine` removed in this process, descendants
        #: included (``verify --fix`` reports its own share, whatever other
        #: writers commit meanwhile).
        self.quarantined_blocks = 0
        self._counting = threading.Lock()

    def meta_or_clear(self, txn: Txn, changes: Changes, key: bytes) -> BlockMeta | None:
        """``key``'s metadata; a damaged record is quarantined (with the
        block's descendants) inside ``txn`` and reads as None."""
        data = txn.get("meta", key)
        if data is None:
            return None
        try:
            return BlockMeta.unpack(data)
        except DamagedMeta as exc:
            logger.warning("ucm-db: block %s: %s; quarantined", key.hex()[:16], exc)
            self._file(txn, changes, key, str(exc), None, exc, keep_payload=False)
            return None

    def quarantine(self, key: bytes, reason: str, still_corrupt: Recheck, *, still_damaged: MetaRecheck | None = None) -> bool:
        """Quarantines ``key`` with its descendants unless ``still_corrupt(head,
        body)``, asked inside the write transaction, clears a block whose
        record and stored bytes agree (another process may have replaced
        it), or ``still_damaged(txn, meta)`` clears its whole record (a writer
        stored its missing parent again: it is reachable and intact); where
        deleting its payload fails on a damaged page, quarantines it again
        leaving the payload as a stuck entry (any other failure, a full disk
        say, is raised: a stuck entry refuses puts of its key until a
        compact). Returns whether the block was quarantined."""
        def run(txn: Txn, keep_payload: bool) -> int | None:
            return self._quarantine_in(txn, key, reason, still_corrupt, keep_payload=keep_payload, still_damaged=still_damaged)
        try:
            removed = self.engine.write(lambda txn: run(txn, False))
        except DamagedPageError as exc:
            logger.warning("ucm-db: quarantining block %s failed (%s); leaving its payload behind", key.hex()[:16], exc)
            removed = self.engine.write(lambda txn: run(txn, True))
        if removed is None:
            return False
        with self._counting:  # counted once its transaction committed; threads may quarantine at once
            self.quarantined_blocks += removed
        return True

    def records(self) -> dict[bytes, dict[str, Any]]:
        """Every quarantine record, by key (one snapshot); a damaged one reads
        as ``{"reason": ..., "damaged": True}`` (``verify`` names it)."""
        return self.engine.read(lambda txn: {bytes(k): _record_or_damaged(v) for k, v in txn.scan("quarantine")})

    def drop_orphan_payloads(self) -> tuple[int, int]:
        """Deletes every ``blocks``/``heads`` entry without metadata (not a stuck
        payload), a write transaction per key; one on a page the engine cannot
        free is filed as stuck instead. Returns (dropped, filed as stuck)."""
        orphans = self.engine.read(_orphan_payload_keys)
        dropped = stuck = 0
        for key in orphans:
            try:
                dropped += self.engine.write(lambda txn: _drop_orphan(txn, key, keep_payload=False))
            except DamagedPageError:  # the stuck record says why; compact's rewrite leaves it behind
                stuck += self.engine.write(lambda txn: _drop_orphan(txn, key, keep_payload=True))
        return dropped, stuck

    def delete_around(self, keys: Sequence[bytes], namespace_id: bytes | None, delete: Callable[[], int]) -> int:
        """Runs ``delete()`` (a delete of ``keys`` and their descendants); where
        it fails on a payload the engine cannot free, quarantines the
        unreadable blocks of those trees first (leaving their payloads stuck)
        and deletes again. Returns blocks removed (on that path counted from
        the totals, so a concurrent writer's blocks may blur the count)."""
        try:
            return delete()
        except TierError:
            before = self.engine.read(Totals.read_or_recompute).blocks
            if not self.set_aside_unfreeable(keys, namespace_id):
                raise
            delete()
            return before - self.engine.read(Totals.read_or_recompute).blocks

    def write_evicting(self, run: Callable[[Txn, list[bytes]], T]) -> T:
        """``run(txn, victims)`` in a write transaction that may evict, each
        victim appended to ``victims`` (fresh for each attempt) before it is
        removed. Where it fails on a payload the engine cannot free (a
        damaged page under the block being evicted, ``victims[-1]``), that
        tree's unreadable blocks are set aside (:meth:`set_aside_unfreeable`)
        and ``run`` runs again, at most :data:`EVICTION_REPAIRS` times: one
        damaged block must not fail every put whose eviction reaches it (a
        damaged block is a miss, never a wedge)."""
        for repairs in range(EVICTION_REPAIRS + 1):
            victims: list[bytes] = []
            try:
                return self.engine.write(lambda txn: run(txn, victims))
            except DamagedPageError:
                if not victims or repairs == EVICTION_REPAIRS or not self.set_aside_unfreeable(victims[-1:]):
                    raise
        raise AssertionError("unreachable: the last attempt returns or raises")

    def set_aside_unfreeable(self, keys: Sequence[bytes], namespace_id: bytes | None = None) -> bool:
        """Quarantines the blocks under ``keys`` (of ``namespace_id``) whose
        payload does not decode, leaving each payload a stuck entry: what a
        removal that failed on a damaged page (a delete, an eviction) needs
        before it can run again. Returns whether there were any."""
        bad = self.engine.read(lambda txn: _unreadable_in_trees(txn, keys, namespace_id))
        for key in bad:
            self.quarantine(key, "its payload could not be deleted (a damaged page)", lambda _head, _body: True)
        return bool(bad)

    def _quarantine_in(self, txn: Txn, key: bytes, reason: str, still_corrupt: Recheck, *, keep_payload: bool,
                       still_damaged: MetaRecheck | None = None) -> int | None:
        """One quarantine transaction (:meth:`quarantine`); with
        ``keep_payload`` the block's own ``blocks`` value is left as a stuck
        entry. Returns the blocks it removed (descendants included; 0 for a
        record-less payload), None where a recheck cleared the block."""
        data = txn.get("meta", key)
        damaged: DamagedMeta | None = None
        meta: BlockMeta | None = None
        if data is not None:
            try:
                meta = BlockMeta.unpack(data)
            except DamagedMeta as exc:
                damaged = exc
        if still_damaged is not None and meta is not None and not still_damaged(txn, meta):
            return None
        stored = txn.get("blocks", key)
        if meta is not None and stored is not None:
            head = memoryview(txn.get("heads", key) or b"")
            body = body_of(head, memoryview(stored))
            if len(head) + len(body) == meta.stored_bytes and not still_corrupt(head, body):
                return None
        changes = Changes(txn)
        removed = self._file(txn, changes, key, reason, meta, damaged, keep_payload=keep_payload)
        changes.commit()
        return removed

    def _file(self, txn: Txn, changes: Changes, key: bytes, reason: str, meta: BlockMeta | None,
              damaged: DamagedMeta | None, *, keep_payload: bool) -> int:
        """Removes ``key`` (whole record ``meta``, or a ``damaged`` one, or
        none) and its descendants, and files its quarantine record. Returns
        the blocks removed (those with a record)."""
        fields = meta if meta is not None else damaged.fields if damaged is not None else None
        record: dict[str, object] = {
            "reason": reason, "time_ns": time.time_ns(),
            "namespace": fields.namespace_id.hex() if fields else None,
            "stored_bytes": meta.stored_bytes if meta else None,
        }
        feed_max_records = self.limits.feed_max_records
        children = [bytes(link[32:]) for link, _ in txn.scan("children", key)]
        pins.release_above(txn, changes, key)  # the subtree's pins leave its ancestors (pins.py)
        removed = 0
        if txn.get("meta", key) is not None:
            removed = detach(txn, changes, key, fields, damaged, delete_payload=not keep_payload, feed_max_records=feed_max_records)
        elif not keep_payload:
            txn.delete("blocks", key)
            txn.delete("heads", key)
        for child in children:
            removed += remove_tree(txn, changes, child, feed_max_records=feed_max_records)
        if keep_payload:
            record["payload_stuck"] = True
        txn.put("quarantine", key, json.dumps(record).encode())
        changes.totals.quarantined += 1
        return removed


def meta_or_none(data: Buffer | None) -> BlockMeta | None:
    """The record's fields; None where absent or damaged."""
    if data is None:
        return None
    try:
        return BlockMeta.unpack(data)
    except DamagedMeta:
        return None


def stored_meta(txn: Txn, key: bytes) -> BlockMeta | None:
    """``key``'s metadata, None where absent or damaged."""
    return meta_or_none(txn.get("meta", key))


def has_live_children(txn: Txn, key: bytes) -> bool:
    """Whether ``key`` has a stored child; links to a child without metadata
    (left by a damaged record) are deleted on the way."""
    stale = []
    for link, _ in txn.scan("children", key):
        if txn.get("meta", link[32:]) is not None:
            break
        stale.append(bytes(link))
    else:
        link = None
    for dead in stale:
        txn.delete("children", dead)
    return link is not None


def is_stuck(txn: Txn, key: bytes) -> bool:
    """Whether ``key``'s payload is a stuck entry (module docstring)."""
    record = txn.get("quarantine", key)
    if record is None:
        return False
    try:
        return bool(json.loads(bytes(record)).get("payload_stuck"))
    except (ValueError, UnicodeDecodeError, AttributeError):
        return False


def any_quarantined(txn: Txn) -> bool:
    """Whether any quarantine record exists: without one, no put can meet
    a stuck payload (:func:`refuse_stuck`), so a put reads this once
    instead of once per block."""
    return next(iter(txn.scan("quarantine")), None) is not None


def refuse_stuck(txn: Txn, key: bytes) -> None:
    """Raises TierError if a put of ``key`` would have to write over a stuck payload."""
    if is_stuck(txn, key) and txn.get("meta", key) is None and txn.get("blocks", key) is not None:  # quarantine: usually empty
        raise TierError(
            f"block {key.hex()[:16]} cannot be stored again: its old payload sits on a damaged page the engine cannot free",
            hint="run `ucm-db compact` on the store while no process has it open: the rewrite leaves the damaged page behind",
        )


def restore_links_in(txn: Txn, prefix: bytes = b"") -> dict[str, int]:
    """Re-adds the LRU entry of every block (under ``prefix``) that lacks one
    and the child link of every such block whose parent is stored but does
    not name it; returns how many of each were added."""
    added = {"lru": 0, "children": 0}
    for key, data in list(txn.scan("meta", prefix)):
        meta = meta_or_none(data)
        if meta is None:
            continue
        key = bytes(key)
        lru = lru_key(meta.access_ns, meta.depth, key)
        if txn.get("lru", lru) is None:
            txn.put("lru", lru, b"")
            added["lru"] += 1
        if meta.parent is not None and restore_link(txn, key, meta.parent):
            added["children"] += 1
    return added


def restore_link(txn: Txn, key: bytes, parent: bytes) -> bool:
    """Re-adds the child link ``parent`` -> ``key`` where ``parent`` is
    stored and the link is missing; returns whether it did. Never where
    ``key``'s depth is not ``parent``'s plus one: a record naming its own
    descendant as parent would have its link close a cycle of links."""
    if txn.get("children", parent + key) is not None:
        return False
    parent_meta, meta = stored_meta(txn, parent), stored_meta(txn, key)
    if parent_meta is None or meta is None or meta.depth != parent_meta.depth + 1:
        return False
    txn.put("children", parent + key, b"")
    return True


def tree_keys(txn: Txn, roots: Iterable[bytes]) -> Iterator[bytes]:
    """Every key of the trees under ``roots`` (the roots too), each once,
    following child links (a cycle of damaged links ends, never loops)."""
    stack = list(roots)
    seen: set[bytes] = set()
    while stack:
        key = stack.pop()
        if key in seen:
            continue
        seen.add(key)
        stack.extend(bytes(link[32:]) for link, _ in txn.scan("children", key))
        yield key


def _unreadable_in_trees(txn: Txn, keys: Sequence[bytes], namespace_id: bytes | None) -> list[bytes]:
    """Blocks under ``keys`` (of ``namespace_id``) whose payload does not decode."""
    roots = [k for k in keys if (meta := stored_meta(txn, k)) is not None and namespace_id in (None, meta.namespace_id)]
    bad = []
    for key in tree_keys(txn, roots):
        stored = txn.get("blocks", key)
        head = memoryview(txn.get("heads", key) or b"")
        if stored is not None and not codec.readable(head, body_of(head, memoryview(stored)), key):
            bad.append(key)
    return bad


def _record_or_damaged(value: Buffer) -> dict[str, Any]:
    why = quarantine_record_problem(value)
    return json.loads(bytes(value)) if why is None else {"reason": f"damaged quarantine record: {why}", "damaged": True}


def quarantine_record_problem(value: Buffer) -> str | None:
    """Why a quarantine record is damaged (not a JSON object); None when whole."""
    try:
        return None if isinstance(json.loads(bytes(value)), dict) else "not a JSON object"
    except (ValueError, UnicodeDecodeError):
        return "not JSON"


def quarantine_problems(txn: Txn) -> list[str]:
    """One line per damaged quarantine record (``verify`` names them)."""
    return [f"quarantine record {bytes(key).hex()[:16]} is damaged: {problem}"
            for key, value in txn.scan("quarantine") if (problem := quarantine_record_problem(value)) is not None]


def drop_damaged_quarantine_records(txn: Txn) -> int:
    """Deletes the damaged quarantine records; returns how many (a stuck payload
    one named is an orphan then: :meth:`Damage.drop_orphan_payloads`)."""
    doomed = [bytes(key) for key, value in txn.scan("quarantine") if quarantine_record_problem(value) is not None]
    for key in doomed:
        txn.delete("quarantine", key)
    return len(doomed)


def _orphan_payload_keys(txn: Txn) -> list[bytes]:
    """Keys with a ``blocks`` or ``heads`` entry, no metadata and no stuck payload."""
    return sorted({bytes(k) for table in ("blocks", "heads") for k, _ in txn.scan(table)
                   if txn.get("meta", k) is None and not is_stuck(txn, k)})


def _drop_orphan(txn: Txn, key: bytes, *, keep_payload: bool) -> int:
    """Deletes ``key``'s orphan payload and head, judged again here (a put may
    have stored it since), or files the payload as stuck; 1 if it was an orphan."""
    if txn.get("meta", key) is not None or is_stuck(txn, key):
        return 0
    if txn.get("blocks", key) is None and txn.get("heads", key) is None:
        return 0  # evicted whole since the scan: no orphan
    txn.delete("heads", key)
    if not keep_payload:
        txn.delete("blocks", key)
    elif txn.get("blocks", key) is not None:
        record = {"reason": ORPHAN_STUCK, "time_ns": time.time_ns(), "namespace": None, "stored_bytes": None,
                  "payload_stuck": True}
        txn.put("quarantine", key, json.dumps(record).encode())
    return 1

