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
    * :class:`GrowthWatch` names the processes whose reader slots hold the
      same old snapshot for :data:`STUCK_S` (``ucm_db.engines.lmdb.readers``)
      while the data file is past its bound, at most once per
      :data:`GROWTH_WARN_INTERVAL_S` and only while it keeps growing: such a
      process (stopped while it wrote, or in a long read) cannot be helped
      from here, only named.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ucm_db.engines.base import Engine
from ucm_db.errors import TierError

NOT_RECORDED = "synced, but its snapshot could not be recorded"
#: The shortest time between two warnings of one store's growth (:class:`GrowthWatch`).
GROWTH_WARN_INTERVAL_S = 60.0
#: The data file's bound: this many times the capacity, plus as many sync budgets (RELIABILITY.md: a
#: 4 MiB store churned stays at 13-21 MiB; only a snapshot held for many budgets takes it past).
GROWTH_BOUND_CAPACITIES, GROWTH_BOUND_BUDGETS = 2, 8
#: A reader slot on the same snapshot this long, while the file is past its bound, is named (a live
#: process's pin moves at each of its syncs).
STUCK_S = 5.0

logger = logging.getLogger("ucm_db")


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
            hint="check the disk under the store (`dmesg`, free space, write access to its lmdb/ directory); "
                 "puts resume once a sync succeeds (the background retries every sync_interval_s; "
                 "Store.flush() tries one now)",
        )


class GrowthWatch:
    """Warns, naming them, of the processes whose old snapshots keep one
    store's data file growing (module invariants): reader slots of other
    processes that held the same snapshot for :data:`STUCK_S` at least
    while the file was past its bound. Called by the maintenance thread
    after its syncs (one caller)."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._warned_s = float("-inf")
        self._warned_bytes = 0
        self._seen_s: dict[tuple[int, int], float] = {}  # (pid, snapshot) -> when first seen past the bound

    def check(self, engine: Engine, capacity_bytes: int, budget_bytes: int) -> None:
        describe: Callable[[], list[tuple[int, int, str]]] | None = getattr(engine, "lagging_readers", None)
        if describe is None:
            return  # only LMDB has reader slots
        bound = GROWTH_BOUND_CAPACITIES * capacity_bytes + GROWTH_BOUND_BUDGETS * budget_bytes
        file_bytes = engine.file_bytes()
        if file_bytes <= max(bound, self._warned_bytes):
            self._seen_s.clear()
            return
        now = time.monotonic()
        slots = describe()
        self._seen_s = {(pid, txnid): self._seen_s.get((pid, txnid), now) for pid, txnid, _ in slots}
        stuck = [phrase for pid, txnid, phrase in slots if now - self._seen_s[(pid, txnid)] >= STUCK_S]
        if not stuck or now - self._warned_s < GROWTH_WARN_INTERVAL_S:
            return
        self._warned_s, self._warned_bytes = now, file_bytes
        logger.warning(
            "ucm-db store %s: its data file is %d MiB, past its bound of %d MiB, and grows: %s, and LMDB reuses no "
            "page freed since (a process stopped with SIGSTOP or Ctrl-Z, or hung?). Resume or end it; "
            "`ucm-db compact` returns the space once it is gone", self._path, file_bytes >> 20, bound >> 20,
            "; ".join(stuck))
