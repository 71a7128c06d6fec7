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
      one record (the head). A malformed record (too short, an unknown
      kind, undecodable fields) is skipped and logged, never raised.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Container, Iterator

from ucm_db.errors import CorruptBlockError
from ucm_db.events import BlockEventFields, ChangeBatch, ChangeRecord
from ucm_db.engines.base import Buffer, Txn

INFO = "info"
FIELDS_PREFIX = b"evf/"
FEED_PREFIX = b"feed/"
HEAD_KEY = b"feed-head"
_HEAD = struct.Struct("<QQ")
_SEQ = struct.Struct(">Q")
_DEPTH = struct.Struct("<I")
_KINDS = {1: "stored", 2: "removed"}
_NS_BYTES, _KEY_BYTES = 16, 32
logger = logging.getLogger("ucm_db")


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


#: One record as read: (seq, kind, namespace id, key, depth, packed fields).
RawRecord = tuple[int, str, bytes, bytes, int, bytes]


def since(txn: Txn, seq: int, limit: int, namespaces: Container[bytes] | None) -> ChangeBatch:
    """Records ``[seq, seq + limit)`` (those of ``namespaces`` only, if
    given); ``resync`` if ``seq`` was trimmed or is ahead of the feed."""
    raw, next_seq, resync = since_raw(txn, seq, limit, namespaces)
    return ChangeBatch(tuple(decoded(raw)), next_seq, resync)


def since_raw(txn: Txn, seq: int, limit: int, namespaces: Container[bytes] | None) -> tuple[list[RawRecord], int, bool]:
    """:func:`since` without decoding the fields: (records, next_seq, resync)."""
    next_seq, first_seq = _head(txn)
    if seq < first_seq or seq > next_seq:
        return [], next_seq, True
    out: list[RawRecord] = []
    stop = min(next_seq, seq + max(1, limit))
    for at in range(seq, stop):
        value = txn.get(INFO, FEED_PREFIX + _SEQ.pack(at))
        if value is None:
            continue  # cannot happen at a commit; tolerated
        ns = bytes(value[1:1 + _NS_BYTES])
        if namespaces is None or ns in namespaces:
            key_end = 1 + _NS_BYTES + _KEY_BYTES
            if len(value) < key_end + _DEPTH.size or value[0] not in _KINDS:
                _skip(f"feed record {at}", f"{len(value)} bytes, kind {value[0] if len(value) else None}")
                continue
            depth = _DEPTH.unpack_from(value, key_end)[0]
            out.append((at, _KINDS[value[0]], ns, bytes(value[1 + _NS_BYTES:key_end]), depth, bytes(value[key_end + _DEPTH.size:])))
    return out, stop, False


def _skip(what: str, reason: str) -> None:
    """Logs a malformed record (a damaged page, a flipped bit) the readers skip."""
    logger.warning("ucm-db: change feed: %s skipped: malformed (%s)", what, reason)


def to_record(raw: RawRecord) -> ChangeRecord:
    """A raw record with its fields decoded.

    Raises:
        CorruptBlockError: the fields are malformed.
    """
    seq, kind, ns, key, depth, packed = raw
    return ChangeRecord(seq, kind, ns, key, BlockEventFields.unpack(packed), depth)  # type: ignore[arg-type]


def decoded(raw: list[RawRecord]) -> Iterator[ChangeRecord]:
    """The records with their fields decoded; a malformed one (a damaged
    page, a flipped bit) is skipped and logged, never raised: an engine's
    scheduler step reads these."""
    for record in raw:
        try:
            yield to_record(record)
        except CorruptBlockError as exc:
            logger.warning("ucm-db: change feed record of block %s skipped: %s", record[3].hex()[:16], exc)


def inventory(txn: Txn, namespaces: Container[bytes] | None) -> tuple[list[ChangeRecord], int]:
    """Every stored evented block (of ``namespaces``, if given) as a
    ``stored`` record, parents before children (by depth), and the
    ``next_seq`` of the same snapshot: a reader follows the feed from there."""
    raw, next_seq = inventory_raw(txn, namespaces)
    return list(decoded(raw)), next_seq


def inventory_raw(txn: Txn, namespaces: Container[bytes] | None) -> tuple[list[RawRecord], int]:
    """:func:`inventory` without decoding the fields (a 100k-block replay
    spends most of its time there)."""
    next_seq, _ = _head(txn)
    skip, fields_at = len(FIELDS_PREFIX), _NS_BYTES + _DEPTH.size
    out: list[RawRecord] = []
    for name, value in txn.scan(INFO, FIELDS_PREFIX):
        ns = bytes(value[:_NS_BYTES])
        if len(value) < fields_at:
            _skip(f"fields of block {bytes(name[skip:]).hex()[:16]}", f"{len(value)} bytes")
            continue
        if namespaces is None or ns in namespaces:
            out.append((next_seq, "stored", ns, name[skip:], _DEPTH.unpack_from(value, _NS_BYTES)[0], bytes(value[fields_at:])))
    out.sort(key=lambda r: r[4])
    return out, next_seq


def position(txn: Txn) -> tuple[int, int]:
    """``(next_seq, first_seq)`` of the feed."""
    return _head(txn)
