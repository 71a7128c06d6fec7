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
    * :func:`format_read_only` reads the store's format without opening it
      for writing: a writable open of a RocksDB store replays its log and
      rewrites its MANIFEST and OPTIONS, which must not happen to a store of
      a format this ucm-db does not know.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ucm_db.errors import ConfigError, FormatVersionError, LockedError
from ucm_db.format import detect_engine
from ucm_db.format import open_engine as _open_engine
from ucm_db.format import open_lmdb_read_only
from ucm_db.format import read_format_version  # noqa: F401 - re-exported for migrations and tools
from ucm_db.storelock import StoreLock, describe, holders
from ucm_db.engines.base import Engine


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


def format_read_only(path: Path) -> int | None:
    """The store's format version, read through a read-only open; None for
    a RocksDB store that lacks tables its writable opens create (an older
    ucm-db's, which a read-only open refuses: migrating it writes anyway)."""
    try:
        engine = open_engine(path, read_only=True)
    except FormatVersionError:
        if require_store(path) != "rocksdb":
            raise
        return None
    try:
        return read_format_version(engine)
    finally:
        engine.close()
