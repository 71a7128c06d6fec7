"""The LMDB engine's transactions, and its retried ``lmdb.open``.

Invariants:
    * A :class:`LmdbTxn` only forwards to one py-lmdb transaction: the engine
      (:mod:`ucm_db.engines.lmdb.engine`) begins, commits and retries it.
    * A whole-table ``scan`` tests no bound per key; a prefix scan stops at
      the first key outside the prefix.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import lmdb

from ucm_db.engines.base import Buffer


def lmdb_open(path: str, **options: Any) -> lmdb.Environment:
    """``lmdb.open``, retried while other processes grow the map: opening
    runs a transaction, which fails with MDB_MAP_RESIZED when a writer grew
    the map after the meta page was read (seen in the crash loop)."""
    for _ in range(15):
        try:
            return lmdb.open(path, **options)
        except lmdb.MapResizedError:
            continue
    return lmdb.open(path, **options)


class LmdbTxn:
    """The :class:`~ucm_db.engines.base.Txn` of the LMDB engine: one py-lmdb
    transaction over the named tables (``buffers=True``: values are views
    valid until the transaction ends)."""

    def __init__(self, txn: lmdb.Transaction, dbs: dict[str, Any]) -> None:
        self._txn = txn
        self._dbs = dbs

    def get(self, table: str, key: bytes) -> Buffer | None:
        return self._txn.get(key, db=self._dbs[table])  # type: ignore[no-any-return]

    def get_many(self, table: str, keys: Sequence[bytes]) -> list[Buffer | None]:
        get, db = self._txn.get, self._dbs[table]
        return [get(key, None, db) for key in keys]

    def snapshot_id(self) -> int:
        """The id of the commit this transaction reads (a write transaction: the one it will make)."""
        return int(self._txn.id())

    def stat(self, table: str) -> Any:
        """LMDB's page counts of ``table`` in this snapshot (``txn.stat``)."""
        return self._txn.stat(self._dbs[table])

    def put(self, table: str, key: bytes, value: Buffer) -> None:
        self._txn.put(key, value, db=self._dbs[table])

    def delete(self, table: str, key: bytes) -> bool:
        return self._txn.delete(key, db=self._dbs[table])  # type: ignore[no-any-return]

    def scan(self, table: str, prefix: bytes = b"") -> Iterator[tuple[bytes, Buffer]]:
        cursor = self._txn.cursor(db=self._dbs[table])
        if not cursor.set_range(prefix):
            return
        if not prefix:  # a whole table: no bound to test per key (maintenance walks millions)
            for key, value in cursor:
                yield bytes(key), value
            return
        for key, value in cursor:
            key = bytes(key)
            if not key.startswith(prefix):
                return
            yield key, value
