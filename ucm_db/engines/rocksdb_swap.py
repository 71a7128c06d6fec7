"""The RocksDB engine's recovery after a failed write: the failed open
swapped for a read-only stand-in, then for a writable open.

A failed write or sync (a full disk) leaves RocksDB refusing every write
until the database is opened again; the batch that failed was never applied.

Invariants:
    * The engine's write lock is held throughout (a recovery runs before the
      next write or sync, never on a read's path), so no commit lands meanwhile.
    * Reads never wait for a recovery: the failed open is swapped for a
      read-only stand-in (:meth:`RocksDbEngine._swap`, the one way the engine
      swaps an open, rocksdb_follow's :class:`~ucm_db.engines.rocksdb_follow.Lease`):
      a new read goes to the stand-in at once, one in flight keeps the failed
      open, which its last read closes (its background work cancelled first).
    * The writable open waits for that close: the failed open holds RocksDB's
      ``LOCK``. Where no stand-in opens (reads then wait for the recovery, on
      the write lock), the same wait.
    * A failed writable open keeps the stand-in and is tried again once
      :data:`REOPEN_SPACE_BYTES` more are free or :data:`REOPEN_RETRY_S` passed;
      until then a write or sync fails at once with a
      :class:`~ucm_db.errors.TierError` naming the disk.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ucm_db.engines.base import free_bytes
from ucm_db.errors import TierError
from ucm_db.engines.rocksdb_follow import Lease

logger = logging.getLogger("ucm_db")
DISK_HINT = "free space on that disk (the store resumes writing once there is room), or lower capacity_bytes"
#: Seconds between tries to reopen after a failed write (a try replays the log: 30-70 ms on a full 40 MiB disk).
REOPEN_RETRY_S = 1.0
#: Free disk space grown by this much since a failed reopen makes the next write try again at once.
REOPEN_SPACE_BYTES = 1 << 20

#: An open of the store (its database and what removes its shadow, or None).
Opened = tuple[Any, Any]


class Recovery:
    """One writable engine's recovery state (module invariants)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stand_in = False  # a read-only stand-in is bound for the failed open
        self._swapped = False  # the failed open was swapped out (a stand-in that would not open is warned of once)
        self._retry_at_s, self._retry_free_bytes, self._error = 0.0, 0, ""

    def recover(self, swap: Callable[[Opened | None, bool], Lease], open_read_only: Callable[[], Opened],
                open_writable: Callable[[], Opened]) -> None:
        """Reopens the store writable after a failed write, with the engine's
        ``swap``(new, failed) and openers. Raises :class:`TierError` when the
        reopen fails or is not due again."""
        if time.monotonic() < self._retry_at_s and (free_bytes(self.path) or 0) < self._retry_free_bytes + REOPEN_SPACE_BYTES:
            raise TierError(f"RocksDB store at {self.path} cannot be reopened after a failed write (tried again once "
                            f"space is freed, or {REOPEN_RETRY_S:g} s after the last try): {self._error}",
                            hint=DISK_HINT)
        if not self._stand_in:
            stand_in = self._readable(open_read_only)
            swap(stand_in, True).released.wait()  # new reads go to the stand-in; the failed open's last read closes it
            self._stand_in, self._swapped = stand_in is not None, True
        try:
            reopened = open_writable()
        except TierError as exc:
            self._retry_at_s, self._retry_free_bytes, self._error = (
                time.monotonic() + REOPEN_RETRY_S, (free_bytes(self.path) or 0), str(exc))
            raise TierError(f"RocksDB store at {self.path} cannot be reopened after a failed write: {exc}",
                            hint=DISK_HINT) from exc
        swap(reopened, False)  # the stand-in's reads go on; it holds no LOCK: no wait
        self._stand_in = self._swapped = False
        self._retry_at_s = 0.0
        logger.info("ucm-db: reopened RocksDB store %s after a failed write", self.path)

    def _readable(self, open_read_only: Callable[[], Opened]) -> Opened | None:
        """The store opened read-only (no file made: a disk still full), or None."""
        try:
            return open_read_only()
        except Exception as exc:  # noqa: BLE001 - reads then fail with the reopen's error until a reopen works
            (logger.debug if self._swapped else logger.warning)(  # warned once, not at every retry
                "ucm-db: RocksDB store %s cannot be read either until it reopens: %s", self.path, exc)
            return None
