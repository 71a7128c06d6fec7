"""Group durability that a power loss cannot damage: recorded, pinned synced snapshots.

``durability="group"`` commits with LMDB's MDB_NOSYNC (a commit reaches the
OS page cache, not the disk) and syncs in the background. A process crash
loses nothing. A power loss can leave on disk any subset of the pages
written since the last sync, including a meta page naming pages that never
arrived. This module turns that into "the store is as it was at the last
completed sync":

* A sync (:meth:`SnapshotPin.sync`) begins a read transaction on the newest
  snapshot ``S``, copies ``S``'s meta page with ``pread``, ``fdatasync``\\ s
  the data file (``S`` and everything before it is now on disk) and writes
  ``S`` into this process's sync record (:mod:`ucm_db.engines.lmdb.records`:
  one file per process, two slots written alternately in place; no lock
  shared between processes, so a process stopped or killed while it
  records holds up no other). The read transaction stays open as the
  process's *pin*.
* A pin on snapshot ``P`` keeps LMDB from reusing any page freed after
  ``P``: LMDB reuses a page freed by transaction ``F`` only once no reader
  is at a snapshot before ``F``.
* :func:`roll_back_after_os_crash`, at open, under the recovery lock: if the
  newest record was written under another boot (the machine went down
  since) and the data file's newest meta page is newer than it, the commits
  after it may be torn: both meta pages are rewritten to its (fsynced), and
  LMDB opens that snapshot, whose pages are all on disk and untouched.

Invariants:
    1. A record's snapshot is on disk before the record is written, and a
       record counts once it is durable (records.py: its slot fdatasynced,
       its file's name fsynced into the directory).
    2. A process commits only while it holds a pin on a snapshot no newer
       than a durable record (:meth:`SnapshotPin.before_commit`): the one
       it recorded last, or, where nothing was committed since a durable
       record of this boot, that record's snapshot.
    3. A pin ends only once a newer one is held (after the newer record is
       durable), or once no commit of this process followed the snapshot it
       last recorded (:meth:`SnapshotPin.release_if_idle`, after each sync);
       its next commit pins again first (2). A process that only reads
       never pins: stopped (SIGSTOP) or slow, it grows no one's file. A
       process stopped while it writes keeps its pin, as any LMDB reader
       does (``ucm_db.store.background`` names it once the file grows).
    4. Hence the record ``R`` a rollback lands on (the newest durable one
       when the power went; the newest only grows) has intact pages: a
       commit after ``R`` and before ``R`` was durable ran while ``R``'s
       recorder held its read transaction on ``R``; one after ran under a
       pin no newer than a record durable then, so no newer than ``R``
       (2): no page freed after ``R`` was reused. No process relies on
       another's pin, so dead readers' slots are cleared at every open and
       every recorded sync (``reader_check``), and a process that closes or
       idles lets its pin go at once.
    5. The rollback takes the newest valid record of the current data file
       (records.py), only after a reboot, and only if the file's newest
       meta page is newer than it or a meta page is damaged. A record newer
       than both intact meta pages is not of this file's history (the disk
       lied, or an inode was reused): the newest record no newer than them
       is taken. The target is then recorded again under this boot, before
       anything commits, so the next open of this boot rolls nothing back.
    6. After a process crash (same boot) nothing is rolled back: the page
       cache still holds every commit.
    7. Without a boot id (not Linux, no ``UCM_DB_BOOT_ID``) nothing is
       recorded, pinned or rolled back, and group durability keeps LMDB's
       own MDB_NOSYNC risk.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lmdb

from ucm_db.errors import TierError
from ucm_db.engines.lmdb import records
from ucm_db.engines.lmdb.meta import read_meta_pages, write_meta_body
from ucm_db.engines.lmdb.records import RECORD_FILE, SyncRecord
from ucm_db.engines.lmdb.recovery import boot_id

__all__ = ["RECORD_FILE", "RollbackReport", "SnapshotPin", "SyncRecord", "drop_record", "has_record", "late_pin", "read_record",
           "roll_back_after_os_crash"]

#: Attempts to copy a snapshot's meta page before two newer commits replace it.
_META_COPY_TRIES = 8

logger = logging.getLogger("ucm_db")


@dataclass(frozen=True)
class RollbackReport:
    """What :func:`roll_back_after_os_crash` did."""

    from_txnid: int   # the newest meta page on disk after the crash
    to_txnid: int     # the synced snapshot the store now opens


def read_record(env_dir: Path) -> SyncRecord | None:
    """The newest valid sync record of the environment's data file as it is
    now, or None (:func:`ucm_db.engines.lmdb.records.newest`)."""
    return records.newest(env_dir)


def has_record(env_dir: Path) -> bool:
    """Whether a group process has recorded a snapshot of this environment."""
    return records.exist(env_dir)


def drop_record(env_dir: Path) -> None:
    """Removes the environment's sync records, for a new file written whole
    and synced (a conversion's copy): it starts without one, as any new
    store does, and a group process's first sync records it."""
    records.remove_all(env_dir)


class SnapshotPin:
    """One engine's pin and sync records of one environment (module
    invariants 1-3). Thread-safe. The engine calls :meth:`before_commit`
    and :meth:`committed` around each commit under its write lock, and
    :meth:`release_if_idle` after a sync, holding that lock (no commit of
    its own under way). Create a new one
    after ``fork`` (transactions do not cross it) and call :meth:`release`
    before the environment closes."""

    def __init__(self, env_dir: Path) -> None:
        self._dir = env_dir
        self._boot = boot_id()
        self._lock = threading.Lock()
        self._pin: Any = None  # the read transaction of invariant 2
        self._commits, self._committing = 0, False  # this engine's commits so far; one begun, not counted yet
        self._covered = 0      # of those, the ones in the snapshot last recorded or pinned
        self._durable_txnid = -1  # the newest record of this boot known durable

    def before_commit(self, env: lmdb.Environment) -> None:
        """Pins, where no pin is held, before a commit (invariant 2): the
        newest snapshot, recorded first unless a durable record of this
        boot is at least as new. Raises as :meth:`sync`."""
        self._committing = True  # visible to readers before it is counted: a sync meanwhile must not skip it
        if self._boot is None or self._pin is not None:
            return  # a pin held stays until this commit is done: it is ended only where none is under way
        with self._lock:
            if self._pin is None:
                self._record(env)

    def committed(self) -> None:
        """Counts a commit of this engine, after it committed, under the engine's write lock (one at a time; a
        sync only reads the count: commits never wait for a sync's fdatasync)."""
        self._commits, self._committing = self._commits + 1, False

    def sync(self, env: lmdb.Environment) -> None:
        """Makes every commit of this engine durable and records (and pins)
        the newest snapshot; nothing to do where none came after the
        snapshot last recorded (another process's commits are its own to
        sync). The meta page is copied while writers go on; where two
        commits raced every copy (commits are flowing, so LMDB's writer
        lock comes soon), it is copied again under that lock, held by an
        empty write transaction, and no commit can replace it then.

        Raises OSError where the file cannot be synced, :class:`TierError`
        where the record cannot be written (the caller must not call the
        commits durable), and
        ``lmdb.MapResizedError`` when another process grew the map (the
        caller adopts the size and calls again)."""
        if self._boot is None:
            env.sync(True)  # nothing is recorded without a boot id (invariant 7)
            return
        with self._lock:
            if self._commits != self._covered or self._committing:  # a commit readers see may not be counted yet
                self._record(env)

    def release_if_idle(self) -> None:
        """Ends the pin where no commit of this engine followed the
        snapshot last recorded (invariant 3). Call only where no commit of
        this engine is under way."""
        with self._lock:
            if self._pin is not None and self._commits == self._covered:
                self._pin.abort()
                self._pin = None

    def _record(self, env: lmdb.Environment) -> None:
        """Pins the newest snapshot: adopted where a durable record is at
        least as new, else synced and recorded (invariant 1); the previous
        pin ends only then."""
        commits = self._commits
        snapshot = self._raced_snapshot(env)
        if snapshot is not None and snapshot[0] is None:  # commits raced every copy
            snapshot = self._fenced_snapshot(env)
        if snapshot is None:
            self._covered = commits  # the pinned snapshot is the newest: recorded and durable
            return
        txn, meta = snapshot
        try:
            if meta is not None:
                env.sync(True)
                inode, generation = records.data_identity(self._dir) or (0, 0)
                self._write(SyncRecord(txn.id(), inode, self._boot or "", meta, generation))
        except BaseException:
            txn.abort()
            raise
        previous, self._pin, self._covered = self._pin, txn, commits
        if previous is not None:
            previous.abort()
        if meta is not None:
            self._clean_up(env, txn.id())

    def _clean_up(self, env: lmdb.Environment, durable_txnid: int) -> None:
        """Removes stale record files and dead readers' slots (invariant 4),
        after the new record is durable: a failure is logged, never raised
        (the commits it follows are durable and recorded)."""
        try:
            records.remove_stale(self._dir, durable_txnid)
            env.reader_check()  # no process relies on a dead one's pin (invariant 4)
        except (OSError, lmdb.Error) as exc:
            logger.warning("ucm-db: %s: cleaning up after a recorded sync failed (%s); retried at the next", self._dir, exc)

    def _write(self, record: SyncRecord) -> None:
        """Records ``record`` (synced), or raises :class:`TierError`."""
        try:
            records.write_own(self._dir, record)
        except OSError as exc:
            raise TierError(
                f"{self._dir}: synced, but its snapshot could not be recorded ({exc}): a power loss could still "
                "undo the commits since the last record",
                hint=f"make {self._dir} writable, with free space (its synced-snapshot.* files), then retry",
            ) from exc
        self._durable_txnid = max(self._durable_txnid, record.txnid)

    def _raced_snapshot(self, env: lmdb.Environment) -> tuple[Any, bytes | None] | None:
        """The newest snapshot's read transaction and meta body (None where
        a durable record covers it: nothing to record), copied without
        stopping writers; None when it is the pinned one, (None, None) when
        commits raced every copy."""
        for _ in range(_META_COPY_TRIES):
            txn = env.begin(write=False)
            try:
                if self._pin is not None and txn.id() == self._pin.id():
                    txn.abort()
                    return None
                if self._covered_by_a_record(txn.id()):
                    return txn, None
                meta = self._meta_of(txn.id())
            except BaseException:
                txn.abort()  # a read transaction left open would pin its snapshot
                raise
            if meta is not None:
                return txn, meta
            txn.abort()  # two newer commits replaced its meta page: take a newer snapshot
        return None, None

    def _fenced_snapshot(self, env: lmdb.Environment) -> tuple[Any, bytes | None] | None:
        """As :meth:`_raced_snapshot`, with LMDB's writer lock held (an
        empty write transaction, aborted) while the snapshot begins and its
        meta page is copied: no commit of any process lands meanwhile, so
        the newest meta page is the snapshot's and the copy succeeds.
        (Fenced only then: a writer stopped inside a transaction in another
        process would hold every fenced sync.)"""
        fence = env.begin(write=True)
        try:
            txn = env.begin(write=False)
            if self._pin is not None and txn.id() == self._pin.id():
                txn.abort()
                return None
            try:
                meta = self._meta_of(txn.id())
            except BaseException:
                txn.abort()
                raise
        finally:
            fence.abort()
        if meta is None:  # cannot happen under the fence: a meta page not where LMDB keeps it
            txn.abort()
            raise TierError(f"{self._dir}: the newest snapshot's meta page is not in data.mdb's meta slots")
        return txn, meta

    def _covered_by_a_record(self, txnid: int) -> bool:
        """Whether a durable record of this boot is at least as new as
        ``txnid``: this process's, or another's once its file and the
        directory are synced here (records.py). Records of other boots do
        not count (invariant 5 may pass them over)."""
        assert self._boot is not None
        self._durable_txnid = records.newest_durable(self._dir, self._boot, txnid, self._durable_txnid)
        return txnid <= self._durable_txnid

    def _meta_of(self, txnid: int) -> bytes | None:
        """Snapshot ``txnid``'s meta body, read twice alike (a read racing a
        commit that rewrites that slot could mix two metas); None if that
        slot already holds a newer snapshot."""
        bodies = []
        for _ in range(2):
            pages, _ = read_meta_pages(self._dir / "data.mdb")
            bodies.append(next((p.body for p in pages if p.txnid == txnid), None))
        return bodies[0] if bodies[0] == bodies[1] else None

    def ended(self) -> None:
        """Forgets the pin's transaction, which py-lmdb already ended (a map
        resize ends every transaction); the next commit pins again first."""
        with self._lock:
            self._pin = None

    def release(self) -> None:
        """Ends the pin and closes this process's record file (the
        environment is about to close): a process opening many stores keeps
        no descriptor of those it closed; its records stay, removable by
        others once a newer one is durable, as a dead process's."""
        with self._lock:
            if self._pin is not None:
                self._pin.abort()
                self._pin = None
        records.release_own(self._dir)


def late_pin(env_dir: Path) -> SnapshotPin | None:
    """For a sync writer that committed without a pin (no record then):
    a pin counting that commit, for its sync to record, where a group
    process has recorded meanwhile (its first record raced the commit,
    which no record would cover otherwise); else None."""
    if not has_record(env_dir):
        return None
    pin = SnapshotPin(env_dir)
    pin.committed()
    return pin


def roll_back_after_os_crash(env_dir: Path) -> RollbackReport | None:
    """Reopens the last synced snapshot if an OS crash may have torn later
    commits (module invariants 5, 6). Call under the environment's recovery
    lock, before LMDB opens it. Returns None when nothing was rolled back."""
    current_boot = boot_id()
    record = records.newest(env_dir)  # listed before the meta pages are read: no live record is newer than them
    data = env_dir / "data.mdb"
    if current_boot is None or record is None or record.boot == current_boot or not data.is_file():
        return None
    try:
        pages, _ = read_meta_pages(data)
    except OSError:
        return None
    newest = max((p.txnid for p in pages), default=-1)
    if len(pages) == 2 and record.txnid > newest:
        logger.warning("ucm-db: %s: the sync record names transaction %d, past the data file's newest (%d): "
                       "not this file's; using the newest record before it", env_dir, record.txnid, newest)
        record = records.newest(env_dir, at_most=newest)
        if record is None or record.boot == current_boot:
            # Records past both meta pages are not this file's history: left
            # in place, later commits would pass their txnid and a rollback take them.
            records.remove_other_boots(env_dir, current_boot)
            return None
    report = None
    if newest > record.txnid or len(pages) < 2:
        mark_rolled_back(env_dir)  # first: a crash right after the rewrite still leaves the feed its restart
        write_meta_body(data, record.meta_body)
        report = RollbackReport(newest, record.txnid)
        logger.warning(
            "ucm-db: %s: the machine went down with commits not yet synced (durability='group'); "
            "reopened the last synced snapshot (transaction %d; the disk's newest was %d)",
            env_dir, record.txnid, newest,
        )
    identity = records.data_identity(env_dir) or (record.data_inode, 0)
    records.write_own(env_dir, SyncRecord(record.txnid, identity[0], current_boot, record.meta_body, identity[1]))
    # Durable now: the other boots' files (their processes are gone) go, newer ones past both meta pages included.
    records.remove_other_boots(env_dir, current_boot)
    return report


#: A file beside the data file while the store's change feed owes a restart:
#: the feed handed out sequence numbers the rollback undid, and the next
#: writable open moves the sequence past them (``ucm_db.index.changefeed.restart``)
#: before anything appends, whichever process (a read-only view too) rolled back.
ROLLED_BACK_MARKER = "rolled-back"


def mark_rolled_back(env_dir: Path) -> None:
    """Leaves :data:`ROLLED_BACK_MARKER`, durably, holding a token of this
    rollback (its feed restart is made once, by whichever open gets there
    first: ``ucm_db.index.changefeed.restart``)."""
    fd = os.open(env_dir / ROLLED_BACK_MARKER, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, secrets.token_hex(16).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    dir_fd = os.open(env_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def rolled_back(env_dir: Path) -> bytes | None:
    """The token of the rollback whose marker is there (:data:`ROLLED_BACK_MARKER`), or None."""
    try:
        return (env_dir / ROLLED_BACK_MARKER).read_bytes() or b"unnamed"  # a marker torn empty still marks
    except FileNotFoundError:
        return None


def clear_rolled_back(env_dir: Path) -> None:
    (env_dir / ROLLED_BACK_MARKER).unlink(missing_ok=True)
