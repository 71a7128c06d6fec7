"""Whether a group store's syncs keep up: what a power loss could take, and
when puts must stop being acknowledged.

:class:`SyncHealth` counts the bytes group commits stored and, per sync,
the total it covers (the count when it began). A sync succeeds when it made
the file durable *and* recorded its snapshot (an unrecorded one is undone
by the rollback after an OS crash: ``ucm_db.engines.lmdb.groupsync``).

Invariants:
    * ``undurable`` (bytes committed since the start of the last sync that
      succeeded) only grows by commits and only shrinks by a success: two
      syncs running at once (a round and a flush) never count a byte twice.
    * The outcome that counts is that of the sync started last among those
      that ended: a slow failed round never hides a newer flush's success,
      nor a stale success a newer failure.
    * Puts are refused (:meth:`SyncHealth.refusal`) only while the outcome
      that counts is a failure and ``undurable`` reached two sync budgets:
      the loss a power cut could cause stays bounded, and one failed sync
      under a light load refuses nothing.
    * Only the error's text is kept: an exception's frames would keep the
      failed sync's transactions alive.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from ucm_db.errors import TierError

NOT_RECORDED = "synced, but its snapshot could not be recorded (another process held the sync record's lock)"


class SyncHealth:
    """Sync outcomes and group-commit bytes of one store in one process (module invariants). Thread-safe."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._lock = threading.Lock()
        self._committed_total_bytes = 0
        self._durable_total_bytes = 0
        self._syncs_started = 0
        self._settled = 0  # the start number of the sync whose outcome counts
        self._error: str | None = None

    def committed(self, stored_bytes: int) -> None:
        with self._lock:
            self._committed_total_bytes += stored_bytes

    def run(self, sync: Callable[[], bool | None]) -> None:
        """Runs ``sync`` (True or None: durable and recorded; False: synced
        but not recorded, a failure) and settles its outcome; what it
        raises is a failure too, and is raised."""
        with self._lock:
            self._syncs_started += 1
            number, covered = self._syncs_started, self._committed_total_bytes
        error: str | None = None
        try:
            error = None if sync() is not False else NOT_RECORDED
        except BaseException as exc:
            error = str(exc) or repr(exc)
            raise
        finally:
            with self._lock:
                if number > self._settled:
                    self._settled, self._error = number, error
                if error is None:
                    self._durable_total_bytes = max(self._durable_total_bytes, covered)

    def refusal(self, budget_bytes: int) -> TierError | None:
        """Why a put is refused now, or None (module invariants)."""
        with self._lock:
            error, undurable = self._error, self._committed_total_bytes - self._durable_total_bytes
        if error is None or undurable < 2 * budget_bytes:
            return None
        return TierError(
            f"store {self._path}: its syncs fail ({error}), and the {undurable} bytes committed since the last "
            "one that succeeded are not durable: puts are refused until a sync succeeds",
            hint="check the disk under the store (`dmesg`, free space) and that no stopped process holds its "
                 "lmdb/synced-snapshot; puts resume once a sync succeeds (the background retries every "
                 "sync_interval_s; Store.flush() tries one now)",
        )
