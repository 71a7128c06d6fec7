"""``ucm-db migrate``: format migrations, and conversion between engines.

Migrations are :mod:`ucm_db.migrations`'; conversion (``--to-engine``, a
verified table-by-table copy into a new store) is
:mod:`ucm_db.maintenance.conversion`'s (:func:`ucm_db.maintenance.convert_engine`). This module parses and renders.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from ucm_db import STORE_FORMAT_VERSION, ConfigError, migrations
from ucm_db.maintenance import convert_engine as convert
from ucm_db.maintenance import convert_pre_unit_blocks

from ucm_db.tools.cli_common import CliPath, ProgressBar, emit, json_option


def migrate_in_place(path: Path, *, dry_run: bool) -> dict[str, Any]:
    path = Path(path)
    # migrate() checks that no one else has the store before opening it.
    todo = migrations.pending(path) if dry_run else migrations.migrate(path)
    done = [] if dry_run else todo
    # Then the blocks of the storage generations before units (ucm_db.maintenance.pre_units):
    # the connector refuses a store holding them. A dry run of an older format
    # cannot look (the store must be at the current format to be read).
    pre_units = None if dry_run and todo else convert_pre_unit_blocks(path, dry_run=dry_run).to_dict()
    return {
        "path": str(path), "target_format": STORE_FORMAT_VERSION, "dry_run": dry_run,
        "pending": [{"version": m.version, "name": m.name, "description": m.description} for m in todo],
        "applied_now": [m.version for m in done],
        "pre_unit_blocks": pre_units,
        "applied": [{"version": a.version, "name": a.name, "applied_ns": a.applied_ns, "ucm_db_version": a.ucm_db_version}
                    for a in migrations.applied(path)],
    }


def render(r: dict[str, Any]) -> str:
    if "dest" in r:
        return f"converted {r['source']} -> {r['dest']} ({r['engine']}): {r['items']} items copied, {r['blocks_verified']} blocks verified"
    verb = "would apply" if r["dry_run"] else "applied"
    lines = [f"{verb} {len(r['pending'])} migration(s) to {r['path']}:"] + [
        f"  {m['version']:>4}  {m['name']}: {m['description']}" for m in r["pending"]]
    pre = r.get("pre_unit_blocks")
    dropped = pre.get("dropped_blocks", 0) if pre else 0
    if pre and (pre["whole_blocks"] or pre["per_rank_blocks"] or pre["skipped_blocks"] or dropped):
        verb = "would convert" if r["dry_run"] else "converted"
        lines.append(f"{verb} blocks from before units: {pre['whole_blocks']} whole blocks split into "
                     f"{pre['units_written']} head units, {pre['per_rank_blocks']} per-rank blocks dropped (they cannot be re-keyed)"
                     + (f", {pre['skipped_blocks']} unreadable whole blocks dropped" if pre["skipped_blocks"] else "")
                     + (f", {dropped} whole blocks written off CPU dropped: not convertible, recomputed on demand" if dropped else ""))
    elif not r["pending"]:
        return f"{r['path']} is at format {r['target_format']}: nothing to migrate"
    return "\n".join(lines if r["pending"] else lines[1:])


@click.command("migrate")
@click.argument("path", type=CliPath())
@click.argument("dest", required=False, type=CliPath())
@click.option("--to-engine", type=click.Choice(["lmdb", "rocksdb"]), default=None, help="Convert PATH into a new store DEST using this engine.")
@click.option("--dry-run", is_flag=True, help="List pending migrations without applying them.")
@json_option
def migrate_command(path: Path, dest: Path | None, to_engine: str | None, dry_run: bool, as_json: bool) -> None:
    """Apply pending format migrations to the store at PATH (then convert
    blocks of the storage generations before units: whole blocks written on
    CPU split into head units; per-rank blocks and whole blocks written off
    CPU, whose KV layout is not recorded, dropped), or with
    --to-engine convert it into a new store DEST (verified), outside PATH:
    the copy is built beside DEST under a hidden temp name and renamed to
    DEST only when verified. Needs the store to itself: refuses while other
    processes have it open.

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
        if dry_run:  # it converted for real: a dry run that wrote DEST
            raise ConfigError("--dry-run lists pending format migrations; it does not apply to --to-engine",
                              hint="run without --dry-run: a conversion writes only DEST, renamed into place once "
                                   "verified, and never writes PATH")
        with ProgressBar(not as_json, "copying") as bar:
            report = convert(path, dest, to_engine, progress=bar)
    emit(as_json, report, render)
