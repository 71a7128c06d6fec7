"""Retractions: blocks deleted locally whose remote objects must go too.

A delete on a store with a remote (``Store.delete``: a connector's void of
a save computed over a failed load, a caller undoing its put) removes the
blocks from the local tier and records, in the same transaction, one
retraction per block it removed (``info/retract/<key>``: namespace id,
depth, when), and one per key it was asked to delete that this store does
not hold (evicted here: its remote object may still serve other nodes,
:func:`record_absent`). The remote wing deletes their objects
(:mod:`ucm_db.remote.retraction`), each after leaving a tombstone beside it
for other nodes (:mod:`ucm_db.remote.tombstones`), and confirms each
retraction; a confirmed one is dropped :data:`RETRACTION_GRACE_S` later.

Invariants:
    * Exact: the retractions are written by the transaction that removes
      the blocks, one for each block it removes (the roots and every
      descendant, whoever stored them), so no descendant stored before the
      delete escapes and none stored after it is named.
    * While a block's retraction exists, a fetched copy of it is never
      promoted into the local tier (:func:`refuse`, run inside promotion's
      write transaction): a fetch that read the object before its remote
      delete and commits after the local delete is refused, and so is every
      fetch while the remote delete keeps failing. Puts are not refused: a
      block computed again is stored (and, once its retraction is confirmed,
      uploaded again: :func:`confirm`).
    * A retraction is confirmed only for the record its remote delete read
      (same ``retracted_ns``): a block deleted again meanwhile (a second
      void) keeps a pending retraction, so its remote object is deleted
      after whatever was uploaded since.
    * Reopened when an upload made outside the elected uploader's batches
      (a write-through put's) lands after the retraction was recorded, or
      recorded again, since the upload read its block (:func:`reopen`):
      pending or confirmed, the record gets a new ``retracted_ns``, so a
      pass whose delete ran before the landing never confirms it, and the
      elected uploader deletes the object again after it (a reopen of
      confirmed ones only let an upload landing between a pass's delete and
      its confirmation stay: tests/remote/test_review_uploads_reopen.py). A
      record the upload saw when it read its block is left alone: that
      block was stored after the retraction (its transaction removed every
      block it names), so it is the recomputed one (its reopen made the
      pass delete the correct object).
    * Records are checksummed (:mod:`ucm_db.index.records`); a damaged one
      still refuses promotion of its key and is never confirmed or dropped.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from ucm_db.engines.base import Txn
from ucm_db.errors import MissingAncestorError
from ucm_db.index import provisional, records
from ucm_db.index.damage import meta_or_none, tree_keys

RETRACTION_PREFIX = b"retract/"
#: namespace id, depth, retracted_ns, confirmed_ns (0: the remote delete is pending).
_RECORD = struct.Struct("<16sIQQ")
#: How long a confirmed retraction still refuses promotion: a fetch that
#: read the object before its remote delete may commit after it (a
#: background continuation), never this much later.
RETRACTION_GRACE_S = 3600.0
#: The depth recorded for a block retracted where it is not stored (:func:`record_absent`).
UNKNOWN_DEPTH = 0xFFFFFFFF


class RetractedBlockError(MissingAncestorError):
    """A fetched block whose retraction is recorded: not promoted (as a run
    whose parent is missing is not). Internal to promotion."""


@dataclass(frozen=True, slots=True)
class Retraction:
    """One block whose remote object is to be deleted (``confirmed_ns`` 0: pending)."""

    key: bytes
    namespace_id: bytes
    depth: int
    retracted_ns: int
    confirmed_ns: int = 0


def record_trees(txn: Txn, roots: Iterable[bytes], now_ns: int) -> int:
    """Records a retraction for each stored block of the trees under
    ``roots`` (before they are removed, in the removing transaction);
    returns how many."""
    count = 0
    for key in tree_keys(txn, roots):
        meta = meta_or_none(txn.get("meta", key))
        if meta is None:
            continue  # no record: nothing names its remote object
        records.put_checked(txn, RETRACTION_PREFIX + key, _RECORD.pack(meta.namespace_id, meta.depth, now_ns, 0))
        count += 1
    return count


def record_absent(txn: Txn, keys: Sequence[bytes], namespace_id: bytes, now_ns: int) -> int:
    """Records a retraction under ``namespace_id`` for each of ``keys``,
    which this store holds no record of (evicted here, or stored by another
    node): its remote object may still be there. Its depth is unknown, so
    it is recorded deepest (:data:`UNKNOWN_DEPTH`): a round deletes it
    before any parent. Returns how many."""
    for key in keys:
        records.put_checked(txn, RETRACTION_PREFIX + key, _RECORD.pack(namespace_id, UNKNOWN_DEPTH, now_ns, 0))
    return len(keys)


def any_recorded(txn: Txn) -> bool:
    """Whether any retraction is recorded (one cursor seek)."""
    return any(True for _ in txn.scan(records.INFO, RETRACTION_PREFIX))


def refuse(txn: Txn, keys: Sequence[bytes]) -> None:
    """Raises :class:`RetractedBlockError` if one of ``keys`` is retracted
    (promotion's guard, inside its write transaction)."""
    first = first_retracted(txn, keys)
    if first is not None:
        raise RetractedBlockError(f"block {keys[first].hex()[:16]} was deleted here and its remote object is retracted",
                                  hint="nothing to do: it is not promoted; computed again, it is stored and uploaded")


def first_retracted(txn: Txn, keys: Sequence[bytes]) -> int | None:
    """Index of the first of ``keys`` with a retraction, or None."""
    if not keys or not any_recorded(txn):
        return None
    return next((i for i, key in enumerate(keys) if txn.get(records.INFO, RETRACTION_PREFIX + key) is not None), None)


def retracted_among(txn: Txn, keys: Sequence[bytes]) -> set[bytes]:
    """Those of ``keys`` with a retraction."""
    if not keys or not any_recorded(txn):
        return set()
    return {key for key in keys if txn.get(records.INFO, RETRACTION_PREFIX + key) is not None}


def scan(txn: Txn) -> Iterable[Retraction]:
    """Every readable retraction, in key order (damaged ones are left out)."""
    for name, value in records.scan_checked(txn, RETRACTION_PREFIX, size=_RECORD.size):
        if value is not None:
            namespace_id, depth, retracted_ns, confirmed_ns = _RECORD.unpack(bytes(value))
            yield Retraction(name[len(RETRACTION_PREFIX):], namespace_id, depth, retracted_ns, confirmed_ns)


def confirm(txn: Txn, done: Iterable[Retraction], now_ns: int) -> None:
    """Marks retractions whose remote object is deleted (each only if its
    record is still the one the delete read). A block stored again since
    it was retracted is queued for upload again: the remote delete may
    have taken its new upload. Any block stored under a retracted key was
    stored since (the retraction's transaction removed every block it
    names, and promotion refuses the key), so no clock decides it: a wall
    clock stepped back between the delete and the new put made the block
    look older than its delete, and it was never uploaded again (audit:
    tests/remote/test_audit_uploads_clock.py). A block a provisional put
    holds is not queued: its tag's settle queues it (:mod:`provisional`)."""
    done = list(done)
    held = provisional.held_keys(txn) if done else set()
    for item in done:
        name = RETRACTION_PREFIX + item.key
        value = txn.get(records.INFO, name)
        if value is None or len(value) != _RECORD.size or _RECORD.unpack(bytes(value))[2] != item.retracted_ns:
            continue
        records.put_checked(txn, name, _RECORD.pack(item.namespace_id, item.depth, item.retracted_ns, now_ns))
        meta = meta_or_none(txn.get("meta", item.key))
        if meta is not None and item.key not in held and txn.get("uploads", item.key) is None:
            txn.put("uploads", item.key, meta.namespace_id)


def recorded_ns(txn: Txn, key: bytes) -> int | None:
    """The ``retracted_ns`` of ``key``'s retraction, as :func:`reopen`
    compares it; None: none recorded (-1: a damaged record, which
    :func:`reopen` leaves alone)."""
    value = txn.get(records.INFO, RETRACTION_PREFIX + key)
    if value is None:
        return None
    if len(value) != _RECORD.size:
        return -1
    return int(_RECORD.unpack(bytes(value))[2])


def reopen(txn: Txn, keys: Iterable[bytes], read: Mapping[bytes, int | None], now_ns: int) -> int:
    """Makes the retractions of ``keys`` pending under a new
    ``retracted_ns``, but those whose ``retracted_ns`` is still the one in
    ``read`` (key -> what the upload saw when it read its block; None or
    left out: none): an upload that read its block before them landed, so
    the remote object is to be deleted again after it (module invariants).
    Returns how many were reopened."""
    count = 0
    for key in keys:
        value = txn.get(records.INFO, RETRACTION_PREFIX + key)
        if value is None or len(value) != _RECORD.size:
            continue  # none, or damaged (a damaged record is never confirmed, so pending already)
        namespace_id, depth, retracted_ns, _confirmed_ns = _RECORD.unpack(bytes(value))
        if read.get(key) == retracted_ns:
            continue
        again_ns = max(now_ns, retracted_ns + 1)  # never the one a pass in flight will confirm
        records.put_checked(txn, RETRACTION_PREFIX + key, _RECORD.pack(namespace_id, depth, again_ns, 0))
        count += 1
    return count


def drop(txn: Txn, keys: Iterable[bytes]) -> None:
    """Removes the retractions of ``keys`` (expired ones)."""
    for key in keys:
        records.delete_checked(txn, RETRACTION_PREFIX + key)
