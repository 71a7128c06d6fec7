"""Store-wide and per-namespace counters, kept exact inside every write
transaction.

Invariants:
    * At every commit ``info/totals`` and each ``info/nscount:<ns>`` equal
      the sums over the ``meta`` records (:func:`recount` computes them).
      A transaction writes a counter record only where its value changed
      (or was recounted): a put of blocks all stored already dirties no
      page, so its commit writes nothing.
    * The records are checksummed (:mod:`ucm_db.index.records`); a damaged
      one is recounted from the metadata inside the transaction that finds
      it, so one flipped bit never wedges later puts.
    * Each ``info/pincount:<ns>`` (pinned blocks and their stored bytes)
      equals the sums over the namespace's ``info/pin/`` records at every
      commit (:func:`recount_pins`), changed by the same transactions that
      pin, unpin or remove blocks (:mod:`ucm_db.index.pins`); a damaged one is
      recounted from the pin records.
    * Counter records written before checksums existed are never sealed as
      they are: :func:`seal_records` recounts them from the metadata first
      (a garbage pre-checksum total would otherwise be sealed as truth and
      make every put a ``StoreFullError``).
"""

from __future__ import annotations

import json
import logging
import struct
from dataclasses import dataclass
from typing import Any

from ucm_db.index import records
from ucm_db.engines.base import Buffer, Txn
from ucm_db.index.entries import PIN_PREFIX, BlockMeta, DamagedMeta, DamagedPin, PinRecord

logger = logging.getLogger("ucm_db")
TOTALS = struct.Struct("<7Q")
NS_COUNTS = struct.Struct("<4Q")
TOTALS_KEY = b"totals"
NS_COUNTS_PREFIX = b"nscount:"
NS_DESC_PREFIX = b"nsdesc:"
#: Per-namespace pinned blocks and stored bytes (:mod:`ucm_db.index.pins`).
PIN_COUNTS = struct.Struct("<2Q")
PIN_COUNTS_PREFIX = b"pincount:"


@dataclass(slots=True)
class Totals:
    """Store-wide counters (persisted in ``info/totals``)."""

    blocks: int = 0
    raw_bytes: int = 0
    stored_bytes: int = 0
    evictions: int = 0
    quarantined: int = 0
    hits: int = 0
    misses: int = 0

    @classmethod
    def read(cls, txn: Txn) -> Totals:
        """The recorded totals.

        Raises:
            DamagedRecord: the record fails its checksum or shape check.
        """
        data = records.get_checked(txn, TOTALS_KEY, size=TOTALS.size)
        return cls(*TOTALS.unpack(data)) if data is not None else cls()

    @classmethod
    def read_or_recompute(cls, txn: Txn) -> Totals:
        """The recorded totals, or (damaged record) the block counts
        recomputed from the metadata, with the event counters zeroed."""
        try:
            return cls.read(txn)
        except records.DamagedRecord as exc:
            logger.warning("ucm-db: %s; using totals recomputed from the block metadata", exc)
            return recount(txn)[0]

    def packed(self) -> bytes:
        return TOTALS.pack(self.blocks, self.raw_bytes, self.stored_bytes, self.evictions, self.quarantined, self.hits, self.misses)

    def write(self, txn: Txn) -> None:
        records.put_checked(txn, TOTALS_KEY, self.packed())


class Changes:
    """Counter deltas accumulated inside one write transaction."""

    def __init__(self, txn: Txn) -> None:
        self.txn = txn
        self.ns_counts: dict[bytes, list[int]] = {}
        #: Pinned (blocks, stored bytes) per namespace, read when first changed.
        self.pin_counts: dict[bytes, list[int]] = {}
        self._recounts = 0
        #: The counter records as read, which :meth:`commit` need not write
        #: again unchanged (a put of blocks all stored already writes nothing).
        self._read: dict[bytes, bytes] = {}
        try:
            data = records.get_checked(txn, TOTALS_KEY, size=TOTALS.size)
        except records.DamagedRecord as exc:
            self.recount(exc)
        else:
            self.totals = Totals(*TOTALS.unpack(data)) if data is not None else Totals()
            if data is not None:
                self._read[TOTALS_KEY] = bytes(data)

    def recount(self, cause: records.DamagedRecord) -> None:
        """Replaces every counter by a recount from the metadata (a damaged
        counter record must not wedge later puts); the commit rewrites them
        all. Deltas added before are already in the metadata."""
        logger.warning("ucm-db: %s; recomputing the counters from the block metadata", cause)
        self._recounts += 1
        totals, per_namespace = recount(self.txn)
        previous = getattr(self, "totals", None)
        if previous is not None:  # keep the event counters this transaction has seen
            totals.evictions, totals.quarantined = previous.evictions, previous.quarantined
            totals.hits, totals.misses = previous.hits, previous.misses
        self.totals = totals
        for name, _ in list(self.txn.scan("info", NS_COUNTS_PREFIX)):
            per_namespace.setdefault(bytes(name)[len(NS_COUNTS_PREFIX):], [0, 0, 0, 0])
        self.ns_counts = per_namespace

    def ns(self, namespace_id: bytes) -> list[int]:
        counts = self.ns_counts.get(namespace_id)
        if counts is None:
            try:
                data = records.get_checked(self.txn, NS_COUNTS_PREFIX + namespace_id, size=NS_COUNTS.size)
            except records.DamagedRecord as exc:
                self.recount(exc)
                return self.ns(namespace_id)
            counts = list(NS_COUNTS.unpack(data)) if data is not None else [0, 0, 0, 0]
            if data is not None:
                self._read[NS_COUNTS_PREFIX + namespace_id] = bytes(data)
            self.ns_counts[namespace_id] = counts
        return counts

    def pins(self, namespace_id: bytes) -> list[int]:
        """The namespace's pinned [blocks, stored bytes] as this transaction
        has them (a damaged record: every pin counter recounted)."""
        counts = self.pin_counts.get(namespace_id)
        if counts is None:
            try:
                data = records.get_checked(self.txn, PIN_COUNTS_PREFIX + namespace_id, size=PIN_COUNTS.size)
            except records.DamagedRecord as exc:
                logger.warning("ucm-db: %s; recomputing the pinned counters from the pin records", exc)
                self.pin_counts = recount_pins(self.txn)
                for name, _ in list(self.txn.scan("info", PIN_COUNTS_PREFIX)):  # rewritten, or deleted when 0
                    self.pin_counts.setdefault(bytes(name)[len(PIN_COUNTS_PREFIX):], [0, 0])
                return self.pin_counts.setdefault(namespace_id, [0, 0])
            counts = list(PIN_COUNTS.unpack(data)) if data is not None else [0, 0]
            self.pin_counts[namespace_id] = counts
        return counts

    def add_pinned(self, record: PinRecord, sign: int) -> None:
        """Counts a block that became pinned (+1) or stopped being (-1)."""
        counts = self.pins(record.namespace_id)
        counts[0] += sign
        counts[1] += sign * record.stored_bytes

    def add(self, meta: BlockMeta, sign: int) -> None:
        """Counts a block just written (+1) or deleted (-1) in ``meta``."""
        recounts = self._recounts
        counts = self.ns(meta.namespace_id)
        if self._recounts != recounts:
            return  # ns() just recounted from the metadata, which holds this change already
        self.totals.blocks += sign
        self.totals.raw_bytes += sign * meta.raw_bytes
        self.totals.stored_bytes += sign * meta.stored_bytes
        counts[0] += sign
        counts[1] += sign * meta.raw_bytes
        counts[2] += sign * meta.stored_bytes
        if sign > 0:
            counts[3] = max(counts[3], meta.access_ns)

    def commit(self) -> None:
        """Writes the counters. A counter driven below zero (a block removed
        whose record was altered after it was counted, e.g. its namespace id)
        is recounted from the metadata instead of written."""
        totals = self.totals
        if min(totals.blocks, totals.raw_bytes, totals.stored_bytes, *(min(c) for c in self.ns_counts.values())) < 0:
            self.recount(records.DamagedRecord(TOTALS_KEY, "a counter went below zero"))
        if self._recounts:
            self._read.clear()  # recounted: every counter is written
        self._put(TOTALS_KEY, self.totals.packed())
        for namespace_id, counts in self.ns_counts.items():
            self._put(NS_COUNTS_PREFIX + namespace_id, NS_COUNTS.pack(*counts))
        if self.pin_counts:
            write_pin_counts(self.txn, self.pin_counts)

    def _put(self, name: bytes, value: bytes) -> None:
        """Writes a counter record (with its checksum) unless it was read
        whole in this transaction with this very value."""
        if self._read.get(name) != value:
            records.put_checked(self.txn, name, value)


def write_pin_counts(txn: Txn, pin_counts: dict[bytes, list[int]]) -> None:
    """Writes pinned counters (a namespace at zero loses its record); a
    counter driven below zero is recounted from the pin records instead."""
    if any(min(c) < 0 for c in pin_counts.values()):
        logger.warning("ucm-db: a pinned counter went below zero; recounting them from the pin records")
        recounted = recount_pins(txn)
        for namespace_id in pin_counts:
            pin_counts[namespace_id] = recounted.get(namespace_id, [0, 0])
        pin_counts.update(recounted)
    for namespace_id, counts in pin_counts.items():
        if counts[0] or counts[1]:
            records.put_checked(txn, PIN_COUNTS_PREFIX + namespace_id, PIN_COUNTS.pack(*counts))
        else:
            records.delete_checked(txn, PIN_COUNTS_PREFIX + namespace_id)


def recount_pins(txn: Txn) -> dict[bytes, list[int]]:
    """Pinned [blocks, stored bytes] per namespace summed over the pin
    records (a damaged record is left out: verify names it)."""
    out: dict[bytes, list[int]] = {}
    for _name, value in txn.scan("info", PIN_PREFIX):
        try:
            record = PinRecord.unpack(value)
        except DamagedPin:
            continue
        counts = out.setdefault(record.namespace_id, [0, 0])
        counts[0] += 1
        counts[1] += record.stored_bytes
    return out


def recount(txn: Txn) -> tuple[Totals, dict[bytes, list[int]]]:
    """Totals and per-namespace counters recomputed from ``meta`` (event
    counters zero): what the records must say at every commit. A damaged
    record (wrong length, impossible sizes) is left out: its sizes are
    never summed (verify names it, a repair quarantines it)."""
    totals = Totals()
    per_namespace: dict[bytes, list[int]] = {}
    for _key, data in txn.scan("meta"):
        try:
            meta = BlockMeta.unpack(data)
        except DamagedMeta:
            continue
        totals.blocks += 1
        totals.raw_bytes += meta.raw_bytes
        totals.stored_bytes += meta.stored_bytes
        counts = per_namespace.setdefault(meta.namespace_id, [0, 0, 0, 0])
        counts[0] += 1
        counts[1] += meta.raw_bytes
        counts[2] += meta.stored_bytes
        counts[3] = max(counts[3], meta.access_ns)
    return totals, per_namespace


#: This module's records sealed at a writable open when older code wrote them
#: without a checksum (the store-format records are sealed by ucm_db.format).
SEALED_RECORDS = (TOTALS_KEY, NS_COUNTS_PREFIX, NS_DESC_PREFIX)


def seal_records(txn: Txn) -> int:
    """Adds checksums to the records older code wrote bare; counter records
    among them are recounted from the metadata before they are sealed
    (module invariants). Returns how many records were sealed."""
    unsealed_counters = [name for name, _ in _unsealed(txn, (TOTALS_KEY, NS_COUNTS_PREFIX))]
    if unsealed_counters:
        logger.info("ucm-db: recounting %d counter records of older code before sealing them", len(unsealed_counters))
        _rewrite_counters(txn)
    return records.seal(txn, SEALED_RECORDS)


def _unsealed(txn: Txn, prefixes: tuple[bytes, ...]) -> list[tuple[bytes, Buffer]]:
    return [(bytes(name), value) for prefix in prefixes for name, value in txn.scan("info", prefix)
            if txn.get("info", records.SUM_PREFIX + bytes(name)) is None]


def _rewrite_counters(txn: Txn) -> None:
    """Every counter record rewritten (checksummed) from a recount; the
    totals' event counters are kept where the old record has the right
    shape and its block counts agreed with the recount (else zeroed: a
    record that is wrong about the blocks is trusted for nothing)."""
    totals, per_namespace = recount(txn)
    old = txn.get("info", TOTALS_KEY)
    if old is not None and len(old) == TOTALS.size:
        blocks, raw, stored, *events = TOTALS.unpack(bytes(old))
        if (blocks, raw, stored) == (totals.blocks, totals.raw_bytes, totals.stored_bytes):
            totals.evictions, totals.quarantined, totals.hits, totals.misses = events
    totals.write(txn)
    for name, _ in list(txn.scan("info", NS_COUNTS_PREFIX)):
        per_namespace.setdefault(bytes(name)[len(NS_COUNTS_PREFIX):], [0, 0, 0, 0])
    for namespace_id, counts in per_namespace.items():
        records.put_checked(txn, NS_COUNTS_PREFIX + namespace_id, NS_COUNTS.pack(*counts))


def parse_description(value: Buffer | None) -> dict[str, Any]:
    if value is None:
        return {"damaged": "checksum mismatch"}
    try:
        description = json.loads(bytes(value))
    except (ValueError, UnicodeDecodeError):
        return {"damaged": "not JSON"}
    return description if isinstance(description, dict) else {"damaged": "not a JSON object"}


def damaged_records(txn: Txn) -> list[tuple[str, str]]:
    """(record name, reason) of every damaged counter or namespace record
    (the store-format records, version, settings and creation, are
    :func:`ucm_db.format.damaged_format_records`'s)."""
    found: list[tuple[str, str]] = []
    try:
        Totals.read(txn)
    except records.DamagedRecord as exc:
        found.append((TOTALS_KEY.decode(), exc.reason))
    for prefix, size in ((NS_COUNTS_PREFIX, NS_COUNTS.size), (NS_DESC_PREFIX, None), (PIN_COUNTS_PREFIX, PIN_COUNTS.size)):
        for name, value in records.scan_checked(txn, prefix, size=size):
            reason = "checksum mismatch or wrong size" if value is None else None
            if reason is None and prefix == NS_DESC_PREFIX:
                reason = parse_description(value).get("damaged")
            if reason:
                found.append((name.decode(errors="replace"), reason))
    return found
