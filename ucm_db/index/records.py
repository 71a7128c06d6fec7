"""Checksummed ``info`` records: counters and namespace descriptions that
a flipped bit cannot silently turn into wrong accounting.

Each checked record ``info/<name>`` has a sidecar ``info/sum:<name>``
holding the xxh3-64 of ``name || value`` (8 bytes, little-endian), written in
the same transaction as the record.

Invariants:
    * A record whose sidecar disagrees with it, or whose value has the wrong
      shape, is *damaged*: readers never use its value. Derivable records
      (totals, per-namespace counters) are recomputed from the block
      metadata; a damaged description reads as ``{"damaged": ...}``.
    * A record without a sidecar was written before checksums existed
      (store format 3 code) and is trusted as it is; the store seals such
      records when it opens (:func:`seal`), so from then on they are checked.
    * The sidecars sit beside the records instead of inside them, so code
      that reads the records themselves (older ucm-db, migrations, archive
      copies) sees the same bytes as before.
"""

from __future__ import annotations

from collections.abc import Iterator

import xxhash

from ucm_db.engines.base import Buffer, Txn

INFO = "info"
SUM_PREFIX = b"sum:"
SUM_BYTES = 8


class DamagedRecord(Exception):
    """An info record failed its checksum or shape check (internal: the
    local tier turns it into a recomputation or a report)."""

    def __init__(self, name: bytes, reason: str) -> None:
        self.name = name
        self.reason = reason
        super().__init__(f"info record {name.decode(errors='replace')!r} is damaged: {reason}")


def record_sum(name: bytes, value: Buffer) -> bytes:
    hasher = xxhash.xxh3_64(name)
    hasher.update(value)
    return hasher.intdigest().to_bytes(SUM_BYTES, "little")


def put_checked(txn: Txn, name: bytes, value: bytes) -> None:
    """Writes ``info/<name>`` and its checksum sidecar."""
    txn.put(INFO, name, value)
    txn.put(INFO, SUM_PREFIX + name, record_sum(name, value))


def delete_checked(txn: Txn, name: bytes) -> None:
    txn.delete(INFO, name)
    txn.delete(INFO, SUM_PREFIX + name)


def get_checked(txn: Txn, name: bytes, *, size: int | None = None) -> Buffer | None:
    """``info/<name>``, or None if absent.

    Raises:
        DamagedRecord: the sidecar disagrees, or ``size`` is given and the
            value has another length.
    """
    value = txn.get(INFO, name)
    if value is None:
        return None
    check(txn, name, value, size=size)
    return value


def check(txn: Txn, name: bytes, value: Buffer, *, size: int | None = None) -> None:
    """Raises :class:`DamagedRecord` unless ``value`` is a whole, unaltered
    ``info/<name>``."""
    if size is not None and len(value) != size:
        raise DamagedRecord(name, f"{len(value)} bytes, expected {size}")
    stored_sum = txn.get(INFO, SUM_PREFIX + name)
    if stored_sum is not None and bytes(stored_sum) != record_sum(name, value):
        raise DamagedRecord(name, "checksum mismatch")


def scan_checked(txn: Txn, prefix: bytes, *, size: int | None = None) -> Iterator[tuple[bytes, Buffer | None]]:
    """``(name, value)`` of every record under ``prefix``; ``value`` is None
    for a damaged record."""
    for name, value in txn.scan(INFO, prefix):
        name = bytes(name)
        try:
            check(txn, name, value, size=size)
        except DamagedRecord:
            yield name, None
        else:
            yield name, value


def seal(txn: Txn, prefixes: tuple[bytes, ...]) -> int:
    """Writes the missing sidecars of records under ``prefixes`` (records of
    format-3 code); returns how many were sealed."""
    sealed = 0
    for prefix in prefixes:
        for name, value in list(txn.scan(INFO, prefix)):
            name = bytes(name)
            if txn.get(INFO, SUM_PREFIX + name) is None:
                txn.put(INFO, SUM_PREFIX + name, record_sum(name, value))
                sealed += 1
    return sealed
