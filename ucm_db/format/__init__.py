"""The store's on-disk format: version, info records, and the one engine opener.

Everything that says how a store directory is laid out lives here (its
constants in the leaf :mod:`ucm_db.format.names`, which the tiers import:
this module sits above the tiers, since it builds their engines), so the
store, migrations and tools agree on it by importing one module.

Invariants:
    * A store directory holds exactly one engine directory, named after its
      engine (``lmdb/`` or ``rocksdb/``); :func:`detect_engine` reads that, and
      refuses a directory holding both (:mod:`ucm_db.format.engine_dirs`).
    * ``info/format_version`` holds the decimal format version; a store of
      another version is refused by :func:`check_format_version` with the fix.
      Like the settings record it is checksummed (a ``sum:`` sidecar, see
      :mod:`ucm_db.index.records`): written so by this code and by
      migrations, sealed at a writable open in stores of older code (which
      wrote it bare: a bare record is trusted as it is until then).
    * A settings record whose persisted values are invalid (a negative
      capacity, an unknown codec) is damage: :func:`check_persisted_settings`
      names the field and the value, never "raise capacity_bytes".
    * :func:`open_engine` is the only place an engine object is built (the
      store, migrations, conversion and the tools all come through it).
    * This module is the one parser and writer of the settings, version and
      creation records (:func:`parse_settings`, :func:`open_records`,
      :func:`write_new_store_records`, :func:`write_format_version`). A
      damaged record (checksum mismatch, not parseable, a persisted value no
      config accepts) is found as the internal
      :class:`~ucm_db.index.records.DamagedRecord` and raised to every door
      as the one public :class:`~ucm_db.errors.DamagedRecordError` (a
      :class:`TierError`: the CLI exits 1).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ucm_db.config import persisted_settings_problem
from ucm_db.engines.base import NEVER_INITIALISED_HINT, never_initialised
from ucm_db.errors import ConfigError, DamagedRecordError, FormatVersionError, TierError
from ucm_db.format.engine_dirs import detect_engine  # noqa: F401 - re-exported: the one engine reader
from ucm_db.format.names import (  # noqa: F401 - re-exported: the format's constants
    CREATED_KEY, FORMAT_VERSION_KEY, INFO_TABLE, MIN_MAP_BYTES, ON_DISK_ENGINES, SETTINGS_KEY, STORE_FORMAT_VERSION,
)

from ucm_db.index import changefeed
from ucm_db.index.records import SUM_PREFIX, DamagedRecord, check, get_checked, put_checked, record_sum, seal

if TYPE_CHECKING:
    from ucm_db.config import StoreConfig
    from ucm_db.engines.base import Buffer, Engine


def configured_map_bytes(config: StoreConfig) -> int:
    """The LMDB map size a store opened with ``config`` starts with."""
    return config.map_size_bytes or max(64 << 20, 2 * config.capacity_bytes + (256 << 20))


def open_engine(
    path: Path,
    engine: str,
    *,
    sync: bool,
    read_only: bool = False,
    map_size_bytes: int = MIN_MAP_BYTES,
    max_readers: int = 1024,
    check_pages: bool = True,
) -> Engine:
    """Builds the ``engine`` engine of the store directory ``path`` (created
    if missing; callers that must not create one check :func:`detect_engine`
    first). ``read_only``: RocksDB opens read-only; LMDB recovers at open as
    a writable open does, then writes nothing (``observe``: no snapshot pin,
    no sync record, ``write`` refused); :func:`open_lmdb_read_only` opens
    it ``MDB_RDONLY`` (a store this user cannot write). ``check_pages``:
    LMDB's page check before the first map (see
    :func:`ucm_db.engines.lmdb.checks.check_pages_at_open`); maintenance that
    runs its own check in a child process passes False."""
    if engine == "memory":
        from ucm_db.engines.memory import MemoryEngine

        return MemoryEngine()
    if engine == "rocksdb":
        from ucm_db.engines.rocksdb import RocksDbEngine

        return RocksDbEngine(Path(path) / "rocksdb", sync=sync, read_only=read_only)
    if engine != "lmdb":
        raise ConfigError(f"unknown engine {engine!r}", hint="use one of lmdb, rocksdb, memory")
    from ucm_db.engines.lmdb import LmdbEngine

    return LmdbEngine(Path(path) / "lmdb", map_size_bytes=map_size_bytes, sync=sync, max_readers=max_readers,
                      check_pages=check_pages, observe=read_only)


def open_lmdb_read_only(path: Path, *, map_size_bytes: int = MIN_MAP_BYTES, max_readers: int = 1024,
                        check_pages: bool = True) -> Engine:
    """The LMDB engine of the store directory ``path`` opened ``MDB_RDONLY``,
    writing nothing there (see :class:`~ucm_db.engines.lmdb.LmdbEngine`)."""
    from ucm_db.engines.lmdb import LmdbEngine

    return LmdbEngine(Path(path) / "lmdb", map_size_bytes=map_size_bytes, sync=True, max_readers=max_readers, read_only=True,
                      check_pages=check_pages)


def engine_shape(config: StoreConfig) -> tuple[str, bool, int]:
    """What of ``config`` the engine is built with: ``(engine, sync,
    initial map bytes)``. A store whose adopted settings give another shape
    than the engine it opened is opened again (see
    :func:`ucm_db.store.opening.open_store`)."""
    return config.engine, config.durability == "sync", configured_map_bytes(config)


def engine_for_config(path: Path, config: StoreConfig, *, check_pages: bool | None = None) -> Engine:
    """The engine :class:`~ucm_db.Store` opens for ``config`` at ``path``
    (``read_only``: writing nothing, see :class:`~ucm_db.engines.lmdb.LmdbEngine`).
    ``check_pages``: LMDB's page check before the first map (default: as
    ``config.check_on_open`` says; False where this process just checked)."""
    if check_pages is None:
        check_pages = config.check_on_open == "pages"
    if config.read_only and config.engine == "lmdb":
        return open_lmdb_read_only(path, map_size_bytes=configured_map_bytes(config), max_readers=config.max_readers,
                                   check_pages=check_pages)
    return open_engine(path, config.engine, sync=config.durability == "sync", read_only=config.read_only,
                       map_size_bytes=configured_map_bytes(config), max_readers=config.max_readers, check_pages=check_pages)


def creation_record() -> bytes:
    """The ``info/created`` record of a store this code creates."""
    from ucm_db.version import __version__

    record = {"ucm_db_version": __version__, "created_ns": time.time_ns(), "format_version": STORE_FORMAT_VERSION}
    return json.dumps(record, sort_keys=True).encode()


def check_format_version(version: int, path: Path) -> None:
    """Refuses stores of another format version, with the fix."""
    if version < STORE_FORMAT_VERSION:
        raise FormatVersionError(f"store at {path} has format {version}, this ucm-db reads {STORE_FORMAT_VERSION}", hint=f"run `ucm-db migrate {path}`")
    if version > STORE_FORMAT_VERSION:
        raise FormatVersionError(
            f"store at {path} has format {version}, newer than this ucm-db ({STORE_FORMAT_VERSION})",
            hint="upgrade ucm-db; older code never writes to a newer store",
        )


def write_format_version(txn: Any, version: int = STORE_FORMAT_VERSION) -> None:
    """Writes ``info/format_version`` with its checksum sidecar."""
    put_checked(txn, FORMAT_VERSION_KEY, str(version).encode())


def checked_format_version(txn: Any) -> bytes | None:
    """The raw ``info/format_version`` record, or None if absent; a record
    that fails its checksum is a :class:`DamagedRecordError` naming the damage."""
    value = txn.get(INFO_TABLE, FORMAT_VERSION_KEY)
    if value is None:
        return None
    try:
        check(txn, FORMAT_VERSION_KEY, value)
    except DamagedRecord:
        raise DamagedRecordError(f"the store's format version record is damaged (checksum mismatch, holds {bytes(value)[:16]!r})",
                          hint=_DAMAGED_HINT) from None
    return bytes(value)


def seal_format_records(txn: Any) -> int:
    """Adds checksums to the version and settings records older code wrote
    bare (at a writable open); returns how many were sealed."""
    return seal(txn, (FORMAT_VERSION_KEY, SETTINGS_KEY))


def damaged_format_records(txn: Any) -> list[tuple[str, str]]:
    """(record name, reason) of each damaged store-format record: the
    format version (not a decimal number, checksum mismatch), the settings
    (not a JSON object, checksum mismatch, a persisted value no config
    accepts) and the creation record (not a JSON object). Empty when whole."""
    found: list[tuple[str, str]] = []
    version = txn.get(INFO_TABLE, FORMAT_VERSION_KEY)
    if version is not None and not bytes(version).isdigit():
        found.append((FORMAT_VERSION_KEY.decode(), "not a decimal number"))
    elif version is not None:
        try:
            check(txn, FORMAT_VERSION_KEY, version)
        except DamagedRecord as exc:
            found.append((FORMAT_VERSION_KEY.decode(), exc.reason))
    created = txn.get(INFO_TABLE, CREATED_KEY)
    if created is not None:
        try:
            if not isinstance(json.loads(bytes(created)), dict):
                found.append((CREATED_KEY.decode(), "not a JSON object"))
        except (ValueError, UnicodeDecodeError):
            found.append((CREATED_KEY.decode(), "not JSON"))
    raw = txn.get(INFO_TABLE, SETTINGS_KEY)
    if raw is None:
        return found
    try:
        settings = parse_settings(raw)
        check(txn, SETTINGS_KEY, raw)
    except DamagedRecord as exc:
        return found + [(SETTINGS_KEY.decode(), exc.reason)]
    problem = persisted_settings_problem(settings)
    return found + [(SETTINGS_KEY.decode(), f"invalid value: {problem}")] if problem else found


def restorable_format_version(txn: Any) -> int | None:
    """The format version a store whose ``info/format_version`` record is
    damaged can be given back: the current one where its creation record
    (whole JSON) says this format created it; None where that cannot be told
    (an older store, whose later migrations no record names: never guessed).
    ``verify --fix`` rewrites the record with it; ``migrate`` refuses a
    damaged record, so this is the one repair."""
    created = txn.get(INFO_TABLE, CREATED_KEY)
    try:
        record = json.loads(bytes(created)) if created is not None else None
    except (ValueError, UnicodeDecodeError):
        return None
    if isinstance(record, dict) and record.get("format_version") == STORE_FORMAT_VERSION:
        return STORE_FORMAT_VERSION
    return None


def format_record_problems(engine: Engine) -> list[str]:
    """:func:`damaged_format_records` as the problem lines ``verify`` and
    ``inspect`` print (the same words as the tier's for its records)."""
    return [f"info record {name!r} is damaged: {reason}" for name, reason in engine.read(damaged_format_records)]


def check_persisted_settings(settings: dict[str, Any], path: Path) -> None:
    """Refuses a settings record whose persisted values no config accepts
    (a damaged or hand-edited record), naming the field and the value."""
    problem = persisted_settings_problem(settings)
    if problem is not None:
        raise DamagedRecordError(f"the settings record of the store at {path} is damaged: it holds an invalid value ({problem})",
                          hint=f"run `ucm-db verify {path}`; the store cannot be opened with it: move the store aside "
                               "(it is a cache and starts empty) or restore it from a copy")


_DAMAGED_HINT = "run `ucm-db verify` on the store; if it cannot repair it, move the store aside"


def parse_format_version(raw: bytes | None) -> int:
    """The format version in an ``info/format_version`` record."""
    if raw is None:
        raise ConfigError("the store records no format version: it was never initialised (the open that created it "
                          "stopped early: a full disk, a killed process) or is not a ucm-db store", hint=NEVER_INITIALISED_HINT)
    try:
        return int(bytes(raw))
    except ValueError:
        raise DamagedRecordError(f"the store's format version record is damaged ({bytes(raw)[:16]!r})", hint=_DAMAGED_HINT) from None


def read_format_version(engine: Engine) -> int:
    """The format version recorded in ``engine``'s store."""
    return parse_format_version(engine.read(checked_format_version))


def parse_settings(raw: Buffer | None) -> dict[str, Any]:
    """The one parser of the settings record: its JSON object ({} if the
    record is absent).

    Raises:
        DamagedRecord: the record is not a JSON object (each caller names
            the damage with its own error: see :func:`read_settings` and
            :func:`open_records`).
    """
    if raw is None:
        return {}
    try:
        settings = json.loads(bytes(raw))
    except (ValueError, UnicodeDecodeError):
        settings = None
    if not isinstance(settings, dict):
        raise DamagedRecord(SETTINGS_KEY, "not a JSON object")
    return settings


def read_settings(engine: Engine) -> dict[str, Any]:
    """The persisted settings recorded in ``engine``'s store ({} if none);
    a damaged record is a :class:`DamagedRecordError`."""
    def run(txn: Any) -> dict[str, Any]:
        try:
            return parse_settings(get_checked(txn, SETTINGS_KEY))
        except DamagedRecord:
            raise DamagedRecordError("the store's settings record is damaged", hint="run `ucm-db verify` on the store") from None

    return engine.read(run)


def write_new_store_records(txn: Any, settings: dict[str, Any]) -> None:
    """The info records of a store this code creates: the format version,
    the persisted ``settings``, the creation record and the change feed's
    head at a random start (:func:`ucm_db.index.changefeed.start`)."""
    write_format_version(txn)
    changefeed.start(txn)
    put_checked(txn, SETTINGS_KEY, json.dumps(settings, sort_keys=True).encode())
    txn.put(INFO_TABLE, CREATED_KEY, creation_record())


def settings_records_for_engine(raw: Buffer, engine_name: str) -> list[tuple[bytes, bytes]]:
    """The settings record ``raw`` rewritten for a store converted to
    ``engine_name``, with its renewed checksum sidecar, as (info key, value)
    pairs; a damaged record is a :class:`DamagedRecord`."""
    settings = parse_settings(raw)
    settings["engine"] = engine_name
    value = json.dumps(settings, sort_keys=True).encode()
    return [(SETTINGS_KEY, value), (SUM_PREFIX + SETTINGS_KEY, record_sum(SETTINGS_KEY, value))]


def open_records(txn: Any, wanted: dict[str, Any], path: Path, *, read_only: bool) -> tuple[int, dict[str, Any], bool]:
    """What :class:`~ucm_db.Store` reads of its info records when it opens
    (in its one transaction): ``(format version, persisted settings, created
    now)``. A store without a format version is initialised with ``wanted``
    (:func:`write_new_store_records`); read-only, that is a
    :class:`TierError`, and a damaged settings record a :class:`DamagedRecordError`."""
    version = checked_format_version(txn)
    if version is None:
        if read_only:
            raise TierError(never_initialised(path), hint=NEVER_INITIALISED_HINT)
        write_new_store_records(txn, wanted)
        return STORE_FORMAT_VERSION, wanted, True
    try:
        settings = parse_settings(get_checked(txn, SETTINGS_KEY))
    except DamagedRecord:
        raise DamagedRecordError(
            f"the settings record of the store at {path} is damaged",
            hint=f"run `ucm-db verify {path}` for a full report; move the store aside to start a new one",
        ) from None
    return parse_format_version(version), settings, False
