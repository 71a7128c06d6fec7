"""Opening a store's engine directly, below :class:`ucm_db.Store`.

Migrations and maintenance tools must read stores the current code refuses
to open (an older format) and must not write reader activity while they
look. They open the engine alone, read-only where they can.

Invariants:
    * :func:`open_engine` never creates a store: a path without one is a
      :class:`~ucm_db.errors.ConfigError`.
    * :func:`exclusive_engine` holds the store's lock exclusively for as long
      as the engine is open, or refuses naming the processes that hold it
      (:func:`exclusive_lock` holds it without opening the engine).
    * :func:`format_read_only` and :func:`read_store` read a store without
      opening it for writing: a writable open of a RocksDB store replays its
      log, creates the tables it lacks and rewrites its MANIFEST and
      OPTIONS, which must not happen to a store of a format this ucm-db does
      not know. A RocksDB store lacking some of today's tables (an older
      ucm-db's, or a newer one's that dropped one), which the engine's
      read-only open refuses, is read through a read-only open of the tables
      it has (:func:`read_rocksdb_tables`), as the engine opens one: a
      private shadow directory of links to its files
      (:mod:`ucm_db.engines.rocksdb_shadow`), so nothing is written in the
      store's directory; a table it lacks reads empty.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ucm_db.errors import ConfigError, FormatVersionError, LockedError, TierError
from ucm_db.format import checked_format_version, detect_engine
from ucm_db.format import open_engine as _open_engine
from ucm_db.format import open_lmdb_read_only, parse_format_version
from ucm_db.format import read_format_version  # noqa: F401 - re-exported for migrations and tools
from ucm_db.storelock import StoreLock, describe, holders
from ucm_db.engines.base import Buffer, Engine, T, Txn


def require_store(path: Path) -> str:
    """The engine name of the store at ``path``; ConfigError if there is
    none, or if the path cannot be read (permission, a name too long)."""
    try:
        engine = detect_engine(path)
    except OSError as exc:
        raise ConfigError(f"cannot use the store path {path}: {exc.strerror or exc}",
                          hint="check the path: each directory on it, the length of its names, and their permissions") from exc
    if engine is None:
        raise ConfigError(
            f"no ucm-db store at {path}",
            hint="pass the directory given to ucm_db.open (it holds lmdb/ or rocksdb/)",
        )
    return engine


def open_engine(path: Path, *, read_only: bool = False, sync: bool = True) -> Engine:
    """Opens the engine of the existing store at ``path`` (no Store checks).
    ``read_only`` on an LMDB store this user cannot write (a read-only
    volume, another user's store): opened ``MDB_RDONLY``, as ``inspect``
    views it (:func:`ucm_db.store.view.open_view`); the read-only open that
    recovers after an OS crash must write, and failed there (`migrate
    --dry-run` then told the user to delete the store)."""
    name = require_store(path)
    if read_only and name == "lmdb" and not os.access(path, os.W_OK):
        return open_lmdb_read_only(path)
    return _open_engine(path, name, sync=sync, read_only=read_only)


def refuse_if_held(path: Path, lock: StoreLock, action: str) -> None:
    """Takes ``lock`` exclusively or raises LockedError naming the holders."""
    if not lock.try_exclusive():
        lock.release()
        raise LockedError(
            f"cannot {action} {path}: the store is open in {describe(holders(path))}",
            hint="stop or close those processes, then run the command again",
        )


@contextmanager
def exclusive_lock(path: Path, action: str = "migrate") -> Iterator[None]:
    """The store's lock, held exclusively (LockedError naming the holders otherwise)."""
    require_store(path)
    lock = StoreLock(path)
    refuse_if_held(path, lock, action)
    try:
        yield
    finally:
        lock.release()


@contextmanager
def exclusive_engine(path: Path, action: str = "migrate") -> Iterator[Engine]:
    """The store's engine, opened for writing while no one else has it."""
    with exclusive_lock(path, action):
        engine = open_engine(path, read_only=False, sync=True)
        try:
            yield engine
        finally:
            engine.close()


def format_read_only(path: Path) -> int:
    """The store's format version, read without opening it for writing
    (module invariants).

    Raises:
        ConfigError: the store records no format version.
        DamagedRecordError: its format record is damaged.
    """
    return parse_format_version(read_store(path, checked_format_version))


def read_store(path: Path, fn: Callable[[Txn], T]) -> T:
    """``fn`` run in a read transaction of the store at ``path``, opened
    read-only; a RocksDB store lacking some of today's tables through the
    tables it has (module invariants)."""
    try:
        engine = open_engine(path, read_only=True)
    except FormatVersionError:
        if require_store(path) != "rocksdb":
            raise
        return read_rocksdb_tables(path, fn)
    try:
        return engine.read(fn)
    finally:
        engine.close()


def read_rocksdb_tables(path: Path, fn: Callable[[Txn], T]) -> T:
    """``fn`` run on the tables the RocksDB store at ``path`` has, opened
    read-only through a shadow directory (module invariants)."""
    import rocksdict

    from ucm_db.engines.rocksdb_shadow import open_pinned

    real = (Path(path) / "rocksdb").absolute()
    tables: list[str] = []

    def open_db(shadow: Path) -> rocksdict.Rdict:
        tables[:] = rocksdict.Rdict.list_cf(str(shadow), rocksdict.Options(raw_mode=True))
        options = rocksdict.Options(raw_mode=True)
        options.set_max_open_files(-1)  # every table file opened now, while the shadow pins it
        return rocksdict.Rdict(str(shadow), options=options, access_type=rocksdict.AccessType.read_only(),
                               column_families={name: rocksdict.Options(raw_mode=True) for name in tables})
    try:
        db, shadow = open_pinned(real, open_db)
    except TierError:
        raise
    except Exception as exc:  # rocksdict raises plain Exception for IO errors
        raise TierError(f"cannot open RocksDB store at {real} read-only: {exc}", hint="check the store's files and "
                        "permissions; `ucm-db verify` names what is damaged") from exc
    families: dict[str, Any] = {}
    try:
        families = {name: db.get_column_family(name) for name in tables}
        return fn(_PresentTables(families))
    finally:
        for family in families.values():
            family.close()
        db.close()
        shadow.remove()


class _PresentTables:
    """A read transaction over the column families a RocksDB store has,
    opened read-only; a table it lacks reads empty."""

    def __init__(self, families: dict[str, Any]) -> None:
        self._families = families

    def get(self, table: str, key: bytes) -> Buffer | None:
        family = self._families.get(table)
        return None if family is None else family.get(bytes(key))  # type: ignore[no-any-return]

    def get_many(self, table: str, keys: Sequence[bytes]) -> list[Buffer | None]:
        return [self.get(table, key) for key in keys]

    def put(self, table: str, key: bytes, value: Buffer) -> None:
        raise TierError("put in a read-only view of a RocksDB store", hint="open the store for writing")

    def delete(self, table: str, key: bytes) -> bool:
        raise TierError("delete in a read-only view of a RocksDB store", hint="open the store for writing")

    def scan(self, table: str, prefix: bytes = b"") -> Iterator[tuple[bytes, Buffer]]:
        family = self._families.get(table)
        if family is None:
            return
        it = family.iter()
        it.seek(prefix)
        while it.valid() and it.key().startswith(prefix):
            yield it.key(), it.value()
            it.next()
