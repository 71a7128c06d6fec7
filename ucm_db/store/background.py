"""One process's background work for an open store: reader activity and
the maintenance thread.

Reads never take the writer lock nor open a write transaction: their LRU
touches and hit/miss counts are buffered here and written by the maintenance
thread every ``sync_interval_s``, or sooner once ``ACTIVITY_FLUSH_KEYS``
touches are buffered (the read that crosses it wakes the thread and
returns), or folded into the transaction of a put that evicts, which must
see them (:class:`ReadsForEviction`). With group
durability the same thread syncs the engine every interval, and as soon as
``sync_bytes`` were committed since the last sync, or the engine's data file
grew by ``sync_bytes`` since then. The budget between syncs is
``sync_bytes`` but at most half the store's capacity (at least 1 MiB), and a
writer that outruns the syncs by two budgets waits for one: a 4 MiB store
synced every 32 MiB grew its file to 113 MiB under 64 KiB churn (issue 46
finding 6), 16 MiB now (13 MiB at 256 KiB blocks, and its puts 1.3x
faster). Payloads of a few pages stay looser: 8 KiB blocks plateau near
57 MiB, LMDB's overflow pages needing contiguous runs of the single free
pages the B-tree leaves.

A block read again soon after its recency was written is not written again
at once: the maintenance round keeps its touch back until
``RECENCY_REFRESH_S`` have passed since this process wrote it (about once
per that interval per block, as a cache's LRU refresh time does), then
writes the newest touch and every round's hit. A prefix loaded by every
request cost the engine's process a write per block and second
(7-8 us each; a 2-layer model's agentic pass, 2.6% of a core).
An evicting put and an explicit flush or close take every touch kept back,
so eviction in this process always sees them; a put in another process
sees a block's recency at most ``RECENCY_REFRESH_S`` plus one interval late.

Why growth counts: a process that commits to a group-durable LMDB store
pins its last synced snapshot until its next sync
(``ucm_db.engines.lmdb.groupsync``; a process that only reads pins none), so
no page freed after that snapshot is reused before the next sync, and every
page a commit copies on write goes to the end of the file. Small-payload commits (index-heavy puts, deletes,
evictions) write few payload bytes but copy many B-tree pages: counted by
payload alone, a burst of them grew a store's file to 4.5x its live pages,
and the hundreds of thousands of single free pages left behind made every
later put of large blocks scan them for a contiguous run (LMDB's
``mdb_page_alloc``): 16x slower puts of 512 KiB blocks in a 1M-block store.
So once the growth beyond the payload committed (``excess growth``: pages
copied on write that the pin keeps from being reused) reaches ``sync_bytes``,
the commit wakes the sync and waits (outside every lock) until a sync
completes and moves the pin (waiting only from 4x ``sync_bytes`` left a
200k-block burst's file at 765 MB, against 561 MB):
the file's growth beyond its live pages stays bounded whatever the mix of
commits, at the price of index-heavy bursts running at the disk's sync pace
(a process stopped while it holds a pin aside: LMDB reuses nothing freed
after any reader's snapshot; the thread names such a process once the file
passes its bound, :class:`~ucm_db.store.sync_health.GrowthWatch`).
The check runs after puts and deletes; growth from other writes (a large flush
of reader touches, the uploader's queue marks) is part of the extent the
next put measures, and a reader never waits: lookups stay off this path.
Where several processes write one store, each sees the others' payload as
growth of its own: it may wait for a sync of its own a little more often
(about a dozen waits per run of the crash loop's writers), never longer than
one sync (GROWTH_WAIT_S at most).

Invariants:
    * Buffered activity is never dropped while the store is open: a failed
      write hands it back to the buffer (:meth:`Background.give_back`).
    * A failed maintenance round is counted in ``errors`` and retried next
      interval; its warning is logged at most once per
      :data:`FAILURE_LOG_INTERVAL_S` (a full disk fails every round), and
      one INFO line says when a round succeeds again. If the thread itself dies, its exception
      stays in ``failure`` and the store refuses puts: with group durability a store that nobody
      syncs must not go on acknowledging writes. Nor one whose syncs fail: once two sync budgets were
      committed since the last sync that succeeded, and the last one failed, puts are refused
      (:mod:`ucm_db.store.sync_health`) until a sync succeeds (a round's or an explicit flush's; a
      sync that could not record its snapshot fails). The rounds also sweep dead writers'
      provisional blocks (:mod:`ucm_db.store.provisional`).
    * A :class:`Background` belongs to the process that made it; a forked child makes its own.
    * A read-only store (``config.read_only``) has no thread and writes
      nothing: hits and misses are counted in memory (``stats()`` shows
      them), LRU touches are not kept.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ucm_db.cpu_placement import place_current_thread
from ucm_db.config import StoreConfig
from ucm_db.engines.base import Engine
from ucm_db.errors import TierError
from ucm_db.store.sync_health import GrowthWatch, SyncHealth
from ucm_db.index.local import LocalTier, PendingActivity
from ucm_db.index.writes import ANCESTOR_RECENCY_SLACK_NS

logger = logging.getLogger("ucm_db")

#: Buffered touches that make a read wake the maintenance thread to write
#: them (before this interval ends); the read itself never writes.
ACTIVITY_FLUSH_KEYS = 4096
#: Longest wait of a commit for a sync after ``sync_bytes`` of excess growth
#: (module doc): a sync slower than this (a stalled disk) lets the
#: writer go on rather than hang it; the interval sync still runs.
GROWTH_WAIT_S = 30.0
#: The smallest sync budget (:attr:`Background.sync_budget_bytes`).
MIN_SYNC_BUDGET_BYTES = 1 << 20
#: A block whose recency this process wrote less than this long ago has a new touch kept back by the
#: maintenance rounds (module doc); at least half of it has passed when the touch is written. The same
#: staleness the index allows an ancestor's recency (one notion of "recent enough").
RECENCY_REFRESH_S = ANCESTOR_RECENCY_SLACK_NS / 1e9
#: Failing maintenance rounds log at most one warning this often (module invariants).
FAILURE_LOG_INTERVAL_S = 60.0


class ReadsForEviction:
    """The reads a put must apply before it evicts, and only then.

    A put that evicts must see every read buffered so far, or it could evict
    a block just read. A put that does not evict leaves the reads buffered:
    the maintenance thread writes them in its rounds, where repeated reads of
    the same block between rounds cost one write, not one per put (a hot
    prefix read by every request, its blocks' recency rewritten by every
    save that followed). The tier calls it once per attempt of the put's
    transaction (an attempt may be retried), with whether that attempt
    evicts; :meth:`settle` then hands back whatever the committed attempt
    did not apply."""

    def __init__(self, background: Background) -> None:
        self._background = background
        self._taken: PendingActivity | None = None
        self._applied = False

    def __call__(self, evicting: bool) -> PendingActivity | None:
        self._applied = evicting
        if not evicting:
            return None
        if self._taken is None:
            self._taken = self._background.take()
        return self._taken

    def settle(self, committed: bool) -> None:
        """After the put: the reads taken go back to the buffer unless a
        committed attempt applied them."""
        if self._taken is not None and not (committed and self._applied):
            self._background.give_back(self._taken)
        self._taken = None


class Background:
    """Activity buffer and maintenance thread of one store in one process."""

    def __init__(self, path: Path, engine: Engine, tier: LocalTier, config: StoreConfig,
                 sweep: tuple[Callable[[], object], float] | None = None) -> None:
        self._path = path
        self._sweep = sweep  # provisional blocks of dead writers (store/provisional.py), and its interval
        self._engine = engine
        self._tier = tier
        self._config = config
        self._lock = threading.Lock()
        self._activity = PendingActivity()
        # Touches kept back (module doc), by when this process last wrote the
        # block's recency: in the current half of RECENCY_REFRESH_S (its
        # keys in _refreshed) or in the one before (_refreshed_before).
        # Both under _lock; the older are written at the next rotation.
        self._kept_fresh, self._kept_before = PendingActivity(), PendingActivity()
        self._refreshed: set[bytes] = set()
        self._refreshed_before: set[bytes] = set()
        self._refreshed_since_s = time.monotonic()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._unsynced_bytes = 0
        self._extent_at_sync: int | None = None  # engine.used_extent_bytes() when the last sync started
        self._synced = threading.Condition(self._lock)  # notified when a sync completes
        self._syncs_done = 0
        self._flush_due = False  # a read buffered ACTIVITY_FLUSH_KEYS touches (under _lock)
        self._sync_due = False  # a commit asked for a sync (under _lock)
        self.errors = 0
        self._failed_rounds = 0  # failed rounds since the last warning (maintenance thread only, as the two below)
        self._failure_logged_s = float("-inf")  # when the last warning was logged
        self._failure_logged = False  # a warning was logged and no round has succeeded since
        self.failure: BaseException | None = None
        self.health = SyncHealth(path)  # sync outcomes: puts are refused while syncs fail (sync_health.py)
        self._growth = GrowthWatch(path)  # names a process whose old snapshot keeps the file growing
        self._thread = threading.Thread(target=self._run, name="ucm-db-maintenance", daemon=True)

    def start(self) -> None:
        if not self._config.read_only:  # nothing to flush or sync
            self._thread.start()

    def stop(self) -> None:
        """Stops the thread (after its current round); idempotent."""
        self._stop.set()
        self._wake.set()
        with self._lock:
            self._synced.notify_all()  # a writer waiting for a sync goes on
        if self._thread.is_alive():
            self._thread.join()

    # -- reader activity -----------------------------------------------------------
    def record_reads(self, keys: Sequence[bytes], results: Sequence[Any], *, touch: bool = True) -> None:
        """Counts a read's hits (``results[i]`` not None, touching the key
        unless ``touch`` is False) and misses; see :meth:`record_touches`."""
        with self._lock:
            activity = self._activity
            hits = sum(value is not None for value in results)
            activity.hits += hits
            activity.misses += len(results) - hits
        if touch:
            self.record_touches([key for key, value in zip(keys, results) if value is not None])

    def record_touches(self, keys: Sequence[bytes]) -> None:
        """Marks ``keys`` as read now (recency, per-block hits); when many
        touches are buffered, wakes the maintenance thread to write them. A
        read never writes (no write transaction, no writer lock): its
        recency reaches the index through that thread, or a put that
        evicts. A read-only store keeps none."""
        if self._config.read_only or not keys:
            return
        now = time.time_ns()
        with self._lock:
            touched = self._activity.touched
            for key in keys:
                touched[key] = now
            if len(touched) >= ACTIVITY_FLUSH_KEYS and not self._flush_due:
                self._flush_due = True
                self._wake.set()  # the maintenance thread writes them: never the reader

    def take(self) -> PendingActivity:
        """The buffered activity, touches kept back included, for a write
        to fold in (the buffer starts empty); hand it back with
        :meth:`give_back` if the write fails."""
        with self._lock:
            activity, self._activity = self._activity, PendingActivity()
            activity.merge(self._kept_fresh)
            activity.merge(self._kept_before)
            self._kept_fresh, self._kept_before = PendingActivity(), PendingActivity()
        return activity

    def give_back(self, activity: PendingActivity) -> None:
        with self._lock:
            self._activity.merge(activity)

    def flush_activity(self, *, keep_back_recent: bool = False) -> None:
        """Writes the buffered activity in one transaction (a read-only
        store keeps its counts in memory); with ``keep_back_recent`` (the
        maintenance rounds), touches of blocks whose recency this process
        wrote within ``RECENCY_REFRESH_S`` stay buffered (module doc)."""
        if self._config.read_only:
            return
        activity = self._round_activity() if keep_back_recent else self.take()
        try:
            self._tier.apply_activity(activity)
        except BaseException:
            self.give_back(activity)
            raise
        if keep_back_recent:  # only the rounds, which rotate them, fill the sets
            with self._lock:
                self._refreshed.update(activity.touched)

    def _round_activity(self) -> PendingActivity:
        """What a maintenance round writes: the new touches of blocks not
        refreshed lately, and the touches kept back that are now due. The
        rest stays kept back, where an evicting put still takes it. Costs
        the new touches and the due ones, never the whole kept-back set."""
        with self._lock:
            activity, self._activity = self._activity, PendingActivity()
            due = None
            elapsed_s = time.monotonic() - self._refreshed_since_s
            if elapsed_s >= RECENCY_REFRESH_S / 2:
                due, self._kept_before, self._kept_fresh = self._kept_before, self._kept_fresh, PendingActivity()
                self._refreshed_before, self._refreshed = self._refreshed, set()
                if elapsed_s >= RECENCY_REFRESH_S:  # both halves are over: every touch kept back is due
                    due.merge(self._kept_before)
                    self._kept_before, self._refreshed_before = PendingActivity(), set()
                self._refreshed_since_s = time.monotonic()
            fresh, before = self._refreshed, self._refreshed_before
            for key in [key for key in activity.touched if key in fresh or key in before]:
                kept = self._kept_fresh if key in fresh else self._kept_before  # kept back before too: both rounds' hits
                kept.add(key, activity.touched.pop(key), activity.earlier_rounds.pop(key, 0))
            if due is not None:
                activity.merge(due)
        return activity

    def pending_counts(self) -> tuple[int, int]:
        """(hits, misses) buffered and not yet written."""
        with self._lock:
            return self._activity.hits, self._activity.misses

    # -- durability ----------------------------------------------------------------
    def committed(self, stored_bytes: int) -> None:
        """Counts group-commit bytes; wakes the sync once ``sync_bytes`` are
        unsynced or the data file grew by ``sync_bytes`` since the last sync
        (module doc), so the disk's write-back overlaps the next puts."""
        if self._config.durability != "group":
            return
        extent = self._engine.used_extent_bytes()
        limit = self.sync_budget_bytes
        self.health.committed(stored_bytes)
        with self._lock:
            self._unsynced_bytes += stored_bytes
            if self._extent_at_sync is None:
                self._extent_at_sync = extent
            grown = 0 if extent is None or self._extent_at_sync is None else extent - self._extent_at_sync
            excess = grown - self._unsynced_bytes
            if max(self._unsynced_bytes, excess) >= limit:
                self._sync_due = True
                self._wake.set()
            # Writers outpacing the syncs wait too: growth stays within a
            # few budgets whatever the block size (issue 46 finding 6).
            if (excess >= limit or self._unsynced_bytes >= 2 * limit) and self._thread.is_alive():
                target = self._syncs_done + 1
                self._synced.wait_for(lambda: self._syncs_done >= target or self._stop.is_set(), GROWTH_WAIT_S)

    def sync_now(self) -> None:
        """An explicit sync (``Store.flush``), which counts as a round's:
        its success lifts a refusal of puts, its failure is the last, and
        the bytes it covers start no round's sync again."""
        self._synced_by(self._engine.sync)

    def _synced_by(self, sync: Callable[[], bool | None]) -> None:
        """Runs ``sync`` (a round's or an explicit one): the unsynced count
        and the extent start again when it begins, and a writer waiting for
        a sync is released when it ends, whatever its outcome
        (:attr:`health` records that)."""
        extent = self._engine.used_extent_bytes() if self._config.durability == "group" else None
        with self._lock:
            self._unsynced_bytes = 0
            self._extent_at_sync = extent
        try:
            self.health.run(sync)
        finally:
            with self._lock:
                self._syncs_done += 1
                self._synced.notify_all()

    def sync_refusal(self) -> TierError | None:
        """Why a put is refused now, or None (:meth:`SyncHealth.refusal`)."""
        return self.health.refusal(self.sync_budget_bytes)

    @property
    def sync_budget_bytes(self) -> int:
        """Bytes between syncs: ``sync_bytes``, but at most half the
        store's capacity (at least 1 MiB): the pinned snapshot keeps a
        sync period's freed pages from reuse, so a small store synced only
        every 32 MiB grew its file to 25x its capacity under churn."""
        return min(self._config.sync_bytes, max(MIN_SYNC_BUDGET_BYTES, self._config.capacity_bytes // 2))

    @property
    def unsynced_bytes(self) -> int:
        """Group-commit bytes since the last sync started."""
        with self._lock:
            return self._unsynced_bytes

    def _run(self) -> None:
        place_current_thread()
        try:
            # A wake (a read's touches, a commit's bytes) never restarts the
            # interval: the periodic flush and sync keep their own clock.
            next_round_s = time.monotonic() + self._config.sync_interval_s
            next_sweep_s = time.monotonic() + self._sweep[1] if self._sweep is not None else float("inf")
            while True:
                self._wake.wait(max(0.0, min(next_round_s, next_sweep_s) - time.monotonic()))
                self._wake.clear()
                if self._stop.is_set():
                    return
                periodic = time.monotonic() >= next_round_s
                if periodic:
                    next_round_s = time.monotonic() + self._config.sync_interval_s
                with self._lock:
                    flush, sync = periodic or self._flush_due, periodic or self._sync_due
                    self._flush_due = self._sync_due = False
                try:
                    if flush:
                        self.flush_activity(keep_back_recent=True)
                    if sync and self._config.durability == "group":
                        self._synced_by(self._engine.sync_round)
                        self._growth.check(self._engine, self._config.capacity_bytes, self.sync_budget_bytes)
                    if self._sweep is not None and time.monotonic() >= next_sweep_s:
                        next_sweep_s = time.monotonic() + self._sweep[1]
                        self._sweep[0]()
                except Exception as exc:  # noqa: BLE001 - logged, counted, retried next round
                    self.errors += 1
                    self._round_failed(exc)
                else:
                    if self._failure_logged and (flush or sync):
                        logger.info("ucm-db store %s: background sync/flush works again", self._path)
                        self._failure_logged = False
        except BaseException as exc:
            self.failure = exc
            logger.error("ucm-db store %s: the maintenance thread died; puts are refused until reopen: %r", self._path, exc)

    def _round_failed(self, exc: Exception) -> None:
        """Logs a failed round's warning, at most once per :data:`FAILURE_LOG_INTERVAL_S`."""
        self._failed_rounds += 1
        if time.monotonic() - self._failure_logged_s < FAILURE_LOG_INTERVAL_S:
            return
        logger.warning("ucm-db store %s: background sync/flush failed (retrying every round; %d failed rounds since the last "
                       "such line, which repeats at most once a minute): %s", self._path, self._failed_rounds, exc)
        self._failure_logged_s, self._failed_rounds, self._failure_logged = time.monotonic(), 0, True
