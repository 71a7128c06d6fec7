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
      made under the commit lock before its batch is written). A swap of the
      open (a follower's reopen, a recovery) never waits for reads either:
      the new open is bound under the commit lock, the old one closed by its
      last read (:class:`~ucm_db.engines.rocksdb_follow.Lease`). Reads share
      a gate that only the close takes, exclusively.
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
    * A failed write or sync (a full disk; RocksDB then refuses every write) reopens the database before the
      next write or sync, so puts resume once space is freed; reads never wait for it: they go to a read-only
      stand-in meanwhile (:mod:`~ucm_db.engines.rocksdb_swap`, with when a failed reopen is tried again).
    * A read RocksDB fails (a file removed or damaged under the running store)
      is a :class:`~ucm_db.errors.TierError`, not rocksdict's bare ``Exception``.
    * :meth:`RocksDbEngine.close` always releases the database and its
      ``LOCK`` file, even when its final sync fails; that failure is raised
      afterwards as a :class:`~ucm_db.errors.TierError`. It releases them
      once the read transactions in flight have ended and the write lock is
      free; every later call raises :class:`~ucm_db.errors.ClosedError`.
    * ``read_only`` writes nothing in the store's directory: it opens a
      private *shadow* of pinned links to the store's files, seeing the
      store as of one moment (:mod:`~ucm_db.engines.rocksdb_shadow`), and
      opens a new one when the writer has changed the store, so a commit (a
      ``bump_epoch`` included) is seen within
      :data:`~ucm_db.engines.rocksdb_follow.FOLLOW_S` (that module's docs).
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
from ucm_db.engines.base import INFO, NEVER_INITIALISED_HINT, TABLES, Engine, T, never_initialised, tree_bytes
from ucm_db.engines.gate import SharedExclusiveGate
from ucm_db.engines.rocksdb_follow import Follower, Lease
from ucm_db.engines.rocksdb_shadow import Shadow, open_pinned
from ucm_db.engines.rocksdb_swap import DISK_HINT as _DISK_HINT, Recovery
from ucm_db.engines.rocksdb_txn import (
    DAMAGED_BLOB_HINT, ReadPoint, RocksTxn, blob_collection_failed, compact_tables, family_of,
)

logger = logging.getLogger("ucm_db")
#: Values at least this large go to blob files instead of the LSM tree.
MIN_BLOB_BYTES = 4096


#: Memtable size of the blocks table and the bound on the write-ahead log: a reopen replays the WAL into blob
#: files, so it needs about this much free disk (issue 46: with RocksDB's 64 MiB default a reopen after a full
#: disk failed with 20 MiB freed, replaying 29 MiB).
WRITE_BUFFER_BYTES = 16 << 20
MAX_WAL_BYTES = 32 << 20
#: RocksDB info logs kept in the store (``LOG`` and ``LOG.old.*``; each open starts one, ~140 KiB; RocksDB keeps 1000).
KEEP_LOG_FILES = 4


def _options(table: str | None, collect_blobs: bool = True) -> rocksdict.Options:
    opts = rocksdict.Options(raw_mode=True)
    opts.create_if_missing(True)
    opts.create_missing_column_families(True)
    if table is None:
        opts.set_max_total_wal_size(MAX_WAL_BYTES)
        opts.set_keep_log_file_num(KEEP_LOG_FILES)
    if table == "blocks":
        opts.set_write_buffer_size(WRITE_BUFFER_BYTES)
        # Payloads are already compressed and large: keep them out of the
        # LSM tree so compaction rewrites only the small index entries.
        opts.set_enable_blob_files(True)
        opts.set_min_blob_size(MIN_BLOB_BYTES)
        opts.set_blob_compression_type(rocksdict.DBCompressionType.none())
        opts.set_compression_type(rocksdict.DBCompressionType.none())
        opts.set_enable_blob_gc(collect_blobs)
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
        self._unfrozen: set[ReadPoint] = set()  # the read points in flight that no commit has frozen yet
        self._gate = SharedExclusiveGate()
        #: Removes a read-only open's shadow directory (module invariants): on release, else when the engine
        #: is collected or the interpreter exits (a store never closed).
        self._shadow: weakref.finalize[[int], RocksDbEngine] | None = None
        self._floors: dict[str, bytes] = {}
        self._pid = os.getpid()
        self._families: dict[str, rocksdict.Rdict] = {}
        self._handles: dict[str, Any] = {}
        self._db: rocksdict.Rdict | None = None
        self._collect_blobs = True  # off once RocksDB's collection met a damaged blob (rocksdb_txn's invariants)
        self._follower = Follower(self.path) if read_only else None  # made before the open it compares with
        self._bind(*self._open())
        if self._follower is not None:
            self._follower.start(self._reopen)
        self._write_options = rocksdict.WriteOptions()
        self._write_options.sync = sync
        self._closed = False
        #: A write or sync failed: RocksDB refuses writes until the database is reopened (``_recovery``).
        self._failed = False
        self._recovery = Recovery(self.path)

    def _bind(self, db: rocksdict.Rdict, shadow: weakref.finalize[[int], RocksDbEngine] | None) -> None:
        self._db, self._shadow, self._lease = db, shadow, Lease()
        self._floors = {} if self._read_only else self._floors  # a new open of a read-only store: its keys may be lower
        self._families = {name: family_of(db, name, collect_blobs=self._collect_blobs) for name in TABLES}
        self._handles = {name: db.get_column_family_handle(name) for name in TABLES}

    def _unbind(self) -> tuple[Any, dict[str, rocksdict.Rdict], Any]:
        """Takes the bound database, families and shadow off the engine (handles keep its LOCK: dropped too); the
        next open gets a lease of its own."""
        taken = (self._db, self._families, self._shadow)
        self._db, self._families, self._handles, self._shadow, self._lease = None, {}, {}, None, Lease()
        return taken

    def _release(self, taken: tuple[Any, dict[str, rocksdict.Rdict], Any] | None = None, *, failed: bool = False) -> None:
        """Closes ``taken``'s (:meth:`_unbind`; None: the bound) families and database, freeing ``LOCK``; each step
        runs. ``failed``: its write failed (its background work is cancelled first)."""
        db, families, shadow = taken if taken is not None else self._unbind()
        # A failed database's background work is cancelled first, else its close waits a second (RocksDB retries).
        cancel = [lambda: db.cancel_all_background(True)] if failed and db is not None else []
        for close in [*cancel, *(family.close for family in families.values())]:
            try:
                close()
            except Exception as exc:  # noqa: BLE001 - closing the rest matters more
                logger.debug("ucm-db: closing a RocksDB column family of %s failed: %s", self.path, exc)
        try:
            if db is not None:
                db.close()
        finally:
            if shadow is not None:
                shadow()

    def _recover(self) -> None:
        """Reopens the database after a failed write, reads going on meanwhile (rocksdb_swap's invariants). Call
        with the write lock held."""
        self._check()  # closed since the caller's check (close holds the write lock too): a closed engine never reopens
        self._recovery.recover(self._swap, lambda: self._open_read_only(TABLES), self._open)
        self._failed = False

    def _swap(self, new: tuple[rocksdict.Rdict, Any] | None, failed: bool = False) -> Lease:
        """Binds ``new`` (None: none, reads recover first) over the bound open, which its last read closes (at once
        where none runs; ``failed``: its write failed, see :meth:`_release`): the old open's lease, returned."""
        reason = "after a failed write" if self._failed else "after its reopen"
        with self._commit_lock:  # bound over the old one: no moment without a database (``_recover_if_failed``)
            lease, old = self._lease, (self._db, self._families, self._shadow)
            if new is None:
                self._unbind()
            else:
                self._bind(*new)
            self._unfrozen.clear()  # the old open's reads: no commit changes what they read

            def release() -> None:
                try:
                    self._release(old, failed=failed)
                except Exception as exc:  # noqa: BLE001 - run by a read or a swap: the new open is bound
                    # A failed open's close reports its write's error again ("Writer has previous error"); its
                    # LOCK is freed all the same: not worth a warning beside the failed write's own.
                    (logger.debug if failed else logger.warning)("ucm-db: closing RocksDB store %s %s: %s",
                                                                 self.path, reason, exc)
            run = lease.retire(release)
        run()
        return lease

    def _reopen(self) -> None:
        """The read-only store opened anew, its old open released by its last read (rocksdb_follow's invariants)."""
        self._swap(self._open_read_only(TABLES))

    def _recover_if_failed(self, *, unreadable_only: bool = False) -> None:
        """Reopens a failed database (``unreadable_only``: only one that has
        no handle at all; a failed one still reads)."""
        def needed() -> bool:
            return self._db is None or (self._failed and not unreadable_only)
        if needed():
            with self._write_lock:
                if needed():
                    self._recover()

    def _open(self) -> tuple[rocksdict.Rdict, Any]:
        try:
            if self._read_only:
                existing = rocksdict.Rdict.list_cf(str(self.path), rocksdict.Options(raw_mode=True))
                missing = sorted(set(TABLES) - set(existing))
                if INFO in missing:  # every ucm-db store has it: the open that created this one stopped early
                    raise TierError(never_initialised(self.path.parent), hint=NEVER_INITIALISED_HINT)
                if missing:  # every writable open creates them all: an older ucm-db's store (format 2 had no heads)
                    raise FormatVersionError(
                        f"RocksDB store at {self.path} lacks tables {', '.join(missing)}: an older ucm-db wrote it",
                        hint=f"run `ucm-db migrate {self.path.parent}`")
                return self._open_read_only(existing)
            self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
            return rocksdict.Rdict(
                str(self.path), options=_options(None),
                column_families={name: _options(name, self._collect_blobs) for name in TABLES},
            ), None
        except (TierError, FormatVersionError):
            raise
        except Exception as exc:  # rocksdict raises plain Exception for IO errors
            if "lock" in str(exc).lower():
                raise LockedError(
                    f"RocksDB store at {self.path} is already open in another process or handle "
                    f"(the rocksdb engine is single-process): {exc}",
                ) from exc
            raise TierError(f"cannot open RocksDB store at {self.path}: {exc}") from exc

    def _open_read_only(self, tables: Iterable[str]) -> tuple[rocksdict.Rdict, weakref.finalize[[int], RocksDbEngine]]:
        db, shadow = _open_read_only(self.path, tables)
        return db, weakref.finalize(self, shadow.remove_in_owner, os.getpid())

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
        while True:
            self._recover_if_failed(unreadable_only=True)  # a recovery left no open bound: waits for it (outside the gate)
            with self._gate.shared():
                with self._commit_lock:  # every table at the same commit, the floors of that commit, that open's lease
                    if self._db is None:
                        continue  # swapped out since the check above (a recovery with no stand-in): check again
                    families, floors, lease = self._families, self._floors, self._lease.enter()
                    point = ReadPoint(families, self._commit_lock)
                    self._unfrozen.add(point)
                txn = RocksTxn(families, writable=False, floors=floors, point=point)
                try:
                    return fn(txn)
                except Exception as exc:
                    if type(exc) is Exception:  # rocksdict's own: a table or blob file removed or damaged under the store
                        raise TierError(f"RocksDB read of {self.path} failed: {exc}",
                                        hint="run `ucm-db verify --fix` on it") from exc
                    raise
                finally:
                    txn.close_scans()  # scans, snapshots and iterators keep the database open (and its LOCK):
                    point.release()  # none outlives its transaction, nor the lease the last read leaves
                    with self._commit_lock:
                        self._unfrozen.discard(point)
                        release = lease.leave()
                    release()  # closes an open a swap replaced, after its last read

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
                self._failed, self._collect_blobs = True, self._collect_blobs and not blob_collection_failed(exc)
                raise TierError(f"RocksDB write to {self.path} failed: {exc}",
                                hint=DAMAGED_BLOB_HINT if blob_collection_failed(exc) else _DISK_HINT) from exc
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
            self._failed, self._collect_blobs = True, self._collect_blobs and not blob_collection_failed(exc)
            raise TierError(f"RocksDB sync of {self.path} failed: {exc}", hint=_DISK_HINT) from exc

    def compact(self) -> None:
        """Compacts every table and rewrites every blob file (:func:`~ucm_db.engines.rocksdb_txn.compact_tables`)."""
        self._check()
        assert self._db is not None
        compact_tables(self._db, self._families, self.path, collect_blobs=self._collect_blobs)

    def close(self) -> None:
        if self._closed or self._pid != os.getpid():
            self._closed = True
            return
        self._closed = True
        if self._follower is not None:
            self._follower.stop()  # before the release: it may be swapping
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
                    self._release(failed=self._failed)
            except Exception as exc:  # noqa: BLE001 - raised below
                failure = failure or exc
        if failure is not None:
            raise TierError(f"closing RocksDB store at {self.path}: {failure} (the store was released)",
                            hint=_DISK_HINT) from failure

    def file_bytes(self) -> int:
        return tree_bytes(self.path)
