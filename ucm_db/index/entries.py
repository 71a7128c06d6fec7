"""The value types of the local block index: per-block metadata, entries
to put, put results, buffered reader activity, LRU index keys, and the
limits the index's parts share (:class:`TierLimits`).

Invariants:
    * :class:`BlockMeta` packs to a fixed 88-byte record; its first 16 bytes
      are the namespace id (readers check a block's namespace from them).
    * :meth:`BlockMeta.unpack` never returns a record of another length or
      with sizes no block can have (raw bytes over the codec's limit, stored
      bytes over that plus the largest head and frame overhead): it raises
      :class:`DamagedMeta`, so damaged sizes are never summed into totals
      nor fed to eviction (see :mod:`ucm_db.index.damage`).
    * :func:`lru_key` orders by access time, then deeper blocks first, so
      equal-time chain tails sort before their ancestors.
    * :class:`PinRecord` packs to a fixed 29-byte record (``info/pin/<key>``,
      :mod:`ucm_db.index.pins`); :meth:`PinRecord.unpack` refuses any other
      length with :class:`DamagedPin`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from ucm_db import codec
from ucm_db.engines.base import Buffer
from ucm_db.events import FEED_MAX_RECORDS

NO_PARENT = bytes(32)
META = struct.Struct("<16s32sIQQQQI")
LRU_PREFIX = struct.Struct(">QI")
MAX_DEPTH = 0xFFFFFFFF
#: Largest stored size (head + body) any block can have: the codec's raw
#: limit, plus its largest head, plus a frame's worth of slack per frame.
MAX_STORED_BYTES = codec.MAX_RAW_BYTES + 2 * (codec.HEADER_BYTES + codec.MAX_FRAMES * 32)
#: ``info`` name prefix of a pinned block's record; the 32-byte key follows.
PIN_PREFIX = b"pin/"
PIN = struct.Struct("<16sQIB")


class DamagedMeta(ValueError):
    """A ``meta`` record that is not a whole, plausible :class:`BlockMeta`.

    Attributes:
        reason: what is wrong, in words.
        fields: the record's fields where its length is right (the sizes are
            then the implausible ones), else None.
    """

    def __init__(self, reason: str, fields: BlockMeta | None) -> None:
        super().__init__(f"block metadata record damaged: {reason}")
        self.reason = reason
        self.fields = fields


@dataclass(slots=True)
class BlockMeta:
    """Per-block metadata kept beside the payload."""

    namespace_id: bytes
    parent: bytes | None
    depth: int
    raw_bytes: int
    stored_bytes: int
    created_ns: int
    access_ns: int
    hits: int

    def pack(self) -> bytes:
        return META.pack(
            self.namespace_id, self.parent or NO_PARENT, self.depth, self.raw_bytes,
            self.stored_bytes, self.created_ns, self.access_ns, self.hits,
        )

    @classmethod
    def unpack(cls, data: Buffer) -> BlockMeta:
        """The record's fields.

        Raises:
            DamagedMeta: the record has the wrong length, or sizes no block
                can have.
        """
        if len(data) != META.size:
            raise DamagedMeta(f"{len(data)} bytes, expected {META.size}", None)
        ns, parent, depth, raw, stored, created, access, hits = META.unpack(data)
        meta = cls(ns, None if parent == NO_PARENT else parent, depth, raw, stored, created, access, hits)
        if not _possible_sizes(raw, stored):
            raise DamagedMeta(f"impossible sizes: {raw} raw bytes, {stored} stored bytes", meta)
        return meta


def _possible_sizes(raw_bytes: int, stored_bytes: int) -> bool:
    """Whether some block can have these sizes: the one rule behind
    :meth:`BlockMeta.unpack`, :func:`plausible_meta` and :func:`refiled_record`."""
    return raw_bytes <= codec.MAX_RAW_BYTES and stored_bytes <= MAX_STORED_BYTES


#: A ``meta`` record's raw and stored sizes (what :func:`plausible_meta` checks).
_SIZES = struct.Struct("<52xQQ20x")


def plausible_meta(data: Buffer) -> bool:
    """Whether :meth:`BlockMeta.unpack` takes this record: a record's
    length and sizes some block can have (its checks, without making a
    :class:`BlockMeta`: a read asks it of every block it offers)."""
    if len(data) != META.size:
        return False
    return _possible_sizes(*_SIZES.unpack(data))


#: What refiling a block reads of its ``meta`` record (:func:`refiled_record`):
#: depth, raw and stored bytes, access time.
_REFILE_FIELDS = struct.Struct("<48xIQQ8xQ4x")
_ACCESS = struct.Struct("<Q")
_ACCESS_OFFSET = 76


def refiled_record(data: Buffer, access_ns: int) -> tuple[bytes, int, int, bytes] | None:
    """A whole ``meta`` record filed again as used at ``access_ns`` (its own
    access time where that is newer): ``(namespace id, depth, access time,
    record)``, the record byte for byte what :meth:`BlockMeta.pack` gives
    after that change; None where :meth:`BlockMeta.unpack` would refuse it
    (damaged). No :class:`BlockMeta` is made (eviction refiles a few a victim)."""
    if len(data) != META.size:
        return None
    depth, raw, stored, access = _REFILE_FIELDS.unpack(data)
    if not _possible_sizes(raw, stored):
        return None
    record = bytes(data)
    if access < access_ns:
        access = access_ns
        record = record[:_ACCESS_OFFSET] + _ACCESS.pack(access) + record[_ACCESS_OFFSET + 8:]
    return record[:16], depth, access, record


def meta_and_parent(data: Buffer | None) -> tuple[BlockMeta | None, bytes | None]:
    """A ``meta`` record's fields (None where absent or damaged) and the
    parent it names (a damaged record's too where its length is right: its
    sizes are what is wrong)."""
    if data is None:
        return None, None
    try:
        meta = BlockMeta.unpack(data)
    except DamagedMeta as exc:
        return None, exc.fields.parent if exc.fields is not None else None
    return meta, meta.parent


class DamagedPin(ValueError):
    """An ``info/pin/<key>`` record that is not a whole :class:`PinRecord`."""


@dataclass(slots=True)
class PinRecord:
    """What the index keeps of a pinned block (:mod:`ucm_db.index.pins`):
    its namespace and stored size (the pinned-bytes counters are sums of
    these), how many pins lie at or below it (``below``: a block is
    pinned while it is above 0), and whether a pin was made at it
    (``own``)."""

    namespace_id: bytes
    stored_bytes: int
    below: int
    own: bool

    def pack(self) -> bytes:
        return PIN.pack(self.namespace_id, self.stored_bytes, self.below, int(self.own))

    @classmethod
    def unpack(cls, data: Buffer) -> PinRecord:
        """The record's fields.

        Raises:
            DamagedPin: the record has the wrong length or an impossible size.
        """
        if len(data) != PIN.size:
            raise DamagedPin(f"pin record of {len(data)} bytes, expected {PIN.size}")
        ns, stored, below, own = PIN.unpack(data)
        if stored > MAX_STORED_BYTES or own > 1 or below < own:
            raise DamagedPin(f"impossible pin record: {stored} bytes, {below} pins at or below, own {own}")
        return cls(ns, stored, below, bool(own))


@dataclass(frozen=True, slots=True)
class BlockEntry:
    """One block to put: key, parent (None for a chain root), head and body;
    ``event_fields``: packed :class:`~ucm_db.events.BlockEventFields` of an
    evented block (None: left out of events)."""

    key: bytes
    parent: bytes | None
    head: Buffer
    body: Buffer
    raw_bytes: int
    namespace_id: bytes
    event_fields: bytes | None = None

    @classmethod
    def of_blob(cls, key: bytes, parent: bytes | None, blob: Buffer, raw_bytes: int, namespace_id: bytes) -> BlockEntry:
        """An entry from a joined blob, split without copying.

        Raises:
            CorruptBlockError: the blob's header is unreadable.
        """
        head, body = codec.split(blob)
        return cls(key, parent, head, body, raw_bytes, namespace_id)

    @property
    def stored_bytes(self) -> int:
        return len(self.head) + len(self.body)


@dataclass(slots=True)
class TierLimits:
    """The local tier's limits, one object its parts share and read at each
    use (so a store that changes them after opening changes them for every
    part at once).

    Attributes:
        capacity_bytes: stored bytes a put evicts down to.
        feed_max_records: change feed records kept (:mod:`ucm_db.index.changefeed`).
    """

    capacity_bytes: int
    feed_max_records: int = FEED_MAX_RECORDS


@dataclass(slots=True)
class PutResult:
    """What a put did: blocks it stored, found stored already, and evicted.

    ``stored_keys`` names exactly the blocks this put's transaction wrote,
    in the order given; a block found stored already (whoever wrote it) is
    not among them. So deleting them (with their descendants) removes what
    this put added and nothing stored before it."""

    stored: int = 0
    already_present: int = 0
    evicted: int = 0
    stored_keys: list[bytes] = field(default_factory=list)


@dataclass(slots=True)
class PendingActivity:
    """Reader activity not yet in the index (touches, hits, misses).

    ``touched`` maps a key to its newest touch; writing it counts one hit
    on the block, plus ``earlier_rounds`` of the key: the maintenance rounds
    that kept its touch back (``ucm_db.store.background``), each one hit
    as if it had been written then."""

    touched: dict[bytes, int] = field(default_factory=dict)
    hits: int = 0
    misses: int = 0
    earlier_rounds: dict[bytes, int] = field(default_factory=dict)

    def add(self, key: bytes, access_ns: int, earlier_rounds: int = 0) -> None:
        """Adds one key's pending touch: a key pending already keeps its
        newest touch and the hits of both (each side's own one and its
        earlier rounds)."""
        mine = self.touched.get(key)
        if mine is not None:
            earlier_rounds += self.earlier_rounds.get(key, 0) + 1
            access_ns = max(access_ns, mine)
        self.touched[key] = access_ns
        if earlier_rounds:
            self.earlier_rounds[key] = earlier_rounds

    def merge(self, other: PendingActivity) -> None:
        """Adds ``other`` to this one (:meth:`add` for each of its keys)."""
        rounds = other.earlier_rounds
        for key, access_ns in other.touched.items():
            self.add(key, access_ns, rounds.get(key, 0))
        self.hits += other.hits
        self.misses += other.misses

    def empty(self) -> bool:
        return not self.touched and not self.hits and not self.misses


def lru_key(access_ns: int, depth: int, key: bytes) -> bytes:
    return LRU_PREFIX.pack(access_ns, MAX_DEPTH - depth) + key


def body_of(head: memoryview, stored: memoryview) -> memoryview:
    """The body within a ``blocks`` value: the value itself, or (a block
    written before format 3) what follows the head in it."""
    n = len(head)
    if n and len(stored) > n and stored[:n] == head:
        return stored[n:]
    return stored
