"""``ucm-db migrate``: format migrations, and conversion between engines.

Conversion (``--to-engine``) copies every table verbatim (payloads,
metadata, LRU order, hit counts, quarantine, upload queue, migration
records) from one read snapshot of the source into a new store directory,
changing only the recorded ``engine`` setting, and then verifies the copy:
same items in every table (an xxh3 digest per table), a clean index check,
and every block decoding under its key. A failed conversion removes the
half-made destination; the source is never written.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import click
import xxhash

from ucm_db import migrations
from ucm_db.errors import ConfigError, FormatVersionError, MigrationError
from ucm_db.store import SETTINGS_KEY, STORE_FORMAT_VERSION, detect_engine
from ucm_db.tiers.base import TABLES, Engine, Txn

from ucm_db.tools.cli_common import emit, json_option, progress, store_view
from ucm_db.tools.verify_cmd import verify_view

#: Items per destination write transaction.
COPY_BATCH_ITEMS = 512


def new_engine(dest: Path, engine: str) -> Engine:
    """A fresh engine directory for ``engine`` under ``dest``."""
    if engine == "rocksdb":
        from ucm_db.tiers.rocksdb import RocksDbEngine

        return RocksDbEngine(dest / "rocksdb", sync=False)
    from ucm_db.tiers.lmdb import LmdbEngine

    return LmdbEngine(dest / "lmdb", map_size_bytes=64 << 20, sync=False)


def table_digests(engine: Engine, *, ignore_settings: bool = True) -> dict[str, tuple[int, str]]:
    """(items, xxh3-128 of all items) per table, in key order."""
    def run(txn: Txn) -> dict[str, tuple[int, str]]:
        out = {}
        for table in TABLES:
            h = xxhash.xxh3_128()
            n = 0
            for key, value in txn.scan(table):
                if ignore_settings and table == "info" and key == SETTINGS_KEY:
                    continue
                h.update(len(key).to_bytes(4, "little") + key + len(value).to_bytes(8, "little"))
                h.update(value)
                n += 1
            out[table] = (n, h.hexdigest())
        return out
    return engine.read(run)


def copy_tables(source: Engine, dest: Engine, engine_name: str, total_items: int, show_progress: bool) -> None:
    """Copies every table from one read snapshot of ``source`` into ``dest``."""
    def run(txn: Txn) -> None:
        with progress(show_progress, total_items, "copying") as bar:
            batch: list[tuple[str, bytes, bytes]] = []
            for table in TABLES:
                for key, value in txn.scan(table):
                    if table == "info" and key == SETTINGS_KEY:
                        settings = json.loads(bytes(value))
                        settings["engine"] = engine_name
                        value = json.dumps(settings, sort_keys=True).encode()
                    batch.append((table, bytes(key), bytes(value)))
                    if len(batch) >= COPY_BATCH_ITEMS:
                        _write(dest, batch)
                        bar.update(len(batch))
                        batch = []
            _write(dest, batch)
            bar.update(len(batch))
    source.read(run)
    dest.sync()


def _write(dest: Engine, batch: list[tuple[str, bytes, bytes]]) -> None:
    if batch:
        dest.write(lambda txn: [txn.put(t, k, v) for t, k, v in batch])


def convert(source_path: Path, dest_path: Path, engine_name: str, show_progress: bool) -> dict[str, Any]:
    """Converts the store at ``source_path`` into a new ``engine_name`` store."""
    if dest_path.exists() and any(dest_path.iterdir()):
        raise ConfigError(f"destination {dest_path} exists and is not empty", hint="pass a new directory as DEST")
    with store_view(source_path) as view:
        if not view.current_format:
            raise FormatVersionError(f"store at {source_path} has format {view.format_version}",
                                     hint=f"run `ucm-db migrate {source_path}` first")
        if view.engine_name == engine_name:
            raise ConfigError(f"store at {source_path} already uses {engine_name}", hint="pick the other engine")
        source_digests = table_digests(view.engine)
        total = sum(n for n, _ in source_digests.values())
        dest_path.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            dest = new_engine(dest_path, engine_name)
            try:
                copy_tables(view.engine, dest, engine_name, total, show_progress)
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
    with store_view(dest_path) as view:
        report = verify_view(view, sample=None, seed=0, show_progress=False)
    if report.corrupt or report.index_problems:
        raise MigrationError(f"converted store fails verification: {len(report.corrupt)} corrupt, {report.index_problems[:3]}")
    return report.checked


def migrate_in_place(path: Path, *, dry_run: bool) -> dict[str, Any]:
    path = Path(path)
    # migrate() checks that no one else has the store before opening it.
    todo = migrations.pending(path) if dry_run else migrations.migrate(path)
    done = [] if dry_run else todo
    return {
        "path": str(path), "target_format": STORE_FORMAT_VERSION, "dry_run": dry_run,
        "pending": [{"version": m.version, "name": m.name, "description": m.description} for m in todo],
        "applied_now": [m.version for m in done],
        "applied": [{"version": a.version, "name": a.name, "applied_ns": a.applied_ns, "ucm_db_version": a.ucm_db_version}
                    for a in migrations.applied(path)],
    }


def render(r: dict[str, Any]) -> str:
    if "dest" in r:
        return f"converted {r['source']} -> {r['dest']} ({r['engine']}): {r['items']} items copied, {r['blocks_verified']} blocks verified"
    if not r["pending"]:
        return f"{r['path']} is at format {r['target_format']}: nothing to migrate"
    verb = "would apply" if r["dry_run"] else "applied"
    return "\n".join([f"{verb} {len(r['pending'])} migration(s) to {r['path']}:"]
                     + [f"  {m['version']:>4}  {m['name']}: {m['description']}" for m in r["pending"]])


@click.command("migrate")
@click.argument("path", type=click.Path(path_type=Path))
@click.argument("dest", required=False, type=click.Path(path_type=Path))
@click.option("--to-engine", type=click.Choice(["lmdb", "rocksdb"]), default=None, help="Convert PATH into a new store DEST using this engine.")
@click.option("--dry-run", is_flag=True, help="List pending migrations without applying them.")
@json_option
def migrate_command(path: Path, dest: Path | None, to_engine: str | None, dry_run: bool, as_json: bool) -> None:
    """Apply pending format migrations to the store at PATH, or with
    --to-engine convert it into a new store DEST (verified). Needs the
    store to itself: refuses while other processes have it open.

    \b
    Example:
        ucm-db migrate /var/cache/ucm-db
        ucm-db migrate --to-engine rocksdb /var/cache/ucm-db /var/cache/ucm-db-rocks
    """
    if to_engine is None:
        if dest is not None:
            raise ConfigError("DEST is only used with --to-engine", hint="ucm-db migrate --to-engine rocksdb PATH DEST")
        report = migrate_in_place(path, dry_run=dry_run)
    else:
        if dest is None:
            raise ConfigError("--to-engine needs a destination directory", hint="ucm-db migrate --to-engine rocksdb PATH DEST")
        if detect_engine(path) is None:
            raise ConfigError(f"no ucm-db store at {path}", hint="check the path")
        report = convert(path, dest, to_engine, show_progress=not as_json)
    emit(as_json, report, render)
