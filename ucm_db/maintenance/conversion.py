"""Conversion of a store to another engine (``ucm-db migrate --to-engine``).

Conversion copies every table verbatim (payloads, metadata, LRU order, hit
counts, quarantine, upload queue, migration records) from one read snapshot
of the source into a new store directory, changing only the recorded
``engine`` setting, and then verifies the copy: same items in every table
(an xxh3 digest per table), a clean index check, and every block decoding
under its key.

Invariants:
    * The source is never written, and no other process has it open during
      the conversion: its lock is held exclusively throughout (a store open
      elsewhere is refused with LockedError naming the processes; one
      opening it meanwhile waits).
    * The destination must be new or an empty directory (not a symlink),
      outside the source store (a destination inside it is refused).
    * The copy is built in a hidden temp directory beside the destination
      (``.DEST.converting-<random>``) and renamed to DEST only once verified,
      so a conversion that fails or is killed never leaves a DEST that opens
      as a store. A failure removes the temp directory; a killed process
      leaves it behind (remove it; it is never opened as DEST).
"""

from __future__ import annotations

import os
import secrets
import shutil
from pathlib import Path
from typing import Any

import xxhash

from ucm_db.errors import ConfigError, FormatVersionError, MigrationError, TierError, UcmDbError
from ucm_db.format import (
    INFO_TABLE, SETTINGS_KEY, STORE_FORMAT_VERSION, open_engine, open_lmdb_read_only, read_format_version, read_settings,
    settings_records_for_engine,
)
from ucm_db.migrations.access import refuse_if_held
from ucm_db.storelock import LOCK_FILE, StoreLock, fsync_dir
from ucm_db.index import records
from ucm_db.store.view import ProgressFn, check_store_path, open_view
from ucm_db.engines.base import TABLES, Engine, Txn
from ucm_db.engines.lmdb import drop_sync_record
from ucm_db.maintenance.compaction import disk_full
from ucm_db.maintenance.verification import verify_view

#: The settings record's checksum sidecar (renewed with the record).
SETTINGS_SUM_KEY = records.SUM_PREFIX + SETTINGS_KEY
#: Items per destination write transaction.
COPY_BATCH_ITEMS = 512
#: Initial LMDB map of a new destination (it grows on demand).
DEST_MAP_BYTES = 64 << 20


def table_digests(engine: Engine, *, ignore_settings: bool = True) -> dict[str, tuple[int, str]]:
    """(items, xxh3-128 of all items) per table, in key order."""
    def run(txn: Txn) -> dict[str, tuple[int, str]]:
        out = {}
        for table in TABLES:
            h = xxhash.xxh3_128()
            n = 0
            for key, value in txn.scan(table):
                if ignore_settings and table == INFO_TABLE and key in (SETTINGS_KEY, SETTINGS_SUM_KEY):
                    continue
                h.update(len(key).to_bytes(4, "little") + key + len(value).to_bytes(8, "little"))
                h.update(value)
                n += 1
            out[table] = (n, h.hexdigest())
        return out
    return engine.read(run)


def copy_tables(source: Engine, dest: Engine, engine_name: str, total_items: int, progress: ProgressFn | None) -> None:
    """Copies every table from one read snapshot of ``source`` into ``dest``."""
    def run(txn: Txn) -> None:
        batch: list[tuple[str, bytes, bytes]] = []
        done = 0
        for table in TABLES:
            for key, value in txn.scan(table):
                if table == INFO_TABLE and key == SETTINGS_KEY:  # names the new engine; its checksum renewed
                    batch += [(table, name, record) for name, record in settings_records_for_engine(value, engine_name)]
                elif table != INFO_TABLE or key != SETTINGS_SUM_KEY:
                    batch.append((table, bytes(key), bytes(value)))
                if len(batch) >= COPY_BATCH_ITEMS:
                    done += _write(dest, batch)
                    batch = []
                    if progress is not None:
                        progress(done, total_items)
        done += _write(dest, batch)
        if progress is not None:
            progress(done, total_items)
    source.read(run)
    dest.sync()


def _write(dest: Engine, batch: list[tuple[str, bytes, bytes]]) -> int:
    def run(txn: Txn) -> None:
        for table, key, value in batch:
            txn.put(table, key, value)

    if batch:
        dest.write(run)
    return len(batch)


def _dest_error(dest_path: Path, exc: OSError) -> ConfigError:
    return ConfigError(f"cannot create the destination {dest_path}: {exc.strerror or exc}",
                       hint="pass a new directory DEST on a writable file system this user may write")


def _check_dest(source_path: Path, dest_path: Path) -> None:
    try:
        _check_dest_path(source_path, dest_path)
    except OSError as exc:
        raise _dest_error(dest_path, exc) from exc


def _check_dest_path(source_path: Path, dest_path: Path) -> None:
    if dest_path.is_symlink():  # the final rename cannot replace a link, and must not follow one
        raise ConfigError(f"destination {dest_path} is a symlink (to {os.readlink(dest_path)})",
                          hint="pass a new directory as DEST, or the directory the link points to if it is empty")
    if dest_path.exists() and (not dest_path.is_dir() or any(dest_path.iterdir())):
        raise ConfigError(f"destination {dest_path} is not empty (or is a file)", hint="pass a new directory as DEST")
    source, dest = source_path.resolve(), dest_path.resolve()
    if dest == source or source in dest.parents:
        raise ConfigError(f"destination {dest_path} is inside the source store {source_path}",
                          hint="pass a DEST outside the source store, e.g. a sibling directory")


def _hold_source(source_path: Path) -> StoreLock:
    """The source's lock, held exclusively (LockedError naming the holders
    otherwise). A store this user cannot write and that has no lock file was
    never opened writable by this version: there is nothing to hold."""
    writable = os.access(source_path, os.W_OK)
    lock = StoreLock(source_path, read_only=not writable)
    if writable or (source_path / LOCK_FILE).exists():
        refuse_if_held(source_path, lock, "convert")
    return lock


def _check_source(source_path: Path, engine: Engine, engine_name: str, source_engine: str) -> None:
    version = read_format_version(engine)
    if version != STORE_FORMAT_VERSION:  # a newer one is not migrated back: `migrate` refuses it too
        newer = version > STORE_FORMAT_VERSION
        raise FormatVersionError(f"store at {source_path} has format {version}"
                                 + (f", newer than this ucm-db's {STORE_FORMAT_VERSION}" if newer else ""),
                                 hint="upgrade ucm-db to convert it" if newer else f"run `ucm-db migrate {source_path}` first")
    if source_engine == engine_name:
        raise ConfigError(f"store at {source_path} already uses {engine_name}", hint="pick the other engine")
    try:
        read_settings(engine)
    except (UcmDbError, ValueError, TypeError) as exc:
        # The copy renews the record's checksum: it must not launder an altered record.
        raise MigrationError(f"the settings record of the store at {source_path} is damaged; it is not converted",
                             hint=f"run `ucm-db verify {source_path}` for a report; the store is a cache: start a new one") from exc


def convert(source_path: str | Path, dest_path: str | Path, engine_name: str, progress: ProgressFn | None = None) -> dict[str, Any]:
    """Converts the store at ``source_path`` into a new ``engine_name`` store
    at ``dest_path`` (module invariants); returns the report.

    Raises:
        LockedError: another process has the source store open.
        ConfigError: DEST is not empty, is a symlink, is inside the source, or the store
            already uses ``engine_name``.
        MigrationError: the copy differs from the source or fails to verify.
    """
    source_path, dest_path = Path(source_path), Path(dest_path)
    source_engine = check_store_path(source_path)
    _check_dest(source_path, dest_path)
    lock = _hold_source(source_path)
    try:
        # Opened MDB_RDONLY: a conversion never writes its source, which may
        # be on a read-only volume (issue 46; open_engine opens LMDB writable).
        source = (open_lmdb_read_only(source_path) if source_engine == "lmdb"
                  else open_engine(source_path, source_engine, read_only=True, sync=True))
        try:
            _check_source(source_path, source, engine_name, source_engine)
            source_digests = table_digests(source)
            total = sum(n for n, _ in source_digests.values())
            temp = dest_path.parent / f".{dest_path.name}.converting-{secrets.token_hex(6)}"
            try:
                dest_path.parent.mkdir(parents=True, exist_ok=True)
                temp.mkdir(mode=0o700)
            except OSError as exc:  # a file on the way, a read-only volume, permission, a name too long
                raise _dest_error(dest_path, exc) from exc
            try:
                blocks = _copy_and_verify(source, temp, engine_name, source_digests, total, progress, source_path)
                os.rename(temp, dest_path)  # replaces only an empty directory
                fsync_dir(dest_path.parent)
            except BaseException as exc:
                shutil.rmtree(temp, ignore_errors=True)
                if disk_full(exc):
                    why = exc.message if isinstance(exc, UcmDbError) else str(exc)  # its hint is a store's, not this
                    raise TierError(f"cannot convert {source_path} to {dest_path}: the disk is full ({why}); nothing "
                                    "was converted and the source is unchanged",
                                    hint=f"free space on the disk of {dest_path.parent} (the copy needs about the "
                                         "source's size) or pass a DEST on another disk") from exc
                raise
        finally:
            source.close()
    finally:
        lock.release()
    return {"source": str(source_path), "dest": str(dest_path), "engine": engine_name, "items": total,
            "blocks_verified": blocks, "tables": {t: n for t, (n, _) in source_digests.items()}}


def _copy_and_verify(source: Engine, temp: Path, engine_name: str, source_digests: dict[str, tuple[int, str]],
                     total: int, progress: ProgressFn | None, source_path: Path) -> int:
    dest = open_engine(temp, engine_name, sync=False, map_size_bytes=DEST_MAP_BYTES)
    try:
        copy_tables(source, dest, engine_name, total, progress)
        dest_digests = table_digests(dest)
    except BaseException:
        try:
            dest.close()
        except Exception:  # noqa: BLE001 - a close after a failed write fails too (RocksDB): the write's error is the one
            pass
        raise
    dest.close()
    # The copy ran as a group writer, which keeps a sync record; the new store starts without one, as
    # any new store does (the copy is synced whole): a sync store's commits then never move one.
    if engine_name == "lmdb":
        drop_sync_record(temp / "lmdb")
    if dest_digests != source_digests:
        bad = [t for t in TABLES if dest_digests[t] != source_digests[t]]
        raise MigrationError(f"converted copy differs from the source in tables {', '.join(bad)}")
    return verify_converted(temp, source_path)


def verify_converted(dest_path: Path, source_path: Path) -> int:
    """Opens the new store as users will and decodes every block; a
    problem found is the source's (module invariants)."""
    from ucm_db.store import open as open_store

    open_store(dest_path, read_only=True).close()  # format and settings accepted; read-only: a writable open sweeps
    with open_view(dest_path) as view:
        report = verify_view(view)
    if report.problems:
        first = next(iter(sorted(report.corrupt.items())), None)
        raise MigrationError(
            f"the store at {source_path} fails verification, so its copy does too: {len(report.corrupt)} corrupt blocks"
            + (f" (first {first[0].hex()[:16]}: {first[1]})" if first else "")
            + (f", index problems {report.index_problems[:3]}" if report.index_problems else "") + "; nothing was converted",
            hint=f"run `ucm-db verify {source_path} --fix` (it quarantines corrupt blocks and repairs the index), then convert again")
    return report.checked
