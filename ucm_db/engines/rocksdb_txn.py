"""The RocksDB engine's transactions: an overlay of pending changes over
the committed column families, and the point a read transaction reads at
(see :mod:`ucm_db.engines.rocksdb` for the engine's invariants); how the
engine reads and compacts around a damaged blob (the last two invariants).

Invariants:
    * A write transaction reads its own writes (``get`` and sorted merged
      ``scan``) over the committed tables; nothing reaches the database
      before :meth:`RocksTxn.batch` is written as one ``WriteBatch``.
    * A read transaction reads one :class:`ReadPoint`: every table as of
      the commit before it began, whatever commits meanwhile; it refuses
      ``put``/``delete``. Its gets read snapshots taken when it began. Its
      scans read iterators (a RocksDB iterator is a point-in-time view):
      made when the scan starts while nothing has committed since the read
      began, else made for every table by the first commit that followed
      (:meth:`ReadPoint.freeze`, before its batch is written). rocksdict's
      ``Snapshot.iter()`` would be simpler, but (0.3.29) it drops the
      snapshot and iterates the live table.
    * Scans of one table in one read transaction share its frozen iterator;
      a scan whose iterator another scan moved seeks back to its last key.
    * A damaged payload is a damaged value, never a failed read: the
      ``blocks`` table (:data:`UNCHECKED`) is read without RocksDB's own
      checksums (every payload read is verified against its head's xxh3, so
      a flipped byte in a blob file is a miss and a quarantine, as on LMDB;
      with RocksDB's check it failed every read of the block, and every
      ``verify --fix``, for good), and a get that still fails on a blob (its
      record or file unreadable) reads as an empty value, which the index
      takes as damaged. A scan whose iterator fails (a blob file or table
      file unreadable) raises: RocksDB ends an iterator at its first error,
      and a scan that ended there read as a table shorter than it is.
    * RocksDB's blob garbage collection checks the blobs it moves, so a
      damaged payload still stored fails a compaction that moves it (and
      RocksDB then refuses writes until reopened). In the background that
      failed a third to a half of all puts (each after a second's wait for
      the reopen) until the block was read or quarantined: after one such
      failure (:func:`blob_collection_failed`) the engine reopens with the
      collection off for the rest of its life (blob files then go only when
      all their blobs are garbage, or at ``compact``). :func:`compact_tables`
      merges every table first without moving blobs (so the blob of a block
      deleted, a quarantine, is never read again), then checks the blobs
      still stored, and moves them only when none is damaged.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import rocksdict

from ucm_db.errors import TierError
from ucm_db.engines.base import Buffer

logger = logging.getLogger("ucm_db")
_DELETED = object()
#: What rocksdict's ``Snapshot[key]`` raises for a key it does not hold (a plain Exception).
_SNAPSHOT_MISS = "key not found"
#: Tables read without RocksDB's checksums (module invariants): their values carry ucm-db's own.
UNCHECKED = ("blocks",)


def _read_options(table: str) -> rocksdict.ReadOptions | None:
    """The read options of ``table``'s gets, snapshots and iterators (None: RocksDB's defaults)."""
    if table not in UNCHECKED:
        return None
    options = rocksdict.ReadOptions()
    options.set_verify_checksums(False)
    return options


def family_of(db: rocksdict.Rdict, table: str, *, collect_blobs: bool = True) -> rocksdict.Rdict:
    """``db``'s view of ``table``, reading with the table's read options
    (its gets and the snapshots taken of it: module invariants); without
    ``collect_blobs``, the ``blocks`` table's blob garbage collection off."""
    family = db.get_column_family(table)
    options = _read_options(table)
    if options is not None:
        family.set_read_options(options)
    if table == "blocks" and not collect_blobs:
        logger.warning("ucm-db: RocksDB's blob garbage collection met a damaged payload: it stays off while this "
                       "process keeps the store open (%s)", DAMAGED_BLOB_HINT)
        family.set_options(_GC_OFF)
    return family


#: What a write failed by RocksDB's blob collection meeting a damaged payload needs (module invariants).
DAMAGED_BLOB_HINT = "reading the damaged block, or `ucm-db verify --fix` on the store, quarantines it"


def blob_collection_failed(exc: BaseException) -> bool:
    """Whether a write or sync failed on a background error of RocksDB's blob
    garbage collection meeting a damaged blob (module invariants)."""
    text = str(exc).lower()
    return "corruption" in text and "blob" in text


def _iterator(family: rocksdict.Rdict, table: str) -> Any:
    options = _read_options(table)
    return family.iter() if options is None else family.iter(options)


#: The ``blocks`` table's blob garbage collection: off; every blob file; RocksDB's usual (the oldest quarter).
_GC_OFF = {"enable_blob_garbage_collection": "false"}
_GC_ALL = {"enable_blob_garbage_collection": "true", "blob_garbage_collection_age_cutoff": "1.0",
           "blob_garbage_collection_force_threshold": "0.0"}
_GC_USUAL = {"enable_blob_garbage_collection": "true", "blob_garbage_collection_age_cutoff": "0.25",
             "blob_garbage_collection_force_threshold": "1.0"}


def compact_tables(db: rocksdict.Rdict, families: Mapping[str, rocksdict.Rdict], path: Path, *,
                   collect_blobs: bool = True) -> None:
    """Compacts every table, then again rewriting every blob file, so the
    space of deleted entries and payloads goes back to the file system
    (module invariants), then leaves the blob collection on or off as
    ``collect_blobs`` says. Between the two, every blob still stored is read
    with its checksum: a damaged one stops the compaction before RocksDB's
    would fail on it (and refuse writes until reopened).

    Raises:
        TierError: a damaged payload (``ucm-db verify --fix`` quarantines
            it), a blob file unreadable, or a compaction that failed.
    """
    options = rocksdict.CompactOptions()
    options.set_bottommost_level_compaction(rocksdict.BottommostLevelCompaction.force())
    blocks, errors = families["blocks"], db.property_int_value("rocksdb.background-errors")
    try:
        blocks.set_options(_GC_OFF)
        for family in families.values():
            family.compact_range(None, None, options)
        damaged = _damaged_blobs(blocks)
        if damaged:
            raise TierError(f"RocksDB store at {path} holds {len(damaged)} damaged payloads (block {damaged[0].hex()[:16]}"
                            f"{' ...' if len(damaged) > 1 else ''}): its blob files were not rewritten",
                            hint="run `ucm-db verify --fix` on the store (it quarantines them), then compact again")
        blocks.set_options(_GC_ALL)
        for family in families.values():
            family.compact_range(None, None, options)
        if db.property_int_value("rocksdb.background-errors") != errors:
            raise TierError(f"compacting RocksDB store at {path} failed (its LOG file says why)",
                            hint="free space on that disk, then compact again")
    except TierError:
        raise
    except Exception as exc:  # noqa: BLE001 - rocksdict raises plain Exceptions
        raise TierError(f"compacting RocksDB store at {path} failed: {exc}", hint="free space on that disk") from exc
    finally:
        blocks.set_options(_GC_USUAL if collect_blobs else _GC_OFF)


def _damaged_blobs(blocks: rocksdict.Rdict) -> list[bytes]:
    """Keys of the ``blocks`` table whose value RocksDB's checksum refuses,
    in one pass: a checked iterator stops at each, an unchecked one names
    it, and the checked one goes on after it.

    Raises:
        TierError: a blob file that cannot be read at all.
    """
    checked, unchecked = blocks.iter(rocksdict.ReadOptions()), _iterator(blocks, "blocks")
    damaged: list[bytes] = []
    last: bytes | None = None  # the last key stepped onto
    checked.seek_to_first()
    while True:
        while checked.valid():  # RocksDB reads (and checks) a blob value as it steps onto it
            last = checked.key()
            checked.next()
        try:
            checked.status()
            return damaged
        except Exception as exc:  # noqa: BLE001 - rocksdict raises plain Exceptions
            if not _damaged_blob(exc, "blocks"):
                raise
        unchecked.seek_to_first() if last is None else unchecked.seek(last + b"\0")  # the next key: the damaged one
        if not unchecked.valid():
            unchecked.status()
            raise TierError("a checked read of a RocksDB blob failed where an unchecked one found no value")
        last = unchecked.key()
        damaged.append(last)
        checked.seek(last + b"\0")


def _damaged_blob(exc: Exception, table: str) -> bool:
    """Whether a get of ``table`` failed on its blob (the key's entry was
    read; its value cannot be): rocksdict raises plain Exceptions."""
    return type(exc) is Exception and table in UNCHECKED and "blob" in str(exc).lower()


class _Cursor:
    """A frozen iterator of one table, and the scan that moved it last."""

    __slots__ = ("iterator", "owner")

    def __init__(self, iterator: Any) -> None:
        self.iterator = iterator
        self.owner: object = None


class ReadPoint:
    """What a read transaction reads: every table as of one commit (module
    invariants). Made, frozen and released by the engine under its commit
    lock, except :meth:`release`."""

    def __init__(self, families: Mapping[str, rocksdict.Rdict], commit_lock: threading.Lock) -> None:
        self._families = families
        self._commit_lock = commit_lock
        self.snapshots: dict[str, Any] = {name: family.snapshot() for name, family in families.items()}
        self._frozen: dict[str, _Cursor] | None = None

    def freeze(self) -> None:
        """Iterators of every table as they are now: called by a commit,
        before it writes, for every read in flight not yet frozen."""
        if self._frozen is None:
            self._frozen = {name: _Cursor(_iterator(family, name)) for name, family in self._families.items()}

    def iterator(self, table: str) -> tuple[Any, _Cursor | None]:
        """An iterator of ``table`` at this point, and its cursor where it is shared."""
        with self._commit_lock:
            if self._frozen is None:  # nothing committed since the read began: the table as it is now
                return _iterator(self._families[table], table), None
        cursor = self._frozen[table]
        return cursor.iterator, cursor

    def release(self) -> None:
        """Drops the snapshots and iterators (each keeps the database open)."""
        self.snapshots.clear()
        self._frozen = {}


class RocksTxn:
    """A transaction: committed tables, plus an overlay when writable; a
    read transaction reads ``point`` (module invariants)."""

    def __init__(self, families: Mapping[str, rocksdict.Rdict], writable: bool, floors: dict[str, bytes],
                 point: ReadPoint | None = None) -> None:
        self._families = families
        self._writable = writable
        self._point = point
        self.overlay: dict[str, dict[bytes, object]] = {name: {} for name in families}
        #: Per table, a key below which nothing is live (see RocksDbEngine).
        self.floors = floors
        #: A read's scans, closed when it ends (:meth:`close_scans`): an iterator kept alive past the read (a
        #: generator in a kept traceback) kept its database open and its ``LOCK`` held.
        self._scans: list[Iterator[tuple[bytes, Buffer]]] = []

    def close_scans(self) -> None:
        """Closes every scan of this read transaction (their iterators dropped)."""
        for scan in self._scans:
            scan.close()  # type: ignore[attr-defined]
        self._scans.clear()

    def get(self, table: str, key: bytes) -> Buffer | None:
        key = bytes(key)
        if self._point is not None:
            try:
                return self._point.snapshots[table][key]  # type: ignore[no-any-return]
            except Exception as exc:  # noqa: BLE001 - a snapshot's miss is an Exception too
                if str(exc) == _SNAPSHOT_MISS:
                    return None
                if _damaged_blob(exc, table):
                    return b""
                raise
        pending = self.overlay[table].get(key)
        if pending is _DELETED:
            return None
        if pending is not None:
            return pending  # type: ignore[return-value]
        try:
            return self._families[table].get(key)  # type: ignore[no-any-return]
        except Exception as exc:  # noqa: BLE001 - rocksdict raises plain Exceptions
            if _damaged_blob(exc, table):
                return b""
            raise

    def get_many(self, table: str, keys: Sequence[bytes]) -> list[Buffer | None]:
        return [self.get(table, key) for key in keys]

    def put(self, table: str, key: bytes, value: Buffer) -> None:
        if not self._writable:
            raise TierError("put in a read transaction", hint="use Engine.write")
        key = bytes(key)
        self.overlay[table][key] = bytes(value)
        if key < self.floors.get(table, b""):
            self.floors[table] = key

    def delete(self, table: str, key: bytes) -> bool:
        if not self._writable:
            raise TierError("delete in a read transaction", hint="use Engine.write")
        present = self.get(table, key) is not None
        self.overlay[table][bytes(key)] = _DELETED
        return present

    def scan(self, table: str, prefix: bytes = b"") -> Iterator[tuple[bytes, Buffer]]:
        scan = self._scan(table, prefix)
        if self._point is not None:
            self._scans.append(scan)
        return scan

    def _scan(self, table: str, prefix: bytes = b"") -> Iterator[tuple[bytes, Buffer]]:
        # The overlay is snapshotted at the start so callers may change the
        # table while they iterate (they see the state as of the call).
        start = max(prefix, self.floors.get(table, b""))
        pending = sorted((k, v) for k, v in self.overlay[table].items() if k.startswith(prefix) and k >= start)
        first = True
        for item in _merge(self._base_scan(table, prefix, start), pending):
            if first and not prefix:
                # Nothing is live before the first key of a whole-table scan.
                self.floors[table] = item[0]
            first = False
            yield item

    def _base_scan(self, table: str, prefix: bytes, start: bytes) -> Iterator[tuple[bytes, bytes]]:
        it, cursor = (_iterator(self._families[table], table), None) if self._point is None else self._point.iterator(table)
        me = object()
        if cursor is not None:
            cursor.owner = me
        it.seek(start)
        while it.valid():
            key = it.key()
            if not key.startswith(prefix):
                return
            yield key, it.value()
            if cursor is not None and cursor.owner is not me:  # another scan of the table moved it meanwhile
                cursor.owner = me
                it.seek(key)
                if it.valid() and it.key() == key:
                    it.next()
            else:
                it.next()
        try:
            it.status()
        except Exception as exc:  # noqa: BLE001 - rocksdict raises plain Exceptions
            raise TierError(f"RocksDB scan of table {table} failed (a file of the store is damaged or gone): {exc}",
                            hint="move the store aside (a cache: it starts empty), or put the file back from a copy"
                            ) from exc

    def batch(self, handles: Mapping[str, Any]) -> rocksdict.WriteBatch | None:
        batch = rocksdict.WriteBatch(raw_mode=True)
        for table, changes in self.overlay.items():
            for key, value in changes.items():
                if value is _DELETED:
                    batch.delete(key, handles[table])
                else:
                    batch.put(key, value, handles[table])
        return None if batch.is_empty() else batch


def _merge(base: Iterator[tuple[bytes, bytes]], pending: list[tuple[bytes, object]]) -> Iterator[tuple[bytes, Buffer]]:
    """Merges sorted committed items with sorted overlay items (overlay wins)."""
    i = 0
    for key, value in base:
        while i < len(pending) and pending[i][0] < key:
            if pending[i][1] is not _DELETED:
                yield pending[i]  # type: ignore[misc]
            i += 1
        if i < len(pending) and pending[i][0] == key:
            if pending[i][1] is not _DELETED:
                yield pending[i]  # type: ignore[misc]
            i += 1
            continue
        yield key, value
    for key, change in pending[i:]:
        if change is not _DELETED:
            yield key, change  # type: ignore[misc]
