"""RocksDB engine: an alternative single-process local tier (via rocksdict).

Layout: one RocksDB database per store directory, one column family per
table of :data:`~ucm_db.engines.base.TABLES`. The ``blocks`` family keeps
values of 4 KiB and more in blob files (integrated BlobDB), so compaction
moves small index entries instead of whole KV payloads; blobs are stored
uncompressed because the codec already compressed them.

Invariants and choices:
    * rocksdict is used with ``raw_mode=True`` only: keys and values are raw
      bytes, never pickled Python objects.
    * ``write(fn)`` runs ``fn`` against an overlay of pending changes over
      the committed tables (read-your-writes, sorted merged scans), then
      commits the whole overlay as one ``WriteBatch``: all or nothing. An
      exception in ``fn`` leaves the database untouched.
    * Writers are serialised by a lock. A read transaction reads every
      column family as of the commit before it began (never half of a
      batch across families; :class:`~ucm_db.engines.rocksdb_txn.ReadPoint`)
      and holds no lock while it runs: a commit never waits for a read (a
      walk of every block, such as the change feed's inventory, stalled
      every put for its whole length when commits waited for reads). A
      commit first freezes the reads in flight (iterators of every table,
      made under the commit lock before its batch is written). Reads share
      a gate that only a reopen and the close take exclusively.
    * Single process: RocksDB's ``LOCK`` file refuses a second opener, which
      is reported as :class:`~ucm_db.errors.LockedError`; a forked child
      must not use its parent's handle and gets the same error.
    * Scans start at a per-table *floor*, a key below which nothing is
      live: a whole-table scan records its first key, a put below the floor
      lowers it. Queue-like tables (the LRU index, scanned from the start
      for every eviction) would otherwise step over the tombstones of every
      entry ever evicted. A write transaction works on a copy of the floors,
      adopted only when it commits (an aborted one may have raised a floor
      over its own buffered deletes).
    * ``sync=True`` fsyncs the WAL on every commit; otherwise
      :meth:`RocksDbEngine.sync` flushes and fsyncs the WAL (group commit).
    * A failed write or sync (a full disk) leaves RocksDB refusing every
      later write ("Writer has previous error"): the engine then reopens
      the database before its next write, read or sync, so puts resume once
      space is freed (the failed batch was never applied; reopening replays
      the log up to the last whole record). Until a reopen succeeds, every
      call is a :class:`~ucm_db.errors.TierError` naming the disk.
    * :meth:`RocksDbEngine.close` always releases the database and its
      ``LOCK`` file, even when its final sync fails; that failure is raised
      afterwards as a :class:`~ucm_db.errors.TierError`. It releases them
      once the read transactions in flight have ended and the write lock is
      free; every later call raises :class:`~ucm_db.errors.ClosedError`.
    * ``read_only`` writes nothing in the store's directory: rocksdict
      rewrites its ``rocksdict-config.json`` in the directory it opens, even
      read-only, so a read-only open opens a private *shadow* directory (in
      the temp directory) of links to the store's files instead, and
      removes it on close. RocksDB reads through the links and, read-only,
      creates no file, so a store on a read-only volume opens too. The
      shadow pins the files it links (open descriptors), so a writer in
      another process that flushes, compacts or deletes files meanwhile
      neither fails the open nor a later read of a blob value; the open
      sees the store as of one moment
      (:mod:`~ucm_db.engines.rocksdb_shadow`).
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import rocksdict

from ucm_db.errors import ClosedError, FormatVersionError, LockedError, TierError
from ucm_db.engines.base import TABLES, Engine, T
from ucm_db.engines.gate import SharedExclusiveGate
from ucm_db.engines.rocksdb_shadow import Shadow, open_pinned
from ucm_db.engines.rocksdb_txn import ReadPoint, RocksTxn

logger = logging.getLogger("ucm_db")
_DISK_HINT = "free space on that disk (the store resumes writing once there is room), or lower capacity_bytes"
#: Values at least this large go to blob files instead of the LSM tree.
MIN_BLOB_BYTES = 4096


#: Memtable size of the blocks table and the bound on the write-ahead log:
#: payloads wait in the WAL until their memtable flushes to blob files, and a
#: reopen replays the WAL into blob files, so it needs about this much free
#: disk (issue 46: with RocksDB's 64 MiB default a reopen after a full disk
#: failed with 20 MiB freed, replaying 29 MiB).
WRITE_BUFFER_BYTES = 16 << 20
MAX_WAL_BYTES = 32 << 20


def _options(table: str | None) -> rocksdict.Options:
    opts = rocksdict.Options(raw_mode=True)
    opts.create_if_missing(True)
    opts.create_missing_column_families(True)
    if table is None:
        opts.set_max_total_wal_size(MAX_WAL_BYTES)
    if table == "blocks":
        opts.set_write_buffer_size(WRITE_BUFFER_BYTES)
        # Payloads are already compressed and large: keep them out of the
        # LSM tree so compaction rewrites only the small index entries.
        opts.set_enable_blob_files(True)
        opts.set_min_blob_size(MIN_BLOB_BYTES)
        opts.set_blob_compression_type(rocksdict.DBCompressionType.none())
        opts.set_compression_type(rocksdict.DBCompressionType.none())
        opts.set_enable_blob_gc(True)
    return opts


def _open_read_only(path: Path, tables: Iterable[str]) -> tuple[rocksdict.Rdict, Shadow]:
    """The database at ``path`` opened read-only without writing there, and
    the shadow directory it reads (:mod:`~ucm_db.engines.rocksdb_shadow`),
    to be removed once the database is closed."""
    options = _options(None)
    options.set_max_open_files(-1)  # every table file opened by the open itself, while the shadow pins it

    def open_db(shadow: Path) -> rocksdict.Rdict:
        return rocksdict.Rdict(str(shadow), options=options, column_families={name: _options(name) for name in tables},
                               access_type=rocksdict.AccessType.read_only())
    return open_pinned(path.absolute(), open_db)


def _remove_shadow(shadow: Shadow, pid: int) -> None:
    shadow.remove(delete=os.getpid() == pid)  # a forked child exiting leaves its parent's shadow alone


class RocksDbEngine(Engine):
    """Tables as RocksDB column families (single process; see module docs)."""

    name = "rocksdb"
    multi_process = False
    persistent = True

    def __init__(self, path: str | Path, *, sync: bool, read_only: bool = False) -> None:
        self.path = Path(path)
        self._sync = sync
        self._read_only = read_only
        self._write_lock = threading.Lock()
        #: Held while a batch commits, while a read takes its point (with the floors of that commit) and
        #: while a scan of a read starts.
        self._commit_lock = threading.Lock()
        #: The read points in flight that no commit has frozen yet.
        self._unfrozen: set[ReadPoint] = set()
        self._gate = SharedExclusiveGate()
        #: Removes a read-only open's shadow directory (module invariants): on release, else when the engine
        #: is collected or the interpreter exits (a store never closed).
        self._shadow: weakref.finalize[[Shadow, int], RocksDbEngine] | None = None
        self._floors: dict[str, bytes] = {}
        self._pid = os.getpid()
        self._families: dict[str, rocksdict.Rdict] = {}
        self._handles: dict[str, Any] = {}
        self._db: rocksdict.Rdict | None = None
        self._bind(self._open())
        self._write_options = rocksdict.WriteOptions()
        self._write_options.sync = sync
        self._closed = False
        #: A write or sync failed: RocksDB refuses writes until the database is reopened.
        self._failed = False

    def _bind(self, db: rocksdict.Rdict) -> None:
        self._db = db
        self._families = {name: db.get_column_family(name) for name in TABLES}
        self._handles = {name: db.get_column_family_handle(name) for name in TABLES}

    def _release(self) -> None:
        """Closes the families and the database (which frees its ``LOCK``
        file); every step runs even when one fails."""
        # Column family handles and views keep the database (and its LOCK file) alive until they are released.
        self._handles.clear()
        families, self._families = self._families, {}
        db, self._db = self._db, None
        for family in families.values():
            try:
                family.close()
            except Exception as exc:  # noqa: BLE001 - closing the rest matters more
                logger.debug("ucm-db: closing a RocksDB column family of %s failed: %s", self.path, exc)
        shadow, self._shadow = self._shadow, None
        try:
            if db is not None:
                db.close()
        finally:
            if shadow is not None:
                shadow()

    def _recover(self) -> None:
        """Reopens the database after a failed write (see module
        invariants). Call with the write lock held."""
        with self._gate.exclusive():
            try:
                self._release()
            except Exception as exc:  # noqa: BLE001 - the reopen below says whether the store is usable
                logger.warning("ucm-db: closing RocksDB store %s after a failed write: %s", self.path, exc)
            try:
                self._bind(self._open())
            except TierError as exc:
                self._bind_for_reading()
                raise TierError(f"RocksDB store at {self.path} cannot be reopened after a failed write: {exc}",
                                hint=_DISK_HINT) from exc
            self._failed = False
            logger.info("ucm-db: reopened RocksDB store %s after a failed write", self.path)

    def _bind_for_reading(self) -> None:
        """Keeps the store readable while a reopen for writing fails (a disk
        still full): the database opened read-only, which creates no file.
        ``_failed`` stays set, so the next write tries again."""
        try:
            self._bind(self._open_read_only(TABLES))
        except Exception as exc:  # noqa: BLE001 - reads then fail with the reopen's error until a reopen works
            logger.warning("ucm-db: RocksDB store %s cannot be read either until it reopens: %s", self.path, exc)

    def _recover_if_failed(self, *, unreadable_only: bool = False) -> None:
        """Reopens a failed database (``unreadable_only``: only one that has
        no handle at all; a failed one still reads)."""
        def needed() -> bool:
            return self._db is None or (self._failed and not unreadable_only)
        if needed():
            with self._write_lock:
                if needed():
                    self._recover()

    def _open(self) -> rocksdict.Rdict:
        try:
            if self._read_only:
                existing = rocksdict.Rdict.list_cf(str(self.path), rocksdict.Options(raw_mode=True))
                missing = sorted(set(TABLES) - set(existing))
                if missing:  # every writable open creates them all: an older ucm-db's store (format 2 had no heads)
                    raise FormatVersionError(
                        f"RocksDB store at {self.path} lacks tables {', '.join(missing)}: an older ucm-db wrote it",
                        hint=f"run `ucm-db migrate {self.path.parent}`")
                return self._open_read_only(existing)
            self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
            return rocksdict.Rdict(
                str(self.path), options=_options(None),
                column_families={name: _options(name) for name in TABLES},
            )
        except (TierError, FormatVersionError):
            raise
        except Exception as exc:  # rocksdict raises plain Exception for IO errors
            if "lock" in str(exc).lower():
                raise LockedError(
                    f"RocksDB store at {self.path} is already open in another process or handle "
                    f"(the rocksdb engine is single-process): {exc}",
                ) from exc
            raise TierError(f"cannot open RocksDB store at {self.path}: {exc}") from exc

    def _open_read_only(self, tables: Iterable[str]) -> rocksdict.Rdict:
        db, shadow = _open_read_only(self.path, tables)
        self._shadow = weakref.finalize(self, _remove_shadow, shadow, os.getpid())
        return db

    def _check(self) -> None:
        if self._pid != os.getpid():
            raise LockedError(
                f"RocksDB store at {self.path} was opened in process {self._pid} and used in forked child {os.getpid()}",
                hint="open the store after fork, in one process only, or use the LMDB engine",
            )
        if self._closed:
            raise ClosedError(f"RocksDB store at {self.path} is closed")

    def read(self, fn: Callable[[RocksTxn], T]) -> T:  # type: ignore[override]
        self._check()
        self._recover_if_failed(unreadable_only=True)  # a reopen after a failed write left no handle
        with self._gate.shared():
            with self._commit_lock:  # every table at the same commit, and the floors of that commit
                point, floors = ReadPoint(self._families, self._commit_lock), self._floors
                self._unfrozen.add(point)
            try:
                return fn(RocksTxn(self._families, writable=False, floors=floors, point=point))
            finally:
                with self._commit_lock:
                    self._unfrozen.discard(point)
                point.release()  # its snapshots keep the database open: none outlives its transaction

    def write(self, fn: Callable[[RocksTxn], T]) -> T:  # type: ignore[override]
        self._check()
        if self._read_only:
            raise TierError(f"RocksDB store at {self.path} is open read-only", hint="open it without read_only")
        with self._write_lock:
            if self._failed or self._db is None:
                self._recover()
            assert self._db is not None
            txn = RocksTxn(self._families, writable=True, floors=dict(self._floors))
            result = fn(txn)
            batch = txn.batch(self._handles)
            try:
                with self._commit_lock:
                    if batch is not None:  # the reads in flight keep what they see: the tables before this batch
                        for point in self._unfrozen:
                            point.freeze()
                        self._unfrozen.clear()
                        self._db.write(batch, self._write_options)
                    self._floors = txn.floors
            except Exception as exc:
                self._failed = True
                raise TierError(f"RocksDB write to {self.path} failed: {exc}", hint=_DISK_HINT) from exc
            return result

    def sync(self) -> None:
        self._check()
        if self._read_only:
            return
        self._recover_if_failed()
        try:
            assert self._db is not None
            self._db.flush_wal(True)
        except Exception as exc:
            self._check()  # closed meanwhile: a ClosedError, not a failed disk
            self._failed = True
            raise TierError(f"RocksDB sync of {self.path} failed: {exc}", hint=_DISK_HINT) from exc

    def compact(self) -> None:
        """Compacts every column family, rewriting all blob files, so the
        space of deleted entries and payloads goes back to the filesystem."""
        self._check()
        options = rocksdict.CompactOptions()
        options.set_bottommost_level_compaction(rocksdict.BottommostLevelCompaction.force())
        blocks = self._families["blocks"]
        # Normal compactions relocate only the oldest quarter of blob files.
        blocks.set_options({"blob_garbage_collection_age_cutoff": "1.0", "blob_garbage_collection_force_threshold": "0.0"})
        try:
            for family in self._families.values():
                family.compact_range(None, None, options)
        finally:
            blocks.set_options({"blob_garbage_collection_age_cutoff": "0.25", "blob_garbage_collection_force_threshold": "1.0"})

    def close(self) -> None:
        if self._closed or self._pid != os.getpid():
            self._closed = True
            return
        self._closed = True
        failure: BaseException | None = None
        with self._write_lock:
            try:
                if not self._read_only and self._db is not None and not self._failed:
                    self._db.flush_wal(True)
            except Exception as exc:  # noqa: BLE001 - raised after the release below
                failure = exc
            try:
                # After the read transactions in flight (a read beside the release saw "Already mutably borrowed");
                # every later one raises ClosedError.
                with self._gate.closing(f"RocksDB store at {self.path} is closed"):
                    self._release()
            except Exception as exc:  # noqa: BLE001 - raised below
                failure = failure or exc
        if failure is not None:
            raise TierError(f"closing RocksDB store at {self.path}: {failure} (the store was released)",
                            hint=_DISK_HINT) from failure

    def file_bytes(self) -> int:
        total = 0
        for root, _dirs, files in os.walk(self.path):
            for name in files:
                try:
                    total += os.path.getsize(os.path.join(root, name))
                except OSError:
                    pass  # a file removed by a background compaction meanwhile
        return total
