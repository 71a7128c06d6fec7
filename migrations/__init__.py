"""Store format migrations: numbered, registered, each in one transaction.

A store records its format version in ``info/format_version``. Migration
``N`` moves a store from format ``N-1`` to ``N``; the modules named
``vNNNN_<name>.py`` in :mod:`ucm_db.migrations.versions` each define one
:class:`Migration` as ``MIGRATION`` and are registered on first use.

Invariants:
    * A migration runs in one engine write transaction together with the
      record that it ran (table ``migrations``, key ``%08d`` of its version)
      and the new ``format_version``: a store is at format ``N`` exactly when
      migration ``N`` (or creation at ``N``) committed, never half-way.
    * A failed migration raises :class:`~ucm_db.errors.MigrationError` and
      leaves the store at its previous version, untouched.
    * A store of a newer format than this code's is refused
      (:class:`NewerFormatError`) before anything opens it for writing, and
      a store needing no migration is not opened for writing either.
    * Migrating needs the store to itself: it holds the store's lock
      exclusively (see :mod:`ucm_db.storelock`) and refuses, naming them,
      while other processes have the store open.
    * Migrations never read stored payloads as code (no pickle); they move
      bytes and JSON only.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ucm_db.crashpoints import crashpoint
from ucm_db.errors import FormatVersionError, MigrationError
from ucm_db.format import STORE_FORMAT_VERSION, checked_format_version, parse_format_version, write_format_version
from ucm_db.engines.base import Txn

from ucm_db.migrations.access import exclusive_lock, format_read_only, open_engine, read_format_version, read_store

MIGRATIONS_TABLE = "migrations"
_MODULE_NAME = re.compile(r"^v(\d{4})_\w+$")


@dataclass(frozen=True, slots=True)
class Migration:
    """One format step.

    Attributes:
        version: the format version the store has after this migration.
        name: short identifier (the module name without its number).
        description: what changes, for ``ucm-db migrate --list``.
        upgrade: the change, run inside the migration's write transaction;
            it must not have effects outside ``txn`` (it may be re-run).
    """

    version: int
    name: str
    description: str
    upgrade: Callable[[Txn], None]


@dataclass(frozen=True, slots=True)
class AppliedMigration:
    """The record a migration left in the ``migrations`` table."""

    version: int
    name: str
    applied_ns: int
    ucm_db_version: str


class NewerFormatError(FormatVersionError, MigrationError):
    """The store's format is newer than this ucm-db's: migrations only go
    forward. A FormatVersionError, as opening the store is (and a
    MigrationError, as ``migrate`` raised before)."""


_registry: dict[int, Migration] = {}
_discovered = False


def register(migration: Migration) -> Migration:
    """Adds a migration to the registry (tests register extra ones)."""
    if migration.version in _registry and _registry[migration.version] is not migration:
        raise MigrationError(f"two migrations claim format version {migration.version}", hint="renumber one of them")
    _registry[migration.version] = migration
    return migration


def unregister(version: int) -> None:
    """Removes a migration registered by a test."""
    _registry.pop(version, None)


def registered() -> list[Migration]:
    """Every known migration, by version (modules are imported on first call)."""
    global _discovered
    if not _discovered:
        from ucm_db.migrations import versions

        for info in pkgutil.iter_modules(versions.__path__):
            match = _MODULE_NAME.match(info.name)
            if match:
                module = importlib.import_module(f"{versions.__name__}.{info.name}")
                migration = register(module.MIGRATION)
                if migration.version != int(match.group(1)):
                    raise MigrationError(f"module {info.name} defines version {migration.version}", hint="match the file name")
        _discovered = True
    return [_registry[v] for v in sorted(_registry)]


def applied(path: str | Path) -> list[AppliedMigration]:
    """Migrations recorded as applied to the store at ``path`` (read-only,
    of any format: :func:`~ucm_db.migrations.access.read_store`)."""
    records = read_store(Path(path), lambda txn: [json.loads(bytes(v)) for _, v in txn.scan(MIGRATIONS_TABLE)])
    return [AppliedMigration(r["version"], r["name"], r["applied_ns"], r["ucm_db_version"]) for r in records]


def pending(path: str | Path, target: int = STORE_FORMAT_VERSION) -> list[Migration]:
    """Migrations that would take the store at ``path`` to ``target`` (its
    format read without opening it for writing, whatever its format)."""
    return plan(format_read_only(Path(path)), target, path)


def plan(version: int, target: int, path: str | Path) -> list[Migration]:
    """The chain of migrations from ``version`` to ``target``."""
    if version > target:
        raise NewerFormatError(
            f"store at {path} has format {version}, newer than the target {target}",
            hint="upgrade ucm-db; migrations only go forward",
        )
    known = {m.version: m for m in registered()}
    steps = []
    for step in range(version + 1, target + 1):
        if step not in known:
            raise MigrationError(f"no migration to format {step} is registered", hint="upgrade ucm-db")
        steps.append(known[step])
    return steps


def migrate(
    path: str | Path,
    target: int = STORE_FORMAT_VERSION,
    *,
    on_step: Callable[[Migration], None] | None = None,
) -> list[Migration]:
    """Applies pending migrations in order; returns those applied.

    Raises:
        LockedError: other processes have the store open.
        MigrationError: a migration failed; the store stays at the format of
            the last migration that committed.
        NewerFormatError: (a FormatVersionError and a MigrationError) the
            store's format is newer than ``target``; nothing was written.
    """
    path = Path(path)
    with exclusive_lock(path):
        # A newer store is refused, and a current one left, before any writable open.
        if not plan(format_read_only(path), target, path):
            return []
        engine = open_engine(path, read_only=False, sync=True)
        try:
            steps = plan(read_format_version(engine), target, path)
            for migration in steps:
                _apply(engine, migration, path)
                if on_step is not None:
                    on_step(migration)
        finally:
            engine.close()
    return steps


def _apply(engine: Any, migration: Migration, path: Path) -> None:
    from ucm_db.version import __version__

    def run(txn: Txn) -> None:
        raw = checked_format_version(txn)
        found = 0 if raw is None else parse_format_version(raw)
        if found != migration.version - 1:
            raise MigrationError(f"store at {path} is at format {found}, expected {migration.version - 1}")
        migration.upgrade(txn)
        crashpoint("migrate.during_migration")
        record = {"version": migration.version, "name": migration.name, "applied_ns": time.time_ns(), "ucm_db_version": __version__}
        txn.put(MIGRATIONS_TABLE, b"%08d" % migration.version, json.dumps(record, sort_keys=True).encode())
        write_format_version(txn, migration.version)  # checksummed, as the store writes it

    try:
        engine.write(run)
    except MigrationError:
        raise
    except Exception as exc:
        raise MigrationError(f"migration {migration.version} ({migration.name}) of {path} failed: {exc}") from exc
    engine.sync()
