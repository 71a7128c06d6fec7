"""A store opened below the :class:`~ucm_db.Store` API, for maintenance.

Maintenance must look at stores the Store refuses (an older format, damaged
records) and must not disturb a live store while it looks: a view opens the
engine alone, writes no reader activity and takes the store's lock shared
(so a running ``compact``/``migrate`` is waited for, never raced).

Invariants:
    * :func:`open_view` never creates a store, nor a missing engine file: a
      path without a store, a store path that is a file, or an LMDB store
      without its ``data.mdb`` is a :class:`~ucm_db.errors.ConfigError`.
    * A view is read-only unless opened ``writable``: its LMDB engine
      refuses writes and pins no snapshot (``observe``,
      :mod:`ucm_db.engines.lmdb.engine`). A store directory this user
      cannot write is viewed without writing a byte (no lock file, the
      engine opened read-only), as ``ucm_db.open(read_only=True)`` would:
      ``ucm-db inspect`` and ``verify`` work on a read-only volume.
    * A damaged settings, format-version or creation record does not stop a
      view: it is listed in :attr:`StoreView.damaged` (maintenance exists to
      report damage), read as empty settings, format -1, no creation record.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from ucm_db.arguments import namespaces_selected, require_namespace_selectors
from ucm_db.errors import ConfigError, UcmDbError
from ucm_db.format import (
    CREATED_KEY, INFO_TABLE, STORE_FORMAT_VERSION, detect_engine, open_engine, open_lmdb_read_only, read_format_version,
    read_settings,
)
from ucm_db.storelock import hold_shared
from ucm_db.store.path import path_error
from ucm_db.engines.base import Engine, Txn
from ucm_db.engines.snapshot import SnapshotEngine
from ucm_db.index.local import LocalTier

T = TypeVar("T")
#: Progress callback of long maintenance operations: ``(done, total)``.
ProgressFn = Callable[[int, int], None]
#: Seconds a view waits for a running compact/migrate.
VIEW_LOCK_WAIT_S = 30.0
#: Capacity assumed for a store that records none (nothing is evicted).
UNLIMITED_BYTES = 1 << 62


@dataclass
class StoreView:
    """A store's engine and local tier, opened for maintenance."""

    path: Path
    engine_name: str
    engine: Engine
    tier: LocalTier
    format_version: int
    settings: dict[str, Any]
    created: dict[str, Any] | None
    #: One sentence per damaged store record found on opening.
    damaged: list[str] = field(default_factory=list)

    @property
    def current_format(self) -> bool:
        return self.format_version == STORE_FORMAT_VERSION

    @property
    def capacity_bytes(self) -> int:
        return int(self.settings.get("capacity_bytes", 0))

    def one_snapshot(self, fn: Callable[[StoreView], T]) -> T:
        """``fn`` of a view whose every read (of its engine and its tier) is
        one read transaction of this view's engine: a report built from
        several reads agrees with itself while writers commit. That view is
        valid only during the call, and writes nothing."""
        def run(txn: Txn) -> T:
            engine = SnapshotEngine(self.engine, txn)
            tier = LocalTier(engine, capacity_bytes=self.tier.limits.capacity_bytes)
            return fn(replace(self, engine=engine, tier=tier))
        return self.engine.read(run)


def check_store_path(path: Path) -> str:
    """The engine name of the existing store at ``path``, after checking that
    opening it creates nothing (see module invariants). A path this user
    cannot read, or one no file system takes, is an error naming it."""
    try:
        if path.exists() and not path.is_dir():
            raise ConfigError(f"{path} is a file, not a ucm-db store directory", hint="pass the directory given to ucm_db.open")
        name = detect_engine(path)  # both lmdb/ and rocksdb/: a ConfigError naming the fix
        data_file = path / "lmdb" / "data.mdb"
        has_data_file = data_file.is_file() if name == "lmdb" else True
    except OSError as exc:
        raise path_error(path, exc) from exc
    if name is None:
        raise ConfigError(f"no ucm-db store at {path}", hint="pass the directory given to ucm_db.open (it holds lmdb/ or rocksdb/)")
    if not has_data_file:
        raise ConfigError(
            f"store at {path} has an lmdb/ directory but no lmdb/data.mdb",
            hint="the store's data file is gone or was moved; restore it, or remove the directory to start empty",
        )
    return name


@contextmanager
def open_view(path: str | Path, *, writable: bool = False, check_pages: bool = True) -> Iterator[StoreView]:
    """Opens the existing store at ``path`` for maintenance (module
    invariants); ``check_pages=False``: without LMDB's page check at open (a
    caller reopening a store it has checked, e.g. a poll loop)."""
    path = Path(path)
    name = check_store_path(path)
    # A store the user cannot write (a read-only volume, a shared snapshot)
    # is viewed as a read-only Store opens it: nothing is created there.
    untouchable = not writable and not os.access(path, os.W_OK)
    lock = hold_shared(path, VIEW_LOCK_WAIT_S, read_only=untouchable)
    try:
        if untouchable and name == "lmdb":
            engine = open_lmdb_read_only(path, check_pages=check_pages)
        else:
            engine = open_engine(path, name, read_only=not writable, sync=True, check_pages=check_pages)
        try:
            damaged: list[str] = []
            no_settings: dict[str, Any] = {}
            settings = _tolerant(lambda: read_settings(engine), no_settings, "settings", damaged)
            version = _tolerant(lambda: read_format_version(engine), -1, "format_version", damaged)
            created_raw = engine.read(lambda txn: _copy(txn.get(INFO_TABLE, CREATED_KEY)))
            created = _json_or_none(created_raw)
            if created_raw is not None and created is None:
                damaged.append("info record 'created' is damaged: not a JSON object")
            capacity = _tolerant(lambda: int(settings.get("capacity_bytes", UNLIMITED_BYTES)), UNLIMITED_BYTES, "settings", damaged)
            yield StoreView(path, name, engine, LocalTier(engine, capacity_bytes=capacity), version, settings, created, damaged)
        finally:
            engine.close()
    finally:
        lock.release()


def select_namespaces(
    view: StoreView, wanted: tuple[str, ...], *, unique_prefixes: bool = False, undescribed: bool = False,
) -> set[bytes] | None:
    """Namespace ids matching ``wanted`` (model names or id hex prefixes);
    None means all (an empty ``wanted``). A selector that is a stored
    model's name selects that model's namespaces only, never also those
    whose id starts with it (a model named ``bf`` beside one whose id starts
    ``bf...``); a longer prefix or the full id names the other. With
    ``unique_prefixes`` (a destructive operation) an id prefix matching
    several namespaces is a ConfigError listing them. An empty or
    whitespace selector is a ConfigError, never "all"
    (:func:`ucm_db.arguments.require_namespace_selectors`).

    With ``undescribed``, the full 32-hex id of a namespace holding blocks
    without a recorded description also selects it (blocks promoted from a
    remote by ucm-db before promotions recorded one: no model to match, so
    only the whole id names it); a caller passing it must not need the
    description. Without it, such a namespace is listed as undescribed in
    the error that none matches."""
    wanted = require_namespace_selectors(wanted, "namespace selection")
    if not wanted:
        return None
    descriptions = view.tier.namespace_descriptions()
    models = {ns: d.get("model") for ns, d in descriptions.items()}
    bare = sorted(ns for ns, counts in view.tier.namespace_counts().items() if counts[0] and ns not in descriptions)

    def listed(ids: set[bytes] | dict[bytes, Any]) -> str:
        return ", ".join(f"{ns.hex()} ({descriptions[ns].get('model')})" for ns in sorted(ids)) or "none"

    def stored() -> str:
        rows = [listed(descriptions)] if descriptions else []
        rows += [f"{ns.hex()} (undescribed: no whole description is recorded, as where an older ucm-db promoted its blocks "
                 "from a remote or `verify --fix` found it damaged; its next put or promotion records it)" for ns in bare]
        return ", ".join(rows) or "none"

    chosen: set[bytes] = set()
    for item in wanted:
        found = namespaces_selected(item, models)
        if item not in models.values():
            if unique_prefixes and len(found) > 1:
                raise ConfigError(f"the id prefix {item!r} matches {len(found)} namespaces: {listed(found)}",
                                  hint="pass a model name, or a longer id prefix (`ucm-db inspect` lists them)")
        if not found and undescribed:
            found = {ns for ns in bare if ns.hex() == item.lower()}
        if not found:
            raise ConfigError(f"no namespace matches {item!r}",
                              hint=f"pass an id prefix or model name; the store has: {stored()}")
        chosen |= found
    return chosen


def _tolerant(read: Callable[[], T], fallback: T, record: str, damaged: list[str]) -> T:
    """``read()``, or ``fallback`` with the damage noted in ``damaged``."""
    try:
        return read()
    except (UcmDbError, ValueError, TypeError) as exc:
        damaged.append(f"info record {record!r} is damaged: {exc}")
        return fallback


def _json_or_none(raw: bytes | None) -> dict[str, Any] | None:
    """A JSON object record, or None if absent or unreadable (reported, not fatal)."""
    if raw is None:
        return None
    try:
        value = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    return value if isinstance(value, dict) else None


def _copy(value: Any) -> bytes | None:
    return None if value is None else bytes(value)
