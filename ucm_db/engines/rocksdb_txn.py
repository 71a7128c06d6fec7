"""The RocksDB engine's transactions: an overlay of pending changes over
the committed column families, and the point a read transaction reads at
(see :mod:`ucm_db.engines.rocksdb` for the engine's invariants).

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
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import rocksdict

from ucm_db.errors import TierError
from ucm_db.engines.base import Buffer

_DELETED = object()
#: What rocksdict's ``Snapshot[key]`` raises for a key it does not hold (a plain Exception).
_SNAPSHOT_MISS = "key not found"


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
            self._frozen = {name: _Cursor(family.iter()) for name, family in self._families.items()}

    def iterator(self, table: str) -> tuple[Any, _Cursor | None]:
        """An iterator of ``table`` at this point, and its cursor where it is shared."""
        with self._commit_lock:
            if self._frozen is None:  # nothing committed since the read began: the table as it is now
                return self._families[table].iter(), None
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

    def get(self, table: str, key: bytes) -> Buffer | None:
        key = bytes(key)
        if self._point is not None:
            try:
                return self._point.snapshots[table][key]  # type: ignore[no-any-return]
            except Exception as exc:  # noqa: BLE001 - a snapshot's miss is an Exception too
                if str(exc) == _SNAPSHOT_MISS:
                    return None
                raise
        pending = self.overlay[table].get(key)
        if pending is _DELETED:
            return None
        if pending is not None:
            return pending  # type: ignore[return-value]
        return self._families[table].get(key)  # type: ignore[no-any-return]

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
        it, cursor = (self._families[table].iter(), None) if self._point is None else self._point.iterator(table)
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
