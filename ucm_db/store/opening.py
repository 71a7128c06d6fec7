"""Opening a store: the checks and steps :class:`~ucm_db.store.Store` runs
before it holds anything.

Invariants:
    * Nothing is created before the arguments are checked: a bad path, an
      unknown option, a bad remote key, an engine that conflicts with the
      store on disk, or a directory holding both engines' directories
      (:func:`ucm_db.format.detect_engine`, with or without ``engine``)
      is refused first.
    * A new store is created by one process at a time
      (:func:`ucm_db.storelock.hold_creation`), which looks for an engine
      again under that lock: two processes creating one store with
      different engines leave one engine, the other process adopting it or
      refused (an explicit other ``engine``: ConfigError).
    * A read-only open never creates a store (an absent one is a TierError).
      A writable one makes the names of the store and its engine directory
      durable before it returns (:func:`ucm_db.storelock.sync_store_names`).
    * A refused store (format, settings, lock) is let go at once: the
      engine is closed and the directory lock released before the error
      leaves, so e.g. ``migrate`` in this same process can take it.
    * The info records are read (or, for a new store, written) through
      :mod:`ucm_db.format`, in one transaction.
    * A keyless open of a remote this store (or the remote's root) records
      as keyed is refused before anything is fetched
      (:mod:`ucm_db.remote.keying`).
    * The engine runs with the settings the store runs with: an existing
      store is opened ``sync`` first, whatever ``durability`` the caller
      names (always safe: a sync open of a group store rolls back, records
      and pins as a group open does; a group engine would start a sync
      record in a sync store, whose failure to move could roll acknowledged
      puts back after an OS crash) and, where its recorded settings give
      the engine another shape (group durability, another map size),
      opened again with them before anything is written (issue 46: a
      recorded ``sync`` store reopened without options ran MDB_NOSYNC and
      lost acked puts). A conflicting ``durability`` is refused by then.
    * After a rollback to a synced snapshot (an OS crash under group
      durability), the first writable open restarts the change feed's
      sequence and draws a new feed id before anything appends: no seq a
      reader may hold is handed out again, and a reader passing its feed
      id is told to resync (:func:`restart_feed_after_rollback`). A RocksDB
      group store cannot tell whether an OS crash lost its WAL's unsynced
      tail: its first writable open under another boot restarts the feed
      (:func:`restart_feed_after_reboot`; readers resync once a reboot).
    * A writable open leaves the feed with an id: a store of ucm-db before
      feed ids (or with a damaged one) gets one (one write, once).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ucm_db.auth import AuthKeys, load_keys
from ucm_db.remote.sealing import SealingKeys, load_sealing_keys
from ucm_db.config import PERSISTED_FIELDS, StoreConfig
from ucm_db.errors import ConfigError, TierError
from ucm_db.format import (
    check_format_version, check_persisted_settings, detect_engine, engine_for_config,
    engine_shape, open_records, seal_format_records,
)
from ucm_db.storelock import CreationLock, StoreLock, ensure_store_dir, hold_creation, hold_shared, sync_store_names
from ucm_db.store.path import detect_engine_checked, permission_error, refuse_enclosing, store_path
from ucm_db.index.accounting import seal_records
from ucm_db.engines.base import Engine
from ucm_db.index import changefeed
from ucm_db.index.local import LocalTier


@dataclass(frozen=True)
class OpenedStore:
    """What an open hands the store: its checked path and adopted config,
    the engine and local tier over it, the shared directory lock it holds
    and the remote's authentication keys (None without)."""

    path: Path
    config: StoreConfig
    engine: Engine
    tier: LocalTier
    dir_lock: StoreLock
    auth_keys: AuthKeys | None
    #: The remote's encryption keys (None without).
    sealing_keys: SealingKeys | None = None


def open_store(path: str | os.PathLike[str], options: Mapping[str, Any]) -> OpenedStore:
    """Checks ``options`` against the store at ``path`` (creating it unless
    read-only) and opens its engine and local tier (module invariants)."""
    path = store_path(path)  # bytes, "", too long, inside another store: ConfigError, nothing created
    explicit = dict(options)
    checked = StoreConfig.from_dict(explicit)  # reject unknown or invalid options early
    auth_keys = load_keys(checked.remote_auth_key_file, checked.remote_auth_key_env)  # a bad key: before anything opens
    sealing_keys = load_sealing_keys(checked.remote_encryption_key_file, checked.remote_encryption_key_env)
    existing = detect_engine_checked(path)
    choose_engine(explicit, existing, path)
    read_only = explicit.get("read_only") is True
    if read_only and existing is None:
        raise TierError(
            f"no ucm-db store at {path} to open read-only",
            hint="check the path (a read-only open never creates a store), or open it writable once to create it",
        )
    if not read_only:
        if existing is None:
            refuse_enclosing(path)  # a new store around an existing one: ConfigError, nothing created
        ensure_store_dir(path)  # a file or a read-only volume is a TierError with the fix
    # Keeps compact/migrate from rewriting files under us (read-only: creating nothing).
    dir_lock = hold_shared(path, read_only=read_only)
    creation: CreationLock | None = None
    engine: Engine | None = None
    try:
        if existing is None and not read_only:
            # A new store: one creator at a time, each looking again (storelock's invariants).
            creation = hold_creation(path)
            existing = detect_engine_checked(path)
            choose_engine(explicit, existing, path)
        config = StoreConfig.from_dict(explicit)
        # The durability is not known before the records are read: the first
        # engine of an existing store is a sync one (module invariants).
        opened_as_recorded = read_only or existing is None
        first = config if opened_as_recorded else replace(config, durability="sync")
        engine = engine_for_config(path, first)
        tier = LocalTier(engine, capacity_bytes=config.capacity_bytes)
        config = adopt_settings(engine, config, explicit, path)
        if creation is not None:
            creation.release()  # the engine's directory and the store's records exist now
        if not read_only and engine_shape(config) != engine_shape(first):
            engine = reopened(engine, path, config)
            tier = LocalTier(engine, capacity_bytes=config.capacity_bytes)
        if not read_only:
            restart_feed_after_rollback(engine, path)
            restart_feed_after_reboot(engine, config)
            if not engine.read(changefeed.identity):
                engine.write(changefeed.ensure_identity)
            sync_store_names(path, detect_engine(path))  # a new store's, or a recovery's new engine directory
        if config.remote is not None:
            from ucm_db.remote.keying import check_keying  # loaded only by a store with a remote

            check_keying(engine, config.remote, dict(config.remote_options), auth_keys, store_path=str(path),
                         sealing=sealing_keys)
    except BaseException as exc:
        # A refused store (format, settings, lock) is let go at once, so
        # e.g. `migrate` in this same process can take it.
        if engine is not None:
            engine.close()
        if creation is not None:
            creation.release()
        dir_lock.release()
        if isinstance(exc, PermissionError):  # e.g. an unreadable data file, read-only open included
            raise permission_error(path, exc) from exc
        raise
    tier.capacity_bytes = config.capacity_bytes
    return OpenedStore(path, config, engine, tier, dir_lock, auth_keys, sealing_keys)


def choose_engine(explicit: dict[str, Any], existing: str | None, path: Path) -> None:
    """Sets ``explicit["engine"]`` to the store's engine ``existing`` where
    none was asked for; an asked-for engine that differs is a ConfigError."""
    if "engine" not in explicit:
        if existing is not None:
            explicit["engine"] = existing
    elif existing is not None and explicit["engine"] != existing:
        # Opening with another engine would start a second, empty store
        # beside this one and miss everything stored.
        raise ConfigError(
            f"engine={explicit['engine']!r} conflicts with the store at {path}, which is a {existing} store",
            hint=f"omit engine (or pass engine={existing!r}) to open it, or use a new store path for another engine",
        )


def restart_feed_after_rollback(engine: Engine, path: Path) -> None:
    """Restarts the change feed's sequence (:func:`ucm_db.index.changefeed.restart`)
    where a rollback after an OS crash left its marker, durably, before
    anything appends; then clears the marker. Any process's open may have
    rolled back (a read-only view too): the first writable open restarts."""
    env_dir = path / "lmdb"
    if not env_dir.is_dir():
        return  # another engine: nothing rolls it back
    from ucm_db.engines import lmdb as lmdb_engine  # loaded already by the LMDB engine this store opened

    rollback = lmdb_engine.rolled_back(env_dir)
    if rollback is None:
        return
    engine.write(lambda txn: changefeed.restart(txn, rollback))
    engine.sync()
    lmdb_engine.clear_rolled_back(env_dir)


def restart_feed_after_reboot(engine: Engine, config: StoreConfig) -> None:
    """Restarts the change feed (:func:`ucm_db.index.changefeed.restart`) of a
    RocksDB store under ``group`` durability at its first writable open
    under another boot than the last one's: the machine went down since,
    and may have lost the WAL's unsynced tail (commits not yet synced)
    with the seqs they took, which the feed would hand out again. RocksDB
    tells no such loss (LMDB does, :func:`restart_feed_after_rollback`), so
    a clean reboot restarts it too (readers resync once). One read where
    the boot is the recorded one; nothing without a boot id."""
    if config.durability != "group" or config.engine != "rocksdb":
        return
    from ucm_db.engines.lmdb import boot_id  # the one boot id (Linux's, or UCM_DB_BOOT_ID)

    boot = boot_id()
    if boot is None:
        return
    now = boot.encode()

    def recorded_boot(txn: Any) -> bytes | None:
        value = txn.get(changefeed.INFO, changefeed.BOOT_KEY)
        return None if value is None else bytes(value)

    def run(txn: Any) -> None:
        recorded = recorded_boot(txn)
        if recorded is not None and recorded != now:
            changefeed.restart(txn, b"boot:" + now)
        txn.put(changefeed.INFO, changefeed.BOOT_KEY, now)

    if engine.read(recorded_boot) != now:
        engine.write(run)


def reopened(engine: Engine, path: Path, config: StoreConfig) -> Engine:
    """``engine`` closed and opened again as ``config`` says. The first open
    checked the pages and made any recovery: the new engine skips the page
    check and reports what the first open found (``recovery``, ``rollback``)."""
    reports = {name: getattr(engine, name) for name in ("recovery", "rollback") if hasattr(engine, name)}
    engine.close()
    engine = engine_for_config(path, config, check_pages=False)
    if reports:
        engine.read(lambda txn: None)  # opens it now, so its own (empty) reports are in place first
        for name, report in reports.items():
            setattr(engine, name, report)
    return engine


def adopt_settings(engine: Engine, config: StoreConfig, explicit: Mapping[str, Any], path: Path) -> StoreConfig:
    """Records settings in a new store, or checks them against an old one;
    returns the config the store runs with (stored persisted settings win
    over omitted ones; a conflicting explicit one is a ConfigError)."""
    wanted = config.persisted()
    version, stored, created = (engine.read if config.read_only else engine.write)(
        lambda txn: open_records(txn, wanted, path, read_only=config.read_only))
    check_format_version(version, path)
    check_persisted_settings(stored, path)
    if not config.read_only:
        # Records of older code get checksums; their counters are recounted first (issue 26 item 18).
        engine.write(lambda txn: seal_format_records(txn) + seal_records(txn))
        if created:
            # A new store is durable once its open returns, whatever the durability: after an OS crash it is
            # this store, empty, never one without its format record (which a read-only open refuses).
            engine.sync()
    for name in PERSISTED_FIELDS:
        if name in explicit and name in stored and explicit[name] != stored[name]:
            raise ConfigError(
                f"{name}={explicit[name]!r} conflicts with the store at {path}, created with {name}={stored[name]!r}",
                hint=f"omit {name} to use the stored setting, or use a new store path",
            )
    merged = {**{k: v for k, v in explicit.items()}, **{k: v for k, v in stored.items() if k in PERSISTED_FIELDS}}
    return StoreConfig.from_dict(merged)
