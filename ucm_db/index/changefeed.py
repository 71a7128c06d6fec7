"""The change feed: evented blocks' fields and the sequence-numbered log of
their puts and removals, kept in the ``info`` table by the local tier's own
write transactions (:mod:`ucm_db.events` has the value types).

Records (all in ``info``; nothing else scans these prefixes):

* ``evf/<key>``:  namespace id (16) | depth (u32 LE) | packed
  :class:`~ucm_db.events.BlockEventFields` of an evented block, present
  exactly while the block is stored.
* ``feed/<seq BE u64>``: kind (1 stored, 2 removed) | namespace id (16) |
  key (32) | depth (u32 LE) | packed fields.
* ``feed-head``: ``next_seq`` and ``first_seq`` (u64 LE each), checksummed
  like the counters (a ``sum:feed-head`` sidecar, :mod:`ucm_db.index.records`).
* ``feed-id``: 16 random bytes (checksummed; hex in text forms), drawn with
  the feed and again wherever seqs may be handed out a second time: a
  restart after an OS crash undid commits, a sequence started again at 0
  (a damaged head rebuilt from no records, a wrap). A reader keeping a seq
  across opens passes the id back: another id is a resync, whatever the
  seq. A store of ucm-db before feed ids reads as ``""`` until its first
  writable open draws one (a reader holding ``""`` resyncs once then).

Invariants:
    * :func:`stored` and :func:`removed` run inside the write transaction
      that puts or removes the block, so the log and the store never
      disagree at any commit, across processes and engines (LMDB and
      RocksDB alike: only the Txn interface is used).
    * A removal of a block without ``evf/`` costs one ``get``; nothing is
      logged for it.
    * Each append trims the oldest records beyond ``max_records`` (at most
      :data:`MAX_SPAN`) in the same transaction, so the feed is bounded
      whatever the readers do.
    * Reads take one read transaction: :func:`since` with nothing new reads
      the head and its checksum. A malformed record (too short, an unknown
      kind, undecodable fields) is skipped and logged, never raised;
      ``verify`` names it (:func:`problems`) and ``verify --fix`` drops it
      (:func:`repair`).
    * The inventory announces only blocks that are stored (an ``evf/``
      record left without its block's metadata is skipped).

The head (issue 46). It is *sound* when its checksum agrees, it is 16 bytes,
``first_seq <= next_seq <= SEQ_LIMIT`` and it spans at most
:data:`MAX_SPAN` records; a head without a checksum sidecar was written by
code before checksums and is trusted while it is sound, then sealed by the
next append. Any other head is *damaged* (a flipped high bit in ``next_seq``
made the trim loop run 2**63 times inside a put's write transaction, holding
the write lock of every process; ``first_seq > next_seq`` made every read a
resync). No loop ever runs over the head's numbers: the trim covers at most
``MAX_SPAN`` seqs of a sound head, and a damaged or missing head is replaced
by one derived from the records the feed holds (their keys, one scan):

* The next append rebuilds it: ``next_seq`` is one past the last record's
  seq. The sequence goes on after everything handed out (records leave the
  feed only from its low end), so a reader that was at the end reads on
  without a resync; records the rebuilt head cannot cover (beyond
  ``max_records``, names that are no seq a store reaches) are deleted.
* Until then readers read no record: a reader at the end of the records
  (``feed/<seq>`` absent, ``feed/<seq - 1>`` present) has nothing new,
  which is true; any other is told to resync once, and the inventory's seq
  is that end (never a resync loop).
* ``verify --fix`` rebuilds the head the same way. Where it drops records
  (malformed ones, records of blocks not stored, strays), it starts a new
  sequence above everything handed out, records deleted, so that every
  reader resyncs once to the (now true) inventory: a reader may have been
  told what a dropped record said.
"""

from __future__ import annotations

import logging
import secrets
import struct
from collections.abc import Container, Iterator

from ucm_db.errors import CorruptBlockError
from ucm_db.events import FEED_MAX_RECORDS, BlockEventFields, ChangeBatch, ChangeRecord
from ucm_db.engines.base import Buffer, Txn
from ucm_db.index import records

INFO = "info"
FIELDS_PREFIX = b"evf/"
FEED_PREFIX = b"feed/"
HEAD_KEY = b"feed-head"
RESTARTED_FOR_KEY = b"feed-restarted-for"
ID_KEY = b"feed-id"
BOOT_KEY = b"feed-boot"  # the boot of a RocksDB group store's last writable open (ucm_db.store.opening)
_ID_BYTES = 16
_HEAD = struct.Struct("<QQ")
_SEQ = struct.Struct(">Q")
_DEPTH = struct.Struct("<I")
_KINDS = {1: "stored", 2: "removed"}
_NS_BYTES, _KEY_BYTES = 16, 32
_KEY_END = 1 + _NS_BYTES + _KEY_BYTES
_NAME_BYTES = len(FEED_PREFIX) + _SEQ.size
#: The most records a sound head spans (``max_records`` is capped at it).
MAX_SPAN = FEED_MAX_RECORDS
#: No store hands out this many seqs (a million appends a second for 146,000
#: years): a head or record at or past it is damage.
SEQ_LIMIT = 1 << 62
#: How far :func:`restart` moves the sequence on: more seqs than a store
#: hands out between two syncs (a rollback undoes at most those).
RESTART_GAP = 1 << 32
#: A new store's feed starts at a random multiple of :data:`RESTART_GAP`
#: below this (2**52: a seq stays exact as a JSON number in any language):
#: a reader's saved seq from a store deleted and recreated at the same path
#: is then below the new feed (trimmed) or ahead of it: a resync either way,
#: not a seq it hands out again for other blocks (the same slot: odds of 2**-20).
START_LIMIT = 1 << 52
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
    keep = min(max(1, max_records), MAX_SPAN)
    head, reason = _checked_head(txn)
    next_seq, first_seq = head if head is not None else _rebuilt(txn, keep, reason)
    if next_seq >= SEQ_LIMIT:  # only damage gets here (module docstring): start again at 0
        for seq in range(first_seq, next_seq):  # a sound head: at most MAX_SPAN
            txn.delete(INFO, _name(seq))
        next_seq = first_seq = 0
        renew_identity(txn)
    txn.put(INFO, _name(next_seq), kind + value[:_NS_BYTES] + key + value[_NS_BYTES:])
    next_seq += 1
    for seq in range(first_seq, next_seq - keep):  # at most MAX_SPAN + 1: a sound head spans at most MAX_SPAN
        txn.delete(INFO, _name(seq))
    records.put_checked(txn, HEAD_KEY, _HEAD.pack(next_seq, max(first_seq, next_seq - keep)))


def restart(txn: Txn, rollback: bytes) -> None:
    """Moves the sequence :data:`RESTART_GAP` past the head (rebuilt from
    the records if damaged or absent), drops the records and draws a new
    feed id, after the rollback to a synced snapshot named ``rollback``:
    the seqs handed out after that snapshot were undone, and a reader
    holding one (a saved cursor) must be told to resync, never read other
    records under it. Once per rollback: two processes opening together
    after it restart once (``restarted-for`` records the token)."""
    if txn.get(INFO, RESTARTED_FOR_KEY) == rollback:
        return
    head, reason = _checked_head(txn)
    seqs, strays = _held(txn)
    next_seq = max(head[0] if head is not None else 0, _derived(seqs))
    for name in strays + [_name(seq) for seq in seqs]:
        txn.delete(INFO, name)
    restarted = next_seq + RESTART_GAP
    if restarted >= SEQ_LIMIT:  # 2**30 restarts: start again low, above nothing a reader can hold past a resync
        restarted = RESTART_GAP
    records.put_checked(txn, HEAD_KEY, _HEAD.pack(restarted, restarted))
    txn.put(INFO, RESTARTED_FOR_KEY, rollback)
    logger.warning("ucm-db: change feed restarted at seq %d, feed id %s, after an OS crash undid (or may have undone) commits "
                   "not yet synced%s: readers resync once", restarted, renew_identity(txn), f" (head damaged: {reason})" if reason else "")


def start(txn: Txn) -> int:
    """Writes a new store's head at a random start (:data:`START_LIMIT`) and
    its feed id, in the transaction creating the store; returns the start."""
    first_seq = (secrets.randbelow(START_LIMIT // RESTART_GAP - 1) + 1) * RESTART_GAP
    records.put_checked(txn, HEAD_KEY, _HEAD.pack(first_seq, first_seq))
    renew_identity(txn)
    return first_seq


def identity(txn: Txn) -> str:
    """The feed id (hex); ``""`` if none is recorded or it is damaged."""
    try:
        data = records.get_checked(txn, ID_KEY, size=_ID_BYTES)
    except records.DamagedRecord:
        return ""
    return "" if data is None else bytes(data).hex()


def renew_identity(txn: Txn) -> str:
    """Draws the feed a new id (seqs may be handed out again); returns it."""
    value = secrets.token_bytes(_ID_BYTES)
    records.put_checked(txn, ID_KEY, value)
    return value.hex()


def ensure_identity(txn: Txn) -> bool:
    """Draws an id for a feed without a sound one; True if it wrote."""
    if identity(txn):
        return False
    renew_identity(txn)
    return True


def _name(seq: int) -> bytes:
    return FEED_PREFIX + _SEQ.pack(seq)


def _seq_of(name: Buffer) -> int | None:
    """The seq a ``feed/`` record name holds; None for a name no sound feed has."""
    if len(name) != _NAME_BYTES:
        return None
    seq: int = _SEQ.unpack_from(name, len(FEED_PREFIX))[0]
    return seq if seq < SEQ_LIMIT else None


def _checked_head(txn: Txn) -> tuple[tuple[int, int] | None, str | None]:
    """``((next_seq, first_seq), None)`` for a sound head, ``(None, reason)``
    for a damaged one, ``(None, None)`` where there is none."""
    try:
        data = records.get_checked(txn, HEAD_KEY, size=_HEAD.size)
    except records.DamagedRecord as exc:
        return None, exc.reason
    if data is None:
        return None, None
    next_seq, first_seq = _HEAD.unpack(data)
    if first_seq > next_seq:
        return None, f"first_seq {first_seq} is past next_seq {next_seq}"
    if next_seq > SEQ_LIMIT:
        return None, f"next_seq {next_seq} is beyond any seq a store hands out (2**62)"
    if next_seq - first_seq > MAX_SPAN:
        return None, f"it spans {next_seq - first_seq} records, the feed holds at most {MAX_SPAN}"
    return (next_seq, first_seq), None


def _head(txn: Txn) -> tuple[int, int] | None:
    """``(next_seq, first_seq)`` of a sound head, None if damaged or absent."""
    return _checked_head(txn)[0]


def _held(txn: Txn) -> tuple[list[int], list[bytes]]:
    """The seqs of the records the feed holds, ascending, and the names
    under ``feed/`` that are no seq (strays): one scan of the keys."""
    seqs: list[int] = []
    strays: list[bytes] = []
    for name, _ in txn.scan(INFO, FEED_PREFIX):
        seq = _seq_of(name)
        if seq is None:
            strays.append(bytes(name))
        else:
            seqs.append(seq)
    return seqs, strays


def _derived(seqs: list[int]) -> int:
    """The ``next_seq`` a head rebuilt from records at ``seqs`` has."""
    return seqs[-1] + 1 if seqs else 0


def _rebuilt(txn: Txn, keep: int, reason: str | None) -> tuple[int, int]:
    """A sound head from the records the feed holds (module docstring);
    the records it does not cover are deleted."""
    seqs, strays = _held(txn)
    next_seq = _derived(seqs)
    first_seq = max(seqs[0] if seqs else next_seq, next_seq - keep)
    dropped = strays + [_name(seq) for seq in seqs if seq < first_seq]
    for name in dropped:
        txn.delete(INFO, name)
    if reason is not None and not seqs:  # the sequence starts again at 0: seqs handed out before come again
        renew_identity(txn)
    if reason is not None or seqs or strays:  # not merely a store's first evented write
        logger.warning("ucm-db: change feed head %s; rebuilt from the %d records held (next seq %d, %d records dropped)",
                       f"damaged ({reason})" if reason else "missing", len(seqs), next_seq, len(dropped))
    return next_seq, first_seq


def _at_end(txn: Txn, seq: int) -> bool:
    """Whether ``seq`` is where a head rebuilt now would put ``next_seq``
    (or the end before a hole in the records): nothing new for a reader
    there. Two gets (a scan's first keys for ``seq`` 0)."""
    if seq > SEQ_LIMIT or (seq < SEQ_LIMIT and txn.get(INFO, _name(seq)) is not None):
        return False
    if seq > 0:
        return txn.get(INFO, _name(seq - 1)) is not None
    return not any(_seq_of(name) is not None for name, _ in txn.scan(INFO, FEED_PREFIX))


def _next_seq(txn: Txn) -> int:
    """The head's ``next_seq``, or a rebuilt head's where it is damaged."""
    head = _head(txn)
    return head[0] if head is not None else _derived(_held(txn)[0])


#: One record as read: (seq, kind, namespace id, key, depth, packed fields).
RawRecord = tuple[int, str, bytes, bytes, int, bytes]


def since(txn: Txn, seq: int, limit: int, namespaces: Container[bytes] | None, feed_id: str | None = None) -> ChangeBatch:
    """Records ``[seq, seq + limit)`` (those of ``namespaces`` only, if
    given); ``resync`` if ``seq`` was trimmed or is ahead of the feed, or
    ``feed_id`` is given and is not this feed's (seqs name other records here)."""
    raw, next_seq, resync, current = since_raw(txn, seq, limit, namespaces, feed_id)
    return ChangeBatch(tuple(decoded(raw)), next_seq, resync, current)


def since_raw(txn: Txn, seq: int, limit: int, namespaces: Container[bytes] | None,
              feed_id: str | None = None) -> tuple[list[RawRecord], int, bool, str]:
    """:func:`since` without decoding the fields: (records, next_seq, resync, feed id)."""
    current = identity(txn)
    if feed_id is not None and feed_id != current:
        return [], position(txn)[0], True, current
    head = _head(txn)
    if head is None:  # damaged or absent: no record is read until an append rebuilds it (module docstring)
        return [], seq, not _at_end(txn, seq), current
    next_seq, first_seq = head
    if seq < first_seq or seq > next_seq:
        return [], next_seq, True, current
    out: list[RawRecord] = []
    stop = min(next_seq, seq + max(0, limit))  # limit 0: no record, the feed id and position only
    for at in range(seq, stop):
        value = txn.get(INFO, _name(at))
        if value is None:
            continue  # cannot happen at a commit; tolerated
        ns = bytes(value[1:1 + _NS_BYTES])
        if namespaces is None or ns in namespaces:
            if len(value) < _KEY_END + _DEPTH.size or value[0] not in _KINDS:
                _skip(f"feed record {at}", f"{len(value)} bytes, kind {value[0] if len(value) else None}")
                continue
            depth = _DEPTH.unpack_from(value, _KEY_END)[0]
            out.append((at, _KINDS[value[0]], ns, bytes(value[1 + _NS_BYTES:_KEY_END]), depth, bytes(value[_KEY_END + _DEPTH.size:])))
    return out, stop, False, current


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
    next_seq = _next_seq(txn)
    skip, fields_at = len(FIELDS_PREFIX), _NS_BYTES + _DEPTH.size
    out: list[RawRecord] = []
    for name, value in txn.scan(INFO, FIELDS_PREFIX):
        ns = bytes(value[:_NS_BYTES])
        if len(value) < fields_at:
            _skip(f"fields of block {bytes(name[skip:]).hex()[:16]}", f"{len(value)} bytes")
            continue
        if namespaces is None or ns in namespaces:
            key = bytes(name[skip:])
            if txn.get("meta", key) is None:  # issue 46: never a phantom BlockStored
                _skip(f"fields of block {key.hex()[:16]}", "the block is not stored")
                continue
            out.append((next_seq, "stored", ns, key, _DEPTH.unpack_from(value, _NS_BYTES)[0], bytes(value[fields_at:])))
    out.sort(key=lambda r: r[4])
    return out, next_seq


def position(txn: Txn) -> tuple[int, int]:
    """``(next_seq, first_seq)`` of the feed (of the head an append would
    rebuild, where it is damaged)."""
    head = _head(txn)
    if head is not None:
        return head
    seqs, _ = _held(txn)
    return _derived(seqs), seqs[0] if seqs else 0


# -- verify and verify --fix ---------------------------------------------------
def head_problem(txn: Txn) -> str | None:
    """Why the head is damaged; None if it is sound or absent."""
    return _checked_head(txn)[1]
