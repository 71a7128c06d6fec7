"""LMDB engine: the default local tier.

The OS page cache over the LMDB file is the DRAM tier, the file the SSD tier.

Invariants and choices:
    * Never ``writemap`` (a full disk would SIGBUS); ``readahead`` on;
      ``reader_check()`` on every open clears reader slots of dead processes.
    * The environment is opened lazily and re-opened in a forked child (an
      LMDB environment must not cross ``fork``).
    * Map growth happens outside any transaction: a write that hits
      ``MapFullError`` is aborted, the map is doubled while no transaction of
      this process runs, and the write function is run again.
    * Write transactions of this process are serialised by a lock (LMDB's
      own writer lock serialises processes).
    * The directory is created 0700 and the files 0600.
    * Once per process, glibc's malloc is asked to keep freed memory (see
      :func:`~ucm_db.engines.lmdb.malloc.keep_dirty_page_memory`); ``UCM_DB_MALLOC_TUNING=0`` opts out.
    * After every open, the pages of the data file already in the page
      cache are mapped into this process in the background
      (:mod:`ucm_db.engines.lmdb.prefault`), so a large store's commits do not
      pay a page fault per page moved; ``UCM_DB_PREFAULT=0`` opts out.
    * Durability never risks the file. ``sync=True``: every commit
      fdatasyncs its pages, then its meta page (LMDB's default).
      ``sync=False`` (``durability="group"``): commits use MDB_NOSYNC and
      reach only the OS page cache; :meth:`LmdbEngine.sync` (run by the
      store every ``sync_interval_s``) makes them durable and records the
      synced snapshot, and an open after an OS crash reopens the last
      synced snapshot (:mod:`ucm_db.engines.lmdb.groupsync`). A power loss
      thus undoes the commits since the last completed sync and damages
      nothing; a process crash loses nothing. A process pins a snapshot
      (a read transaction) only from before its first commit to the end of
      the sync that records its last (groupsync invariants 2-3): one that
      only reads pins none.
    * Nothing is rolled back, rewritten or mapped before the library and the
      data file's meta pages are found to be a proven LMDB
      (:mod:`ucm_db.engines.lmdb.fence`).
    * A data file is checked against its meta pages before it is mapped
      (:func:`ucm_db.engines.lmdb.meta.check_file`): a truncated or foreign
      file is a :class:`TierError` naming the damage, never a SIGBUS.
    * Stores written by older versions with unsynced-commit markers are
      still checked in a child process after an OS crash
      (:mod:`ucm_db.engines.lmdb.recovery`); no marker is written any more.
    * ``read_only`` (a store on a read-only volume) writes nothing: the
      environment is opened ``MDB_RDONLY``, with LMDB's lock file where it
      can be opened and without it (``MDB_NOLOCK``) where the volume is
      read-only; no OS-crash check or rollback, no snapshot pin, ``sync``
      does nothing and ``write`` raises :class:`TierError`. Without the lock
      file no writer sees this process's readers, so a store written
      through another mount meanwhile may show a reader torn pages: the
      payload checksums turn those into misses.
    * ``observe`` (maintenance's read-only views of a writable store): the
      open recovers as a writable one does (the rollback after an OS crash),
      then takes no snapshot pin and writes no sync record: a view that is
      stopped (Ctrl-Z) or slow holds no snapshot past its own reads.
      ``sync`` does nothing, ``write`` raises.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lmdb

from ucm_db.errors import TierError
from ucm_db.engines.base import TABLES, Engine, T
from ucm_db.engines.gate import SharedExclusiveGate
from ucm_db.storelock import ensure_store_dir
from ucm_db.engines.lmdb.checks import (
    check_data_file, check_pages_at_open, check_room_to_create, ensure_env_dir, lmdb_error, lock_file_writable,
    recover_at_open,
)
from ucm_db.engines.lmdb.fence import check_proven
from ucm_db.engines.lmdb.groupsync import RollbackReport, SnapshotPin, has_record, late_pin
from ucm_db.engines.lmdb.readers import lagging_readers
from ucm_db.engines.lmdb.malloc import keep_dirty_page_memory
from ucm_db.engines.lmdb.prefault import Prefault
from ucm_db.engines.lmdb.txn import LmdbTxn, lmdb_open
from ucm_db.engines.lmdb import space
from ucm_db.engines.lmdb.custody import Custody
from ucm_db.engines.lmdb.recovery import RecoveryReport
from ucm_db.engines.lmdb.tables import open_read_only_tables, open_tables

_MAX_MAP_BYTES = 1 << 46


class LmdbEngine(Engine):
    """Tables as LMDB sub-databases in one environment directory."""

    name = "lmdb"
    multi_process = True
    persistent = True

    def __init__(self, path: str | Path, *, map_size_bytes: int, sync: bool, max_readers: int = 1024, read_only: bool = False,
                 check_pages: bool = True, observe: bool = False) -> None:
        self.path = Path(path)
        self.read_only = read_only
        self._observe = observe  # a view's engine: recovers at open, pins and writes nothing after (module doc)
        self._check_pages = check_pages  # once per engine, before the first map (a forked child's parent checked)
        self._custody = Custody(self.path, read_only=read_only)  # may an open skip the page walk (custody.py)
        self._map_size_bytes = map_size_bytes
        self._sync = sync
        self._max_readers = max_readers
        self._env: lmdb.Environment | None = None
        self._dbs: dict[str, Any] = {}
        self._pid = -1
        self._open_lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._txn_gate = SharedExclusiveGate()
        self._pin: SnapshotPin | None = None
        self._pinned = not sync  # keeps a sync record (set again at each open, see _open)
        self.prefault: Prefault | None = None
        self._page_bytes: int | None = None
        #: What the last open found of an older version's markers after an OS crash (None: nothing to check).
        self.recovery: RecoveryReport | None = None
        #: Group durability: the rollback to the last synced snapshot the last open made after an OS crash.
        self.rollback: RollbackReport | None = None

    def _environment(self) -> lmdb.Environment:
        if self._env is None or self._pid != os.getpid():
            with self._open_lock:
                if self._env is None or self._pid != os.getpid():
                    self._open()
        assert self._env is not None
        return self._env

    def _open(self) -> None:
        self._txn_gate.refuse_if_closed()  # a closed engine is never opened again
        # A forked child must not touch the parent's environment: drop it.
        self._env = None
        # The parent's pin is dropped, never released: ending its read
        # transaction would clear the parent's slot in the shared lock file
        # (py-lmdb's objects do nothing when freed in a forked child).
        self._pin = None
        self._write_lock = threading.Lock()
        self._txn_gate = SharedExclusiveGate()
        self.prefault = None  # a forked child: the parent's thread is not here
        check_proven(self.path)  # before any rollback, rewrite or map (fence.py)
        if self.read_only:
            self._env, self._dbs = self._open_read_only()
            self._pid = os.getpid()
            self._start_prefault()
            return
        ensure_store_dir(self.path.parent)
        ensure_env_dir(self.path)
        check_room_to_create(self.path, self._max_readers)  # a full disk: a TierError, not LMDB's SIGBUS
        # A store a group-durability process has used keeps a sync record,
        # which an open after an OS crash rolls back to: a sync writer
        # (maintenance, or a server opened with durability="sync") must keep
        # it true too, or its commits would reuse the recorded snapshot's
        # pages and a later rollback would land on overwritten pages. So it
        # rolls back as group opens do, pins before its commits and records
        # each of them (raising where it cannot: an OS crash would undo it).
        self._pinned = not self._sync or has_record(self.path)
        self.recovery, self.rollback = recover_at_open(self.path, pinned=self._pinned)
        check_data_file(self.path)
        self._check_pages_once(lock=True)
        try:
            env = lmdb_open(
                str(self.path),
                map_size=self._map_size_bytes,
                subdir=True,
                max_dbs=len(TABLES) + 4,
                max_readers=self._max_readers,
                sync=self._sync,
                metasync=True,
                readahead=True,
                writemap=False,
                lock=True,
                mode=0o600,
            )
        except (lmdb.Error, OSError) as exc:
            raise lmdb_error("Opening LMDB store", self.path, exc) from exc
        try:
            keep_dirty_page_memory()
            current = env.info()["map_size"]
            if current < self._map_size_bytes:
                env.set_mapsize(self._map_size_bytes)
            self._dbs = open_tables(env, self.path, create=True)
            if self._pinned and not self._observe:
                self._pin = SnapshotPin(self.path)  # pins before this process's first commit, not now
            env.reader_check()  # no process relies on a dead one's pin (groupsync invariant 4)
        except BaseException:
            env.close()
            raise
        self._env = env
        self._pid = os.getpid()
        self._custody.opened()
        self._start_prefault()

    def _start_prefault(self) -> None:
        self.prefault = Prefault(self.path / "data.mdb", self._txn_gate.shared)
        self.prefault.start()

    def _open_read_only(self) -> tuple[lmdb.Environment, dict[str, Any]]:
        """The environment opened ``MDB_RDONLY`` and its tables (:func:`open_read_only_tables`), pages checked first."""
        check_data_file(self.path)
        self._check_pages_once(lock=lock_file_writable(self.path))
        return open_read_only_tables(self.path, self._max_readers)

    def _check_pages_once(self, *, lock: bool) -> None:  # a damaged page: a TierError now, not a crash later
        recorded = self._custody.take_recorded()  # the file as the ledger vouches for it (custody.py): no walk
        if self._check_pages and not recorded and check_pages_at_open(self.path, lock=lock):
            self._custody.walked_clean()
        self._check_pages = False

    def read(self, fn: Callable[[LmdbTxn], T]) -> T:  # type: ignore[override]
        """``fn`` in a read transaction, adopting a map another process grew
        meanwhile (every read goes through here: a bare ``env.begin`` fails
        with MDB_MAP_RESIZED beside a growing writer)."""
        env = self._environment()
        for _ in range(3):
            try:
                with self._txn_gate.shared(), env.begin(buffers=True) as txn:
                    return fn(LmdbTxn(txn, self._dbs))
            except lmdb.MapResizedError:
                self._adopt_resize(env)
            except lmdb.Error as exc:  # e.g. MDB_CORRUPTED from a damaged page
                raise lmdb_error("LMDB read of", self.path, exc) from exc
        raise TierError(f"LMDB map of {self.path} keeps being resized by another process")

    def write(self, fn: Callable[[LmdbTxn], T]) -> T:  # type: ignore[override]
        if self.read_only or self._observe:
            raise TierError(f"LMDB store {self.path} is open read-only", hint="open it without read_only=True to write")
        env = self._environment()
        while True:
            try:
                with self._write_lock, self._txn_gate.shared():
                    pin = self._pin_before_commit(env)
                    with self._custody.committing(), env.begin(write=True, buffers=True) as txn:
                        result = fn(LmdbTxn(txn, self._dbs))
                    if pin is not None:
                        pin.committed()
                if self._sync:
                    self._record_sync_commit(env)
                return result
            except lmdb.MapFullError:
                self._grow(env)
            except lmdb.MapResizedError:
                self._adopt_resize(env)
            except lmdb.Error as exc:
                raise lmdb_error("LMDB write to", self.path, exc) from exc

    def _grow(self, env: lmdb.Environment) -> None:
        with self._txn_gate.exclusive():
            size = env.info()["map_size"]
            space.check_map_growth(self.path, size * 2, size, _MAX_MAP_BYTES)  # a failed set_mapsize ends py-lmdb's env
            self._set_mapsize(env, size * 2)

    def _adopt_resize(self, env: lmdb.Environment) -> None:
        with self._txn_gate.exclusive():
            space.check_adopted_growth(self.path, env)  # a failed set_mapsize(0) ends py-lmdb's env too
            self._set_mapsize(env, 0)

    def _set_mapsize(self, env: lmdb.Environment, size: int) -> None:
        """``set_mapsize`` (under the exclusive gate). py-lmdb ends every
        transaction of the environment when the map changes, the snapshot
        pin's too: no commit of this process runs meanwhile, and the next
        pins again before it commits (groupsync invariant 2)."""
        env.set_mapsize(size)
        if self._pin is not None:
            self._pin.ended()

    def _pin_before_commit(self, env: lmdb.Environment) -> SnapshotPin | None:
        """The pin a commit runs under (groupsync invariant 2), held now; a
        sync writer takes one once a group process has recorded since it
        opened. Under the write lock and the shared gate."""
        if self._pin is None and self._sync and not self._observe and has_record(self.path):
            self._pin = SnapshotPin(self.path)
        if self._pin is not None:
            try:
                self._pin.before_commit(env)
            except TierError:
                raise
            except OSError as exc:
                raise lmdb_error("Recording the synced snapshot of", self.path, exc) from exc
        return self._pin

    def sync(self) -> None:
        """Makes every commit of this process durable; with a sync record
        (group durability), records it too, or raises :class:`TierError`:
        an unrecorded sync is undone by the rollback after an OS crash."""
        if self.read_only or self._observe:
            return  # nothing written, nothing to make durable
        self._sync_env(self._environment())

    def sync_round(self) -> bool:
        """A background sync: as :meth:`sync` (a failure raises)."""
        if self.read_only or self._observe:
            return True
        self._sync_env(self._environment())
        return True

    def _record_sync_commit(self, env: lmdb.Environment) -> None:
        """Records a sync writer's commit (on disk already) as the synced snapshot, or raises :class:`TierError`:
        the commit stands, but a rollback after an OS crash would undo it, so the caller (``verify --fix``,
        ``compact``'s evictions, a migration) must not report it done."""
        with self._write_lock:  # a group process may have made the first record since the commit's check
            self._pin = self._pin or late_pin(self.path)
        if self._pin is None:
            return
        try:
            self._sync_env(env)
        except TierError as exc:
            raise TierError(f"committed to {self.path}, but its synced snapshot was not recorded ({exc}): an OS "
                            "crash's rollback would undo the change", hint=f"make {self.path} writable with free "
                            "space (the synced-snapshot.* files beside data.mdb), then run the operation again") from exc

    def _sync_env(self, env: lmdb.Environment) -> None:
        """Syncs and records; then lets an idle pin go (groupsync invariant 3)."""
        for _ in range(16):
            try:
                # Inside the shared gate, as a transaction: a map growth in
                # another thread (which ends every transaction) waits for
                # the new pin to be recorded instead of ending it midway, and a close for the sync to end.
                with self._txn_gate.shared():
                    if self._pin is None:
                        env.sync(True)
                        return
                    self._pin.sync(env)
                    if self._write_lock.acquire(blocking=False):  # else a commit is under way: not idle
                        try:
                            self._pin.release_if_idle()
                        finally:
                            self._write_lock.release()
                    return
            except lmdb.MapResizedError:
                self._adopt_resize(env)
            except TierError:
                raise
            except (lmdb.Error, OSError) as exc:
                raise lmdb_error("LMDB sync of", self.path, exc) from exc
        raise TierError(f"LMDB map of {self.path} keeps being resized by another process")

    def close(self) -> None:  # after this process's transactions end; later ones raise ClosedError (gate.py)
        with self._open_lock:
            if self._pid != os.getpid():  # a forked child drops the parent's environment, pin and thread (see _open)
                self._env, self._pin, self.prefault, self._txn_gate = None, None, None, SharedExclusiveGate()
            if self.prefault is not None:
                self.prefault.stop()  # before the file is unmapped
            with self._txn_gate.closing(f"LMDB store {self.path} is closed"):
                env, pin, self._env, self._pin, self.prefault = self._env, self._pin, None, None, None
                if pin is not None:
                    pin.release()
                if env is not None:
                    env.close()
                    self._custody.close()

    def lagging_readers(self) -> list[tuple[int, int, str]]:
        """Other processes' reader slots on old snapshots: (pid, snapshot, phrase), most behind first."""
        return lagging_readers(self._environment())

    def file_bytes(self) -> int:
        data = self.path / "data.mdb"
        return data.stat().st_size if data.exists() else 0

    def free_page_bytes(self) -> int | None:
        """The pages below the used extent that no table holds: LMDB's free
        list (:func:`ucm_db.engines.lmdb.space.free_page_bytes`). A long one
        slows every put of a large block (it is searched for a contiguous
        run); ``ucm-db compact`` returns it to the disk."""
        env = self._environment()
        return space.free_page_bytes(self.read(lambda txn: space.table_stats(txn, self._dbs, env)), self._page_size(env))

    def used_extent_bytes(self) -> int | None:
        """Pages up to the newest snapshot's last page: grows only when a commit finds no free page to reuse."""
        env = self._environment()  # read again where another process grew the map meanwhile
        return space.read_retried(lambda: space.used_extent_bytes(env, self._page_size(env)), lambda: self._adopt_resize(env), self.path)

    def _page_size(self, env: lmdb.Environment) -> int:
        if self._page_bytes is None:
            self._page_bytes = space.page_bytes(env)
        return self._page_bytes

