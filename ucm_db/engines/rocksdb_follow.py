"""A read-only RocksDB store following its writer.

A read-only open reads a shadow of the store as of one moment
(:mod:`~ucm_db.engines.rocksdb_shadow`): RocksDB's own read-only instances
never see a later commit, and its secondary instances are unusable here
(that module's docs). Left there, a read-only store beside its writer
(a ``kv_consumer`` on a read-only volume, a tool held open) served the epoch
it opened at after a ``bump_epoch`` (``ucm-db invalidate``, a reset): the
invalidated KV, for the life of the process. So the engine opens the store
again when the writer has changed it.

Invariants:
    * A thread of the store checks every :data:`FOLLOW_S` whether the
      store's directory changed since the bound open (one listing with a
      ``stat`` of each file: name, size, modification time; RocksDB's info
      logs and ``LOCK`` left out). A commit appends to the write-ahead log,
      so it changes the listing; a store nobody writes is never reopened.
      Reads never open: an open beside a live writer replays its
      write-ahead log (up to ``MAX_WAL_BYTES``: 0.5-0.6 s measured beside
      a writer of 65,536 blocks, 25 ms with no log to replay); the new open
      is bound at once; the old one is closed by its last read
      (:class:`Lease`).
    * The listing is taken before the open it is compared against: a commit
      landing between the two is seen as a change at the next check (one
      reopen too many, never one too few). So a commit is seen by reads
      that begin at most :data:`FOLLOW_S` plus one open after it.
    * A reopen that fails keeps the open it had and is tried again at the
      next check. Closing the store ends the thread first.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable
from pathlib import Path

from ucm_db.errors import ClosedError

logger = logging.getLogger("ucm_db")
#: Seconds between checks of a read-only store's directory (a reopen costs
#: 25-29 ms with no write-ahead log to replay, 0.5-0.6 s beside a live writer).
FOLLOW_S = 1.0
#: Files whose changes say nothing of the store's contents.
_IGNORED = ("LOG", "LOCK")

Listing = tuple[tuple[str, int, int], ...]


def listing(path: Path) -> Listing:
    """Name, size and modification time of every file of ``path`` but the
    ignored ones; empty for a directory gone."""
    found = []
    try:
        with os.scandir(path) as entries:
            for entry in entries:
                if entry.name.startswith(_IGNORED):
                    continue
                try:
                    st = entry.stat()
                except FileNotFoundError:
                    continue  # deleted by the writer since the listing began
                found.append((entry.name, st.st_size, st.st_mtime_ns))
    except FileNotFoundError:
        return ()
    return tuple(sorted(found))


class Follower:
    """A read-only store's thread that opens it again when its writer has
    changed it (module invariants). Make it before the store's first open,
    then :meth:`start` it."""

    def __init__(self, path: Path, interval_s: float | None = None) -> None:
        self._path = path
        self._interval_s = FOLLOW_S if interval_s is None else interval_s  # read now: a test may shorten it
        self._seen = listing(path)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failed = False  # the last reopen failed: the next failure is logged at debug level

    def start(self, reopen: Callable[[], None]) -> None:
        """Checks every ``interval_s`` in a daemon thread, calling
        ``reopen`` (a bound method, held weakly: a store never closed is
        still collected) after each change found, until :meth:`stop`."""
        method = weakref.WeakMethod(reopen)
        self._thread = threading.Thread(target=self._run, args=(method,), name="ucm-db-rocksdb-follow", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Ends the thread, after the reopen it may be in."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self, method: weakref.WeakMethod[Callable[[], None]]) -> None:
        while not self._stop.wait(self._interval_s):
            reopen = method()
            if reopen is None:
                return  # the engine was collected
            try:
                going = self.check(reopen)
            except Exception:  # noqa: BLE001 - a thread that died would leave the store at one moment for good
                logger.exception("ucm-db: following read-only RocksDB store %s failed; checked again in %g s",
                                 self._path, self._interval_s)
                going = True
            del reopen  # no strong reference while waiting: a store never closed is collected
            if not going:
                return

    def check(self, reopen: Callable[[], None]) -> bool:
        """Calls ``reopen`` if the directory changed since the bound open;
        False once the store is closed. A failed reopen is logged (a
        warning the first time in a row) and leaves the change to the next
        check."""
        try:
            now = listing(self._path)
            if now == self._seen:
                return True
            reopen()
        except ClosedError:
            return False
        except Exception as exc:  # noqa: BLE001 - reads go on with the open they have
            (logger.debug if self._failed else logger.warning)(  # a listing's OSError too (EIO, ESTALE)
                "ucm-db: read-only RocksDB store %s cannot be opened again to see its writer's commits "
                "(tried again in %g s): %s", self._path, self._interval_s, exc)
            self._failed = True
        else:
            self._seen, self._failed = now, False
        return True


class Lease:
    """The reads in flight on one open of a store (its database, tables and
    shadow). A swap (a follower's reopen, a failed-write recovery) binds the
    new open at once and retires the old one: released by its last read, or
    at once where none runs. A swap never waits for reads, nor a read for a
    swap (a swap that waited for the reads in flight held every new read
    behind the longest one: 233 ms at p99 beside a 0.29 s walk). Counted
    under the engine's commit lock; :attr:`released` is set once the
    retired open's release has run (raised included), for a caller that
    needs it closed (a writable open needs the failed one's ``LOCK``)."""

    def __init__(self) -> None:
        self._readers = 0
        self._release: Callable[[], None] | None = None
        self.released = threading.Event()

    def enter(self) -> Lease:
        self._readers += 1
        return self

    def leave(self) -> Callable[[], None]:
        """What the caller runs outside the lock: the retired open's
        release if this was its last read, else nothing."""
        self._readers -= 1
        return self._release if self._readers == 0 and self._release is not None else _nothing

    def retire(self, release: Callable[[], None]) -> Callable[[], None]:
        """``release`` (then :attr:`released` set) where no read is in
        flight (the caller runs it outside the lock), else nothing: kept
        for the last read."""
        def run() -> None:
            try:
                release()
            finally:
                self.released.set()
        self._release = run
        return run if self._readers == 0 else _nothing


def _nothing() -> None:
    return None

