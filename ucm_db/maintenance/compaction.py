"""Compaction: evict to a size, drop dead records, shrink the files.

Steps, in order:
    1. Evict LRU blocks until stored bytes <= ``target_bytes``, in several
       short write transactions (:meth:`LocalTier.evict_lru`), so live
       writers are held up only briefly. Pinned blocks are never evicted
       (:mod:`ucm_db.index.pins`): a target below the pinned bytes stops
       there.
    2. Drop quarantine records and orphaned index entries (payloads, LRU,
       child links or upload-queue entries whose block has no metadata):
       a read-only audit in sorted scans names the tables that may hold
       any, and only those are walked, in write transactions of at most
       about ``MAINTENANCE_CHUNK_KEYS`` entries each
       (:meth:`LocalTier.drop_orphans`). Memory and transaction size stay
       bounded on a store of millions of blocks. A block whose parent is
       not stored is quarantined with its descendants, missing LRU entries
       and child links are re-added a partition of ``meta`` per transaction
       (:func:`~ucm_db.maintenance.verification.restore_links`),
       and counters that disagree with the metadata are recounted (pin
       records that disagree with the blocks are rebuilt from the pins made
       at stored blocks).
    3. Reclaim file space. LMDB: a compacting copy (``Environment.copy(...,
       compact=True)``) into a new file, fsynced, then renamed over
       ``data.mdb`` (atomic: a crash leaves the old or the new file, never a
       mix). RocksDB: a full manual compaction.

Safety with live processes: steps 1 and 2 are ordinary transactions, safe
beside other LMDB processes. Step 3 replaces the file other processes map,
so it runs only while this process holds the store's lock exclusively (no
process has the store open) and no other live process holds an LMDB reader
slot; otherwise it is skipped and the processes are named in the report.
The rewrite copies every table, so pins survive it.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from ucm_db.arguments import require_limit
from ucm_db.crashpoints import crashpoint
from ucm_db.errors import DamagedRecordError, FormatVersionError, LockedError, TierError
from ucm_db.migrations.access import format_read_only
from ucm_db.format import STORE_FORMAT_VERSION, damaged_format_records, open_engine, read_format_version, read_settings
from ucm_db.store.view import UNLIMITED_BYTES, VIEW_LOCK_WAIT_S, ProgressFn, check_store_path
from ucm_db.storelock import StoreLock, describe, holders
from ucm_db.index.local import LocalTier
from ucm_db.maintenance.verification import (
    PARENT_MISSING, counters_damaged, lineage_problems, links_missing, restore_links, still_damaged,
)

logger = logging.getLogger("ucm_db")
#: Eviction proceeds in about this many transactions...
EVICTION_STEPS = 16
#: ...each evicting about this many blocks at most.
MAX_EVICTIONS_PER_TXN = 256


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def evict_to(tier: LocalTier, target_bytes: int, progress: ProgressFn | None = None) -> int:
    """Evicts LRU blocks until stored bytes <= ``target_bytes``; returns
    blocks evicted. Each transaction evicts about 1/EVICTION_STEPS of the
    excess, and at most MAX_EVICTIONS_PER_TXN blocks (an engine that buffers
    a transaction's deletes, RocksDB's overlay, rescans them per victim)."""
    totals = tier.totals()
    start = totals.stored_bytes
    block_bytes = max(1, start // max(1, totals.blocks))
    step_bytes = max(1, (start - target_bytes) // EVICTION_STEPS)
    max_blocks = max(1, min(MAX_EVICTIONS_PER_TXN, step_bytes // block_bytes))
    evicted = 0
    while True:
        stored = tier.totals().stored_bytes
        if stored <= target_bytes:
            break
        count = tier.evict_lru(max(target_bytes, stored - step_bytes), max_blocks)
        if count == 0 and tier.totals().stored_bytes >= stored:  # nothing left to evict (a damaged block set aside is progress)
            break
        evicted += count
        if progress is not None:
            progress(start - tier.totals().stored_bytes, start - target_bytes)
    return evicted


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

    Where a quarantine left stuck payloads (:mod:`ucm_db.index.damage`), the
    copy is made table by table without them (:mod:`ucm_db.engines.lmdb.copy`).
    The caller holds the store's lock exclusively and no engine is open.

    Raises:
        TierError: the copy could not be written (a full disk, a damaged
            page); the store's files are as they were (the copy is removed,
            the switch never happened).
    """
    import lmdb

    from ucm_db.engines.lmdb import copy_leaving, drop_sync_record, stuck_keys

    lmdb_dir = path / "lmdb"
    for stale in path.glob("lmdb.compact-*"):  # left by a crashed compact
        shutil.rmtree(stale, ignore_errors=True)
    tmp = path / f"lmdb.compact-{os.getpid()}"
    try:
        try:
            tmp.mkdir(mode=0o700)
            env = lmdb.open(str(lmdb_dir), readonly=True, max_dbs=16, subdir=True)
            try:
                stuck = stuck_keys(env)
                if not stuck:
                    try:
                        env.copy(str(tmp), compact=True)
                    except lmdb.Error as exc:
                        if disk_full(exc):
                            raise
                        # A damaged page LMDB's page walk refuses (a zeroed
                        # overflow page): copy entry by entry instead, which
                        # reads values as a get does (verify then finds a
                        # damaged value as an ordinary corrupt block).
                        logger.warning("ucm-db: compacting copy of %s failed (%s); copying table by table", path, exc)
                        shutil.rmtree(tmp)
                        tmp.mkdir(mode=0o700)
                        stuck = {b""}  # none: the empty key is never a block key
                if stuck:
                    copy_leaving(env, tmp, stuck)
            finally:
                env.close()
            new = tmp / "data.mdb"
            os.chmod(new, 0o600)
            _fsync(new)
        except (lmdb.Error, OSError) as exc:
            raise _rewrite_error(path, exc) from exc
        crashpoint("compact.during_switch")  # 1st: before the switch
        os.replace(new, lmdb_dir / "data.mdb")
        crashpoint("compact.during_switch")  # 2nd: switched, stale lock.mdb still there
        # No process has the environment open: its reader table is stale.
        (lmdb_dir / "lock.mdb").unlink(missing_ok=True)
        # Sync records name the old file's snapshots: a rollback must never
        # apply one to the new file (ext4 may give it the old inode number back).
        drop_sync_record(lmdb_dir)
        _fsync(lmdb_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _rewrite_error(path: Path, exc: BaseException) -> TierError:
    """The TierError for a rewrite that failed before the switch."""
    data_bytes = (path / "lmdb" / "data.mdb").stat().st_size
    if disk_full(exc):
        return TierError(
            f"compact could not rewrite {path}: the disk is full ({exc}); the store is unchanged by the rewrite "
            f"(blocks evicted before it stay evicted)",
            hint=f"free up to {data_bytes} bytes on the disk holding {path} (the rewrite writes a compacted copy of the "
                 f"data file beside it) and run ucm-db compact again, or skip the rewrite: the store works as it is",
        )
    return TierError(
        f"compact could not rewrite {path}: {exc}; the store is unchanged by the rewrite",
        hint=f"run `ucm-db verify {path}` to see the damage (`--fix` quarantines what it finds), then compact again",
    )


def disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` says the disk is full (an errno, LMDB's or RocksDB's message)."""
    import lmdb

    return getattr(exc, "errno", None) == errno.ENOSPC or isinstance(exc, lmdb.DiskError) or "No space left" in str(exc)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def compact(path: str | Path, *, target_bytes: int | None = None, require_exclusive: bool = False,
            progress: ProgressFn | None = None) -> dict[str, Any]:
    """Runs the compaction steps (module docstring); returns the report.

    Raises:
        LockedError: other processes have the store open and
            ``require_exclusive`` was given (or the engine is RocksDB).
        FormatVersionError: the store is of another format.
    """
    require_limit("target_bytes", target_bytes, integer=True)  # a negative target evicted every block
    path = Path(path)
    engine_name = check_store_path(path)
    lock = StoreLock(path)
    exclusive = lock.try_exclusive()
    held_by = [] if exclusive else [p for p in holders(path) if p != os.getpid()]
    try:
        if not exclusive:
            if require_exclusive or engine_name == "rocksdb":
                why = "the rocksdb engine is single-process" if engine_name == "rocksdb" else "exclusive use was required"
                raise LockedError(f"cannot compact {path}: it is open in {describe(held_by)} ({why})",
                                  hint="stop or close those processes, then run ucm-db compact again")
            lock.acquire_shared(VIEW_LOCK_WAIT_S)
        _refuse_other_format(path, format_read_only(path))  # before a writable open: RocksDB's replays its log
        report: dict[str, Any] = {"path": str(path), "engine": engine_name, "exclusive": exclusive, "held_by": held_by,
                                  "file_bytes_before": dir_bytes(path / engine_name)}
        report.update(_transactional_steps(path, engine_name, target_bytes, exclusive, progress))
        report["rewrite"], report["rewrite_skipped_because"] = _rewrite_step(path, engine_name, exclusive, held_by)
        report["file_bytes_after"] = dir_bytes(path / engine_name)
        return report
    finally:
        lock.release()


def _refuse_other_format(path: Path, version: int) -> None:
    if version != STORE_FORMAT_VERSION:
        raise FormatVersionError(f"store at {path} has format {version}, this ucm-db compacts {STORE_FORMAT_VERSION}",
                                 hint=f"run `ucm-db migrate {path}` first" if version < STORE_FORMAT_VERSION else "upgrade ucm-db")


def _transactional_steps(path: Path, engine_name: str, target_bytes: int | None, exclusive: bool,
                         progress: ProgressFn | None) -> dict[str, Any]:
    engine = open_engine(path, engine_name, read_only=False, sync=True)
    try:
        _refuse_other_format(path, read_format_version(engine))
        damaged = engine.read(damaged_format_records)
        if damaged:
            # A store that open refuses is not rewritten (issue 46: compact kept
            # sealed settings with capacity_bytes=-5 and evicted by them).
            name, reason = damaged[0]
            raise DamagedRecordError(f"the {name} record of the store at {path} is damaged ({reason}): not compacted",
                                     hint=f"run `ucm-db verify --fix {path}`; if it cannot repair it, move the store aside")
        capacity = int(read_settings(engine).get("capacity_bytes", UNLIMITED_BYTES))
        tier = LocalTier(engine, capacity_bytes=capacity)
        before = tier.totals()
        evicted = evict_to(tier, target_bytes, progress) if target_bytes is not None else 0
        quarantine_dropped = tier.drop_quarantine_records()
        orphans_dropped, index_problems = tier.drop_orphans_and_check()  # one audit of the index when nothing is dropped
        parentless = _quarantine_parentless(tier, index_problems)
        links_restored = {"lru": 0, "children": 0}
        if links_missing(index_problems):
            links_restored = restore_links(tier)  # chunked: live writers wait for one partition at a time
        if parentless or links_missing(index_problems):
            index_problems = tier.check()
        if counters_damaged(index_problems):
            tier.recompute_totals()
            index_problems = tier.check()
        out = {"blocks_before": before.blocks, "stored_bytes_before": before.stored_bytes, "evicted_blocks": evicted,
               "quarantine_records_dropped": quarantine_dropped, "orphans_dropped": orphans_dropped,
               "parentless_quarantined": parentless, "links_restored": links_restored}
        if engine_name == "rocksdb" and exclusive:
            engine.compact()  # type: ignore[attr-defined]
        after = tier.totals()
        out.update(blocks_after=after.blocks, stored_bytes_after=after.stored_bytes, index_problems=index_problems,
                   pinned_bytes_after=sum(stored for _blocks, stored in tier.pin_counts().values()))
        return out
    finally:
        engine.close()


def _quarantine_parentless(tier: LocalTier, index_problems: list[str]) -> int:
    """Quarantines every block whose parent is not stored, with its
    descendants, as ``verify --fix`` does (lookup stops before such a block,
    so it is dead weight); returns how many blocks went. The metadata is
    scanned only when the audit named such a block. Each is judged again in
    its quarantine's transaction: a parent a live writer stored again since
    the scan makes it reachable, and it stays."""
    if not any("parent missing" in p for p in index_problems):
        return 0
    before = tier.totals().blocks
    for key, reason in sorted(lineage_problems(tier.scan_metas(), set(tier.iterate())).items()):
        if reason == PARENT_MISSING:
            tier.quarantine(key, f"ucm-db compact: {reason}", lambda _head, _body: True, still_damaged=still_damaged(reason))
    return before - tier.totals().blocks


def _rewrite_step(path: Path, engine_name: str, exclusive: bool, held_by: list[int]) -> tuple[str, str | None]:
    """("rewritten" | "rocksdb compaction" | "skipped", why skipped)."""
    if engine_name != "lmdb":
        return ("rocksdb compaction", None) if exclusive else ("skipped", f"the store is open in {describe(held_by)}")
    if not exclusive:
        return "skipped", (f"the store is open in {describe(held_by)}; freed pages are reused by LMDB, "
                           "stop those processes and run compact again to shrink the file")
    readers = other_lmdb_readers(path / "lmdb")
    if readers:
        return "skipped", f"LMDB readers {describe(readers)} have the file open outside ucm-db's lock"
    rewrite_lmdb(path)
    return "rewritten", None
