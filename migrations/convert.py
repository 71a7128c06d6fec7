"""Conversion of a store to another engine (``ucm-db migrate --to-engine``).

Conversion copies every table verbatim (payloads, metadata, LRU order, hit
counts, quarantine, upload queue, migration records) from one read snapshot
of the source into a new store directory, changing only the recorded
``engine`` setting, and then verifies the copy: same items in every table
(an xxh3 digest per table), a clean index check, and every block decoding
under its key.

Invariants:
    * The source is never written; a failed conversion removes the
      half-made destination.
    * The destination must be new or an empty directory.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import xxhash

from ucm_db.errors import ConfigError, FormatVersionError, MigrationError
from ucm_db.format import INFO_TABLE, SETTINGS_KEY, open_engine
from ucm_db.tiers import records
from ucm_db.store_view import ProgressFn, check_store_path, open_view
from ucm_db.tiers.base import TABLES, Engine, Txn
from ucm_db.verification import verify_view

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
                if table == INFO_TABLE and key == SETTINGS_KEY:
                    settings = json.loads(bytes(value))
                    settings["engine"] = engine_name
                    value = json.dumps(settings, sort_keys=True).encode()
                    batch.append((table, SETTINGS_SUM_KEY, records.record_sum(SETTINGS_KEY, value)))  # its checksum, renewed
                elif table == INFO_TABLE and key == SETTINGS_SUM_KEY:
                    continue
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
    if batch:
        dest.write(lambda txn: [txn.put(t, k, v) for t, k, v in batch])
    return len(batch)


def convert(source_path: str | Path, dest_path: str | Path, engine_name: str, progress: ProgressFn | None = None) -> dict[str, Any]:
    """Converts the store at ``source_path`` into a new ``engine_name`` store
    at ``dest_path`` (module invariants); returns the report."""
    source_path, dest_path = Path(source_path), Path(dest_path)
    check_store_path(source_path)
    if dest_path.exists() and (not dest_path.is_dir() or any(dest_path.iterdir())):
        raise ConfigError(f"destination {dest_path} is not empty (or is a file)", hint="pass a new directory as DEST")
    with open_view(source_path) as view:
        if not view.current_format:
            raise FormatVersionError(f"store at {source_path} has format {view.format_version}",
                                     hint=f"run `ucm-db migrate {source_path}` first")
        if view.engine_name == engine_name:
            raise ConfigError(f"store at {source_path} already uses {engine_name}", hint="pick the other engine")
        if any("settings" in problem for problem in view.damaged):
            # The copy renews the record's checksum: it must not launder an altered record.
            raise MigrationError(f"the settings record of the store at {source_path} is damaged; it is not converted",
                                 hint=f"run `ucm-db verify {source_path}` for a report; the store is a cache: start a new one")
        source_digests = table_digests(view.engine)
        total = sum(n for n, _ in source_digests.values())
        dest_path.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            dest = open_engine(dest_path, engine_name, sync=False, map_size_bytes=DEST_MAP_BYTES)
            try:
                copy_tables(view.engine, dest, engine_name, total, progress)
                dest_digests = table_digests(dest)
            finally:
                dest.close()
            if dest_digests != source_digests:
                bad = [t for t in TABLES if dest_digests[t] != source_digests[t]]
                raise MigrationError(f"converted copy differs from the source in tables {', '.join(bad)}")
            blocks = verify_converted(dest_path)
        except BaseException:
            shutil.rmtree(dest_path, ignore_errors=True)
            raise
    return {"source": str(source_path), "dest": str(dest_path), "engine": engine_name, "items": total,
            "blocks_verified": blocks, "tables": {t: n for t, (n, _) in source_digests.items()}}


def verify_converted(dest_path: Path) -> int:
    """Opens the new store as users will and decodes every block."""
    import ucm_db

    ucm_db.open(dest_path).close()  # format and settings accepted by the Store
    with open_view(dest_path) as view:
        report = verify_view(view)
    if report.problems:
        raise MigrationError(f"converted store fails verification: {len(report.corrupt)} corrupt, {report.index_problems[:3]}")
    return report.checked
