"""The change feed: evented blocks' fields and the sequence-numbered log of
their puts and removals, kept in the ``info`` table by the local tier's own
write transactions (:mod:`ucm_db.events` has the value types).

Records (all in ``info``; nothing else scans these prefixes):

* ``evf/<key>``:  namespace id (16) | depth (u32 LE) | packed
  :class:`~ucm_db.events.BlockEventFields` of an evented block, present
  exactly while the block is stored.
* ``feed/<seq BE u64>``: kind (1 stored, 2 removed) | namespace id (16) |
  key (32) | depth (u32 LE) | packed fields.
* ``feed-head``: ``next_seq`` and ``first_seq`` (u64 LE each).

Invariants:
    * :func:`stored` and :func:`removed` run inside the write transaction
      that puts or removes the block, so the log and the store never
      disagree at any commit, across processes and engines (LMDB and
      RocksDB alike: only the Txn interface is used).
    * A removal of a block without ``evf/`` costs one ``get``; nothing is
      logged for it.
    * Each append trims the oldest records beyond ``max_records`` in the
      same transaction, so the feed is bounded whatever the readers do.
    * Reads take one read transaction: :func:`since` with nothing new reads
      one record (the head).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

from ucm_db.events import BlockEventFields, ChangeBatch, ChangeRecord
from ucm_db.tiers.base import Buffer, Txn

INFO = "info"
FIELDS_PREFIX = b"evf/"
FEED_PREFIX = b"feed/"
HEAD_KEY = b"feed-head"
_HEAD = struct.Struct("<QQ")
_SEQ = struct.Struct(">Q")
_DEPTH = struct.Struct("<I")
_KINDS = {1: "stored", 2: "removed"}
_NS_BYTES, _KEY_BYTES = 16, 32


def stored(txn: Txn, key: bytes, namespace_id: bytes, depth: int, packed_fields: bytes, max_records: int) -> None:
    """Records a newly stored evented block and logs its ``stored`` record."""
    value = namespace_id + _DEPTH.pack(depth) + packed_fields
    txn.put(INFO, FIELDS_PREFIX + key, value)
    _append(txn, b"\x01", key, value, max_records)


def removed(txn: Txn, key: bytes, max_records: int) -> None:
    """Logs the removal of ``key`` if it is evented (one get if not)."""
    value = txn.get(INFO, FIELDS_PREFIX + key)
    if value is None:
        return
    value = bytes(value)
    txn.delete(INFO, FIELDS_PREFIX + key)
    _append(txn, b"\x02", key, value, max_records)


def _append(txn: Txn, kind: bytes, key: bytes, value: bytes, max_records: int) -> None:
    next_seq, first_seq = _head(txn)
    txn.put(INFO, FEED_PREFIX + _SEQ.pack(next_seq), kind + value[:_NS_BYTES] + key + value[_NS_BYTES:])
    next_seq += 1
    while next_seq - first_seq > max(1, max_records):
        txn.delete(INFO, FEED_PREFIX + _SEQ.pack(first_seq))
        first_seq += 1
    txn.put(INFO, HEAD_KEY, _HEAD.pack(next_seq, first_seq))


def _head(txn: Txn) -> tuple[int, int]:
    data = txn.get(INFO, HEAD_KEY)
    if data is None or len(data) != _HEAD.size:
        return 0, 0
    next_seq, first_seq = _HEAD.unpack(data)
    return next_seq, first_seq


def since(txn: Txn, seq: int, limit: int, namespace_id: bytes | None) -> ChangeBatch:
    """Records ``[seq, seq + limit)`` (those of ``namespace_id`` only, if
    given); ``resync`` if ``seq`` was trimmed or is ahead of the feed."""
    next_seq, first_seq = _head(txn)
    if seq < first_seq or seq > next_seq:
        return ChangeBatch((), next_seq, resync=True)
    if seq == next_seq:
        return ChangeBatch((), next_seq)
    out: list[ChangeRecord] = []
    stop = min(next_seq, seq + max(1, limit))
    for at in range(seq, stop):
        value = txn.get(INFO, FEED_PREFIX + _SEQ.pack(at))
        if value is None:
            continue  # cannot happen at a commit; tolerated
        record = _record(at, value)
        if namespace_id is None or record.namespace_id == namespace_id:
            out.append(record)
    return ChangeBatch(tuple(out), stop)


def _record(seq: int, value: Buffer) -> ChangeRecord:
    kind = _KINDS[value[0]]
    ns = bytes(value[1:1 + _NS_BYTES])
    key = bytes(value[1 + _NS_BYTES:1 + _NS_BYTES + _KEY_BYTES])
    at = 1 + _NS_BYTES + _KEY_BYTES
    depth = _DEPTH.unpack_from(value, at)[0]
    fields = BlockEventFields.unpack(memoryview(value)[at + _DEPTH.size:])
    return ChangeRecord(seq, kind, ns, key, fields, depth)  # type: ignore[arg-type]


def inventory(txn: Txn, namespace_id: bytes | None) -> tuple[list[ChangeRecord], int]:
    """Every stored evented block (of ``namespace_id``, if given) as a
    ``stored`` record, parents before children (by depth), and the
    ``next_seq`` of the same snapshot: a reader follows the feed from there."""
    next_seq, _ = _head(txn)
    out = [r for r in _evented(txn, next_seq) if namespace_id is None or r.namespace_id == namespace_id]
    out.sort(key=lambda r: r.depth)
    return out, next_seq


def _evented(txn: Txn, seq: int) -> Iterator[ChangeRecord]:
    skip = len(FIELDS_PREFIX)
    for name, value in txn.scan(INFO, FIELDS_PREFIX):
        depth = _DEPTH.unpack_from(value, _NS_BYTES)[0]
        fields = BlockEventFields.unpack(memoryview(value)[_NS_BYTES + _DEPTH.size:])
        yield ChangeRecord(seq, "stored", bytes(value[:_NS_BYTES]), bytes(name[skip:]), fields, depth)


def position(txn: Txn) -> tuple[int, int]:
    """``(next_seq, first_seq)`` of the feed."""
    return _head(txn)
