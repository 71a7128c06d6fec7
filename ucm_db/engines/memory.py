"""In-memory engine: the reference implementation and test oracle.

Transactions buffer their writes in an overlay and apply it on success, so an
exception leaves the tables untouched, exactly like a real engine. One lock
serialises all transactions: simple and obviously correct, not fast.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence

from ucm_db.engines.base import TABLES, Buffer, Engine, T

_DELETED = object()


class _MemoryTxn:
    def __init__(self, tables: dict[str, dict[bytes, bytes]], writable: bool) -> None:
        self._tables = tables
        self._writable = writable
        self.overlay: dict[str, dict[bytes, object]] = {name: {} for name in tables}

    def get(self, table: str, key: bytes) -> Buffer | None:
        value = self.overlay[table].get(key)
        if value is _DELETED:
            return None
        if value is not None:
            return value  # type: ignore[return-value]
        return self._tables[table].get(bytes(key))

    def get_many(self, table: str, keys: Sequence[bytes]) -> list[Buffer | None]:
        return [self.get(table, key) for key in keys]

    def put(self, table: str, key: bytes, value: Buffer) -> None:
        if not self._writable:
            raise RuntimeError("put in a read transaction")
        self.overlay[table][bytes(key)] = bytes(value)

    def delete(self, table: str, key: bytes) -> bool:
        if not self._writable:
            raise RuntimeError("delete in a read transaction")
        present = self.get(table, key) is not None
        self.overlay[table][bytes(key)] = _DELETED
        return present

    def scan(self, table: str, prefix: bytes = b"") -> Iterator[tuple[bytes, Buffer]]:
        keys = set(self._tables[table]) | set(self.overlay[table])
        for key in sorted(k for k in keys if k.startswith(prefix)):
            value = self.get(table, key)
            if value is not None:
                yield key, value

    def apply(self) -> None:
        for name, changes in self.overlay.items():
            table = self._tables[name]
            for key, value in changes.items():
                if value is _DELETED:
                    table.pop(key, None)
                else:
                    table[key] = value  # type: ignore[assignment]


class MemoryEngine(Engine):
    """Tables in dicts; not persistent, one process."""

    name = "memory"
    multi_process = False
    persistent = False

    def __init__(self) -> None:
        self._tables: dict[str, dict[bytes, bytes]] = {name: {} for name in TABLES}
        self._lock = threading.RLock()

    def read(self, fn: Callable[[_MemoryTxn], T]) -> T:  # type: ignore[override]
        with self._lock:
            return fn(_MemoryTxn(self._tables, writable=False))

    def write(self, fn: Callable[[_MemoryTxn], T]) -> T:  # type: ignore[override]
        with self._lock:
            txn = _MemoryTxn(self._tables, writable=True)
            result = fn(txn)
            txn.apply()
            return result

    def sync(self) -> None:
        pass

    def close(self) -> None:
        pass
