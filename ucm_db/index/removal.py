"""Removing blocks from the local index inside a write transaction: a block
with its descendants (a delete, an eviction, a quarantine's subtree) or one
block's entries alone (:func:`detach`).

Every function here works inside the caller's transaction and commits
nothing: the caller's :class:`~ucm_db.index.accounting.Changes` carries the
counters, so they change in the same commit as the tables.

Invariants:
    * Prefix invariant: :func:`remove_tree` removes a block and every
      descendant together; its pins leave its ancestors first
      (:func:`ucm_db.index.pins.release_above`).
    * Every entry naming a removed block goes with it (``meta``, ``blocks``,
      ``heads``, ``lru``, ``children`` links both ways, ``uploads``, its pin
      record), and an evented block's removal is logged in the change feed
      (:mod:`ucm_db.index.changefeed`).
    * A block whose record is damaged is never subtracted from the counters:
      they are recounted instead (:meth:`Changes.recount`).
"""

from __future__ import annotations

from ucm_db.engines.base import Txn
from ucm_db.index import changefeed, pins, records
from ucm_db.index.accounting import Changes
from ucm_db.index.entries import BlockMeta, DamagedMeta, lru_key


def remove_tree(txn: Txn, changes: Changes, key: bytes, *, feed_max_records: int) -> int:
    """Removes ``key`` and all its descendants; returns blocks removed."""
    pins.release_above(txn, changes, key)
    stack = [key]
    removed = 0
    while stack:
        current = stack.pop()
        stack.extend(child[32:] for child, _ in list(txn.scan("children", current)))
        removed += _remove_one(txn, changes, current, feed_max_records)
    return removed


def remove_tail(txn: Txn, changes: Changes, key: bytes, meta: BlockMeta, *, feed_max_records: int,
                uploads: bool = True, evented: bool = True) -> int:
    """Removes ``key``, a chain tail eviction found in this transaction: its
    record ``meta`` read whole, no child link left (a stale one was
    dropped on the way), no pin record; nothing removed since. So its own
    entries are all there is to remove: :func:`remove_tree`'s work less
    the reads that can only find nothing (child links, pin records).
    ``uploads``/``evented`` False: the transaction holds no queued upload /
    no evented block's fields at all, so there is none of this block's to
    remove either. Returns 1."""
    delete = txn.delete
    delete("meta", key)
    delete("blocks", key)
    delete("heads", key)
    delete("lru", lru_key(meta.access_ns, meta.depth, key))
    if uploads:
        delete("uploads", key)
    if meta.parent is not None:
        delete("children", meta.parent + key)
    if evented:
        changefeed.removed(txn, key, feed_max_records)
    changes.add(meta, -1)
    return 1


def _remove_one(txn: Txn, changes: Changes, key: bytes, feed_max_records: int) -> int:
    data = txn.get("meta", key)
    if data is None:
        return 0
    try:
        meta = BlockMeta.unpack(data)
    except DamagedMeta as exc:
        return detach(txn, changes, key, exc.fields, exc, feed_max_records=feed_max_records)
    txn.delete("meta", key)
    txn.delete("blocks", key)
    txn.delete("heads", key)
    txn.delete("lru", lru_key(meta.access_ns, meta.depth, key))
    txn.delete("uploads", key)
    for child, _ in list(txn.scan("children", key)):
        txn.delete("children", child)
    if meta.parent is not None:
        txn.delete("children", meta.parent + key)
    changefeed.removed(txn, key, feed_max_records)
    pins.drop(txn, changes, key)
    changes.add(meta, -1)
    return 1


def detach(txn: Txn, changes: Changes, key: bytes, fields: BlockMeta | None, damaged: DamagedMeta | None,
           *, feed_max_records: int, delete_payload: bool = True) -> int:
    """Removes the entries of ``key`` (its children's links too, not the
    children) given its record's ``fields`` (None: unreadable). A
    ``damaged`` record's sizes are not subtracted: the counters are
    recounted. Without ``delete_payload`` the ``blocks`` value stays (a
    stuck payload, :mod:`ucm_db.index.damage`). Returns 1."""
    txn.delete("meta", key)
    changefeed.removed(txn, key, feed_max_records)
    pins.drop(txn, changes, key)
    if delete_payload:
        txn.delete("blocks", key)
    txn.delete("heads", key)
    txn.delete("uploads", key)
    if fields is not None:
        txn.delete("lru", lru_key(fields.access_ns, fields.depth, key))
        if fields.parent is not None:
            txn.delete("children", fields.parent + key)
    for link, _ in list(txn.scan("children", key)):
        txn.delete("children", link)
    if damaged is not None:
        changes.recount(records.DamagedRecord(b"meta/" + key.hex()[:16].encode(), damaged.reason))
    elif fields is not None:
        changes.add(fields, -1)
    return 1
