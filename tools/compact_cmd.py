"""``ucm-db compact``: evict to a target, drop dead records, shrink the files.

Steps, in order:
    1. Evict LRU blocks until stored bytes <= ``--target-bytes`` (in several
       short write transactions, so live writers are held up only briefly).
    2. Drop quarantine records and orphaned index entries (payloads, LRU,
       child links or upload-queue entries whose block has no metadata).
    3. Reclaim file space. LMDB: a compacting copy (``Environment.copy(...,
       compact=True)``) into a new file, fsynced, then renamed over
       ``data.mdb`` (atomic: a crash leaves the old or the new file, never a
       mix). RocksDB: a full manual compaction.

Safety with live processes: steps 1 and 2 are ordinary transactions, safe
beside other LMDB processes. Step 3 replaces the file other processes map,
so it runs only while this command holds the store's lock exclusively (no
process has the store open) and no other live process holds an LMDB reader
slot; otherwise it is skipped and the processes are named.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import click

from ucm_db.crashpoints import crashpoint
from ucm_db.errors import FormatVersionError, LockedError
from ucm_db.migrations.access import open_engine, read_format_version, require_store
from ucm_db.store import SETTINGS_KEY, STORE_FORMAT_VERSION
from ucm_db.storelock import StoreLock, describe, holders
from ucm_db.tiers.base import Engine, Txn
from ucm_db.tiers.local import LocalTier, lru_key, BlockMeta

from ucm_db.tools.cli_common import VIEW_LOCK_WAIT_S, emit, human_bytes, json_option, progress, warn

#: Eviction proceeds in about this many transactions...
EVICTION_STEPS = 16
#: ...each evicting about this many blocks at most.
MAX_EVICTIONS_PER_TXN = 256
_MAX_EVICTION_ROUNDS = 10_000


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def evict_to(tier: LocalTier, target_bytes: int, show_progress: bool) -> int:
    """Evicts LRU blocks until stored bytes <= target; returns blocks evicted."""
    totals = tier.totals()
    start = totals.stored_bytes
    # Bounded in blocks too: an engine that buffers a transaction's deletes
    # (RocksDB's overlay) rescans them for every victim.
    block_bytes = max(1, start // max(1, totals.blocks))
    step = max(1, min((start - target_bytes) // EVICTION_STEPS, MAX_EVICTIONS_PER_TXN * block_bytes))
    evicted = 0
    with progress(show_progress, max(0, start - target_bytes), "evicting") as bar:
        for _ in range(_MAX_EVICTION_ROUNDS):
            stored = tier.totals().stored_bytes
            if stored <= target_bytes:
                break
            tier.capacity_bytes = max(target_bytes, stored - step)
            evicted += tier.put_blocks([]).evicted
            bar.update(stored - tier.totals().stored_bytes)
    return evicted


def drop_quarantine(engine: Engine) -> int:
    def run(txn: Txn) -> int:
        keys = [k for k, _ in txn.scan("quarantine")]
        for key in keys:
            txn.delete("quarantine", key)
        return len(keys)
    return engine.write(run)


def drop_orphans(engine: Engine) -> dict[str, int]:
    """Deletes index entries whose block has no metadata (one transaction)."""
    def run(txn: Txn) -> dict[str, int]:
        def present(key: bytes) -> bool:
            return txn.get("meta", key) is not None

        dead: dict[str, list[bytes]] = {
            "blocks": [k for k, _ in txn.scan("blocks") if not present(k)],
            "heads": [k for k, _ in txn.scan("heads") if not present(k)],
            "uploads": [k for k, _ in txn.scan("uploads") if not present(k)],
            "children": [k for k, _ in txn.scan("children") if not (present(k[:32]) and present(k[32:]))],
            "lru": [k for k, _ in txn.scan("lru") if not _lru_matches(txn, k)],
        }
        for table, keys in dead.items():
            for key in keys:
                txn.delete(table, key)
        return {table: len(keys) for table, keys in dead.items()}
    return engine.write(run)


def _lru_matches(txn: Txn, lru: bytes) -> bool:
    data = txn.get("meta", lru[-32:])
    if data is None:
        return False
    meta = BlockMeta.unpack(data)
    return lru_key(meta.access_ns, meta.depth, lru[-32:]) == lru


def other_lmdb_readers(lmdb_dir: Path) -> list[int]:
    """Live pids other than ours in the LMDB reader table."""
    import lmdb

    env = lmdb.open(str(lmdb_dir), readonly=True, max_dbs=16, subdir=True)
    try:
        lines = env.readers().splitlines()[1:]
    finally:
        env.close()
    pids = set()
    for line in lines:
        parts = line.split()
        if parts and parts[0].isdigit() and int(parts[0]) != os.getpid() and _alive(int(parts[0])):
            pids.add(int(parts[0]))
    return sorted(pids)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def rewrite_lmdb(path: Path) -> None:
    """Compacting copy of ``path/lmdb/data.mdb``, renamed over it atomically.

    The caller holds the store's lock exclusively and no engine is open.
    """
    import lmdb

    lmdb_dir = path / "lmdb"
    for stale in path.glob("lmdb.compact-*"):  # left by a crashed compact
        shutil.rmtree(stale, ignore_errors=True)
    tmp = path / f"lmdb.compact-{os.getpid()}"
    tmp.mkdir(mode=0o700)
    try:
        env = lmdb.open(str(lmdb_dir), readonly=True, max_dbs=16, subdir=True)
        try:
            env.copy(str(tmp), compact=True)
        finally:
            env.close()
        new = tmp / "data.mdb"
        os.chmod(new, 0o600)
        _fsync(new)
        crashpoint("compact.during_switch")  # 1st: before the switch
        os.replace(new, lmdb_dir / "data.mdb")
        crashpoint("compact.during_switch")  # 2nd: switched, stale lock.mdb still there
        # No process has the environment open: its reader table is stale.
        (lmdb_dir / "lock.mdb").unlink(missing_ok=True)
        _fsync(lmdb_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def compact(path: Path, *, target_bytes: int | None, require_exclusive: bool, show_progress: bool) -> dict[str, Any]:
    """Runs the compaction steps (module docstring); returns the report."""
    engine_name = require_store(path)
    lock = StoreLock(path)
    exclusive = lock.try_exclusive()
    held_by = [] if exclusive else [p for p in holders(path) if p != os.getpid()]
    try:
        if not exclusive:
            if require_exclusive or engine_name == "rocksdb":
                why = "the rocksdb engine is single-process" if engine_name == "rocksdb" else "--require-exclusive was given"
                raise LockedError(f"cannot compact {path}: it is open in {describe(held_by)} ({why})",
                                  hint="stop or close those processes, then run ucm-db compact again")
            lock.acquire_shared(VIEW_LOCK_WAIT_S)
        report = {"path": str(path), "engine": engine_name, "exclusive": exclusive, "held_by": held_by,
                  "file_bytes_before": dir_bytes(path / engine_name)}
        report.update(_transactional_steps(path, engine_name, target_bytes, exclusive, show_progress))
        report["rewrite"] = _rewrite_step(path, engine_name, exclusive, held_by)
        report["file_bytes_after"] = dir_bytes(path / engine_name)
        return report
    finally:
        lock.release()


def _transactional_steps(path: Path, engine_name: str, target_bytes: int | None, exclusive: bool, show_progress: bool) -> dict[str, Any]:
    import json

    engine = open_engine(path, read_only=False, sync=True)
    try:
        version = read_format_version(engine)
        if version != STORE_FORMAT_VERSION:
            raise FormatVersionError(f"store at {path} has format {version}, this ucm-db compacts {STORE_FORMAT_VERSION}",
                                     hint=f"run `ucm-db migrate {path}` first" if version < STORE_FORMAT_VERSION else "upgrade ucm-db")
        settings = json.loads(bytes(engine.read(lambda txn: txn.get("info", SETTINGS_KEY)) or b"{}"))
        tier = LocalTier(engine, capacity_bytes=int(settings.get("capacity_bytes", 1 << 62)))
        before = tier.totals()
        evicted = evict_to(tier, target_bytes, show_progress) if target_bytes is not None else 0
        out = {"blocks_before": before.blocks, "stored_bytes_before": before.stored_bytes, "evicted_blocks": evicted,
               "quarantine_records_dropped": drop_quarantine(engine), "orphans_dropped": drop_orphans(engine)}
        if engine_name == "rocksdb" and exclusive:
            engine.compact()  # type: ignore[attr-defined]
        after = tier.totals()
        out.update(blocks_after=after.blocks, stored_bytes_after=after.stored_bytes, index_problems=tier.check())
        return out
    finally:
        engine.close()


def _rewrite_step(path: Path, engine_name: str, exclusive: bool, held_by: list[int]) -> str:
    if engine_name != "lmdb":
        return "rocksdb compaction" if exclusive else "skipped"
    if not exclusive:
        warn(f"file not rewritten: the store is open in {describe(held_by)}; freed pages are reused by LMDB, "
             "stop those processes and run compact again to shrink the file")
        return "skipped"
    readers = other_lmdb_readers(path / "lmdb")
    if readers:
        warn(f"file not rewritten: LMDB readers {describe(readers)} have the file open outside ucm-db's lock")
        return "skipped"
    rewrite_lmdb(path)
    return "rewritten"


def render(r: dict[str, Any]) -> str:
    lines = [
        f"blocks        {r['blocks_before']} -> {r['blocks_after']} ({r['evicted_blocks']} evicted)",
        f"stored bytes  {human_bytes(r['stored_bytes_before'])} -> {human_bytes(r['stored_bytes_after'])}",
        f"file bytes    {human_bytes(r['file_bytes_before'])} -> {human_bytes(r['file_bytes_after'])} ({r['rewrite']})",
        f"dropped       {r['quarantine_records_dropped']} quarantine records, orphans "
        + ", ".join(f"{t} {n}" for t, n in r["orphans_dropped"].items()),
    ]
    lines += [f"index problem: {p}" for p in r["index_problems"]]
    return "\n".join(lines)


@click.command("compact")
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--target-bytes", type=click.IntRange(min=0), default=None, help="Evict LRU blocks until at most this many stored bytes remain.")
@click.option("--require-exclusive", is_flag=True, help="Refuse (exit 2) instead of working beside processes that have the store open.")
@json_option
def compact_command(path: Path, target_bytes: int | None, require_exclusive: bool, as_json: bool) -> None:
    """Reclaim space: evict to --target-bytes, drop quarantine records and
    orphaned entries, and rewrite the LMDB file compactly (atomic switch).
    Beside live processes only the transactional steps run and the file
    rewrite is skipped with a warning naming them.

    \b
    Example:
        ucm-db compact /var/cache/ucm-db --target-bytes 50000000000
    """
    report = compact(path, target_bytes=target_bytes, require_exclusive=require_exclusive, show_progress=not as_json)
    emit(as_json, report, render)
    raise SystemExit(1 if report["index_problems"] else 0)
