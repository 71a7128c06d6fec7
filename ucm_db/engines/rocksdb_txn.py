"""The RocksDB engine's transactions: an overlay of pending changes over
the committed column families (see :mod:`ucm_db.engines.rocksdb` for the
invariants; the gate that keeps readers off a commit in progress is
:class:`ucm_db.engines.gate.SharedExclusiveGate`).

Invariants:
    * A write transaction reads its own writes (``get`` and sorted merged
      ``scan``); nothing reaches the database before :meth:`RocksTxn.batch`
      is written as one ``WriteBatch``.
    * A read transaction refuses ``put``/``delete``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import rocksdict

from ucm_db.errors import TierError
from ucm_db.engines.base import Buffer

_DELETED = object()


class RocksTxn:
    """A transaction: committed tables, plus an overlay when writable."""

    def __init__(self, families: dict[str, rocksdict.Rdict], writable: bool, floors: dict[str, bytes]) -> None:
        self._families = families
        self._writable = writable
        self.overlay: dict[str, dict[bytes, object]] = {name: {} for name in families}
        #: Per table, a key below which nothing is live (see RocksDbEngine).
        self.floors = floors

    def get(self, table: str, key: bytes) -> Buffer | None:
        key = bytes(key)
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
        it = self._families[table].iter()
        it.seek(start)
        while it.valid():
            key = it.key()
            if not key.startswith(prefix):
                return
            yield key, it.value()
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
