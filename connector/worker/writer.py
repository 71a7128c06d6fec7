"""Background writer: compression and commit of saved blocks off the forward pass.

The worker copies the units of newly computed blocks out of the paged KV
cache into a staging buffer during ``wait_for_save`` (beside an
accelerator it queues that copy, and this thread waits for it) and hands
the buffer here; one thread encodes and commits the jobs: all the unit chains (a KV
head's units of consecutive blocks) of the jobs queued when it takes one, up
to :data:`COALESCE_MAX_BYTES`, in one transaction (``Store.put_segments``):
a backlog costs one commit per writer round, not one per engine step. When
the queue runs dry before that, a round waits up to :data:`LINGER_S` for
more: steps that each save a block or two, as decoding ones do, then share
a commit (``ucm-db bench writer --backlog steps``, saves 2 ms apart: 10x
fewer commits, 1.4-1.6x the bytes saved per writer CPU second, a third
fewer bytes written at 16 KiB units).

Invariants:
    * Jobs commit in submission order (one thread, FIFO), so a request's
      chain segment is committed before the segment that names it as parent.
    * Jobs taken together are consecutive in the queue and of one
      namespace; a void, a job of another namespace or ``close`` ends the
      round (it runs after the round commits). A round lingers for more
      jobs at most :data:`LINGER_S` from its start, and not at all once a
      :meth:`drain` (a ``kv_producer``'s step, a test) or ``close`` is
      queued: a drain returns as soon as what was queued before it is
      committed, never later for the linger.
    * Each unit chain keeps the prefix invariant on its own, which is what
      lookups rely on (:func:`ucm_db.keys.units.stored_prefix`): if a round's
      one transaction fails on a missing parent (one head's parent evicted
      meanwhile) or on capacity (all heads together do not fit), its jobs
      are committed one by one, and such a job's chains one by one, so the
      others still land.
    * At most ``max_pending_bytes`` of staging wait in the queue, counted
      as the buffers the jobs hold (:attr:`SaveJob.queued_bytes`: a pooled
      buffer holds up to twice its save's rows); a job that would exceed it
      is dropped and counted (the cache is best effort; the forward pass
      never waits for the disk). A job larger than the whole bound can never
      be stored: the first one is logged with the fix; queue-full drops are
      logged at most once a minute.
    * A failed put (missing parent after an eviction, full store, I/O error)
      loses only that job (an I/O error: that round): counted in ``save_errors``
      and logged at most once a minute (a full disk fails every round; an INFO
      line says when saves commit again), the thread goes on.
    * The thread outlives any exception (a ``kv_producer`` drains it every step): an unexpected one ends
      its round (blocks not yet counted go to ``save_errors``, a void is left undone, items still marked
      done), logged with its traceback at most once a minute.
    * A :class:`~ucm_db.connector.worker.voids.VoidJob` (a save whose KV was
      computed over a failed load, metadata.py) deletes, in queue order (after every save submitted before
      it: never before its save's commit), only the units this writer stored for that save, here and on the
      remote (:mod:`~ucm_db.connector.worker.voids`; tagged provisional in the store until settled).
    * :meth:`close` commits every queued job before returning.
    * A save job is read only once its copy out of the KV caches is done
      (:meth:`SaveJob.copied`: on an accelerator the model's thread only
      queued it, :mod:`~ucm_db.connector.device_saves`); one whose copy
      failed is counted as a save error and never read.
    * A save job's staging goes back to its pool (:mod:`ucm_db.connector.worker.staging`)
      only once the job is committed, failed or dropped (:meth:`SaveJob.done`).
    * With a commit process (``save_process``, :mod:`ucm_db.committer`),
      rounds commit there where their staging is shared
      (:mod:`~ucm_db.connector.worker.commit_route`), with the same
      transactions, fallbacks and counts (commit CPU: the writer thread's
      and the child's).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from vllm.logger import init_logger

import ucm_db
from ucm_db import cpu_placement
from ucm_db.committer import CommitProcess
from ucm_db.connector.device_saves import SaveCopy
from ucm_db.connector.metrics import Counters, LogLimit
from ucm_db.connector.worker.commit_route import CommitRoute
from ucm_db.connector.worker.voids import SaveVoids, VoidJob, VoidTag, batch_order
from ucm_db.errors import MissingAncestorError, StoreFullError, UcmDbError
from ucm_db.keys import Namespace
from ucm_db.keys.units import UnitKeys

logger = init_logger(f"vllm.{__name__}")  # under "vllm" so vLLM's log handler prints it
_RATIO_INTERVAL_S = 2.0
#: Queue-full drops are logged at most this often.
_DROP_LOG_INTERVAL_S = 60.0
#: Most staged bytes one writer round commits in one transaction. Larger
#: LMDB transactions cost more CPU per byte (their dirty pages outgrow the
#: caches): writer CPU per job, medians of 5, 64 MiB -> 4 MiB rounds: 4 x
#: 32 KiB units 0.28 -> 0.20 ms, 4 x 128 KiB 0.56 -> 0.46 ms, 16 x 32 KiB
#: 0.99 -> 0.66 ms (2 to 8 MiB alike; issue 50 item 3). A larger job still
#: commits whole, in a round of its own.
COALESCE_MAX_BYTES = 4 << 20
#: Longest a round waits, from its first job, for more jobs to share its
#: transaction once the queue is empty. A unit's CPU and written bytes fall
#: with the units a commit holds (``ucm-db bench writer``: 2 layers, 16 KiB
#: units, a job of 1-2 blocks a transaction about 100 us a unit and 2.5 bytes
#: written a byte saved; coalesced 54 us and 1.4); saves become visible to
#: lookups this much later at most: an engine step or two.
LINGER_S = 0.02


class _Wake:
    """Queued by :meth:`BackgroundWriter.drain`: ends a round's linger."""


_WAKE = _Wake()


@dataclass(frozen=True)
class SaveJob:
    """Staged units of one chain segment, ready to commit: ``chains[j]``
    holds the keys of the units in ``staging[:, j]``."""

    namespace: Namespace
    chains: tuple[UnitKeys, ...]
    staging: torch.Tensor  # uint8 [blocks, units, unit_bytes], CPU
    event_fields: tuple[ucm_db.BlockEventFields, ...] = ()  # per block: vLLM's KV event fields (events.py)
    evented_chain: int = -1  # the chain whose units carry them (-1: none on this rank)
    release: Callable[[], None] | None = None  # gives ``staging`` back to its pool (staging.py)
    held_bytes: int = 0  # bytes of the pooled buffer ``staging`` is a view of (0: staging alone)
    copy: SaveCopy | None = None  # the copy into ``staging``, if it may still run (device_saves.py)
    void_tag: VoidTag | None = None  # a save a later step may void: what it stores is recorded (voids.py)

    def copied(self) -> bool:
        """Waits until ``staging`` holds the units; False where the copy
        failed on the device (logged: the job is lost, nothing is read)."""
        if self.copy is None:
            return True
        try:
            self.copy.wait()
        except RuntimeError as exc:
            logger.warning("ucm-db: copying %d blocks out of the KV cache failed; they are not saved: %s", self.blocks, exc)
            return False
        return True

    def done(self) -> None:
        """Ends this job's hold on ``staging`` (committed, failed or dropped)."""
        if self.release is not None:
            self.release()

    def evented(self) -> dict[bytes, ucm_db.BlockEventFields] | None:
        """``put``'s ``event_fields``: the evented chain's unit keys to fields."""
        if not self.event_fields or self.evented_chain < 0:
            return None
        return dict(zip(self.chains[self.evented_chain], self.event_fields))

    @property
    def nbytes(self) -> int:
        """Bytes of the staged units (what is saved)."""
        return int(self.staging.numel())

    @property
    def queued_bytes(self) -> int:
        """Bytes this job holds while queued: its whole staging buffer."""
        return max(self.held_bytes, self.nbytes)

    @property
    def blocks(self) -> int:
        return int(self.staging.shape[0])


class BackgroundWriter:
    """One thread committing :class:`SaveJob` s (see module invariants)."""

    def __init__(
        self, store: ucm_db.Store, frames: Callable[[np.ndarray], ucm_db.Framed], counters: Counters, max_pending_bytes: int,
        *, codec_name: str | None = None, committer: CommitProcess | None = None, frame_bytes: tuple[int, ...] | None = None,
    ) -> None:
        """``codec_name``: codec of the saved blocks (None: the store's);
        ``committer``: a commit process for staging in its shared buffers,
        whose units are :class:`ucm_db.Framed` of ``frame_bytes`` (what
        ``frames`` makes of a row)."""
        self._store = store
        self._voids = SaveVoids(store, counters)  # what voidable saves stored, and the voids' deletes (voids.py)
        self._route = CommitRoute(store, frames, codec_name, committer, frame_bytes, self._voids.tag_for)  # commit_route.py
        self._counters = counters
        self._max_pending_bytes = max_pending_bytes
        self._pending_bytes = self._counted_blocks = 0
        self._logged_oversize = False
        # Queue-full drops, unexpected faults and failed puts (a full disk fails every round): a line a minute each.
        self._drop_log, self._fault_log, self._failure_log = (LogLimit(_DROP_LOG_INTERVAL_S) for _ in range(3))
        self._lock = threading.Lock()
        self._queue: queue.Queue[SaveJob | VoidJob | _Wake | None] = queue.Queue()
        self._last_ratio_s = 0.0
        self._thread = threading.Thread(target=self._run, name="ucm-db-writer", daemon=True)
        self._thread.start()

    def submit(self, job: SaveJob) -> bool:
        """Queues a job; False (and counted) if the queue is full."""
        with self._lock:
            if self._pending_bytes + job.queued_bytes > self._max_pending_bytes:
                self._counters.add(saves_dropped=job.blocks)
                job.done()
                self._log_drop(job)
                return False
            self._pending_bytes += job.queued_bytes
        self._queue.put(job)
        return True

    def _log_drop(self, job: SaveJob) -> None:
        """Says why a save was dropped (called under the lock)."""
        if job.queued_bytes > self._max_pending_bytes:
            if not self._logged_oversize:
                self._logged_oversize = True
                logger.warning(
                    "ucm-db: a save of %d blocks holds %d bytes of staging, more than max_pending_save_bytes=%d: "
                    "saves this large are never stored; raise max_pending_save_bytes above %d",
                    job.blocks, job.queued_bytes, self._max_pending_bytes, job.queued_bytes)
            return
        if self._drop_log.due() is not None:
            logger.warning(
                "ucm-db: the save queue is full (%d of max_pending_save_bytes=%d bytes): a save of %d blocks was dropped "
                "(counted in saves_dropped; the disk is slower than the saves: raise the bound or lower the load)",
                self._pending_bytes, self._max_pending_bytes, job.blocks)

    def void(self, job: VoidJob) -> None:
        """Queues a delete behind every save submitted so far (never dropped)."""
        self._queue.put(job)

    def drain(self) -> None:
        """Blocks until every queued job is committed (or failed); a round
        lingering for more jobs commits at once."""
        if self._thread.is_alive():
            self._queue.put(_WAKE)
        self._queue.join()

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        self._route.close()
        self._voids.close()  # the saves' provisional tags not settled: the store's sweep deletes their units

    def _run(self) -> None:
        cpu_placement.place_current_thread()  # encode off the model's cores where it is bound
        carried: list[SaveJob | VoidJob | _Wake | None] = []  # the item that ended the last round
        while True:
            job = carried.pop() if carried else self._queue.get()
            if job is None:
                self._queue.task_done()
                return
            if isinstance(job, _Wake):
                self._queue.task_done()
                continue
            if isinstance(job, VoidJob):
                self._finish([job], lambda voids: self._voids.delete(voids[0]))
                continue
            jobs = self._round(job, carried)
            self._finish(jobs, self._commit_copied)

    def _round(self, first: SaveJob, carried: list[SaveJob | VoidJob | _Wake | None]) -> list[SaveJob]:
        """``first`` and the save jobs queued behind it, or arriving within
        :data:`LINGER_S` of it, that join its transaction; a queue item
        taken that cannot join (a drain's wake among them) goes to ``carried``."""
        jobs, nbytes = [first], first.nbytes
        deadline_s = time.monotonic() + LINGER_S
        while nbytes < COALESCE_MAX_BYTES:
            wait_s = deadline_s - time.monotonic()
            try:
                job = self._queue.get(timeout=wait_s) if wait_s > 0 else self._queue.get_nowait()
            except queue.Empty:
                break
            if not isinstance(job, SaveJob) or job.namespace != first.namespace or nbytes + job.nbytes > COALESCE_MAX_BYTES:
                carried.append(job)
                break
            jobs.append(job)
            nbytes += job.nbytes
        return jobs

    def _finish(self, jobs: Sequence[SaveJob | VoidJob], work: Callable[[Any], None]) -> None:
        """Runs ``work`` over ``jobs`` (one round, or one void), then releases
        their staging and queue places, whatever ``work`` raised."""
        self._counted_blocks = 0
        self._voids.begin_round(any(isinstance(job, SaveJob) and job.void_tag for job in jobs))
        try:
            work(jobs)
            self._update_ratio(jobs[0].namespace)
        except Exception as exc:  # noqa: BLE001 - a dead writer hangs drain(): module invariants
            self._maybe_stored([(job, j) for job in jobs if isinstance(job, SaveJob) for j in range(len(job.chains))])
            lost = max(0, sum(job.blocks for job in jobs if isinstance(job, SaveJob)) - self._counted_blocks)
            self._count_errors(lost)
            if self._fault_log.due() is not None:  # its traceback, once a minute at most
                voided = "; a void not done: its blocks stay stored" if isinstance(jobs[0], VoidJob) else ""
                logger.error("ucm-db: the writer's round failed (%d blocks not saved%s) and it goes on: %s", lost, voided, exc, exc_info=exc)
        finally:
            self._voids.end_round([(job.void_tag, job.chains) for job in jobs if isinstance(job, SaveJob) and job.void_tag])
            with self._lock:
                self._pending_bytes -= sum(job.queued_bytes for job in jobs)
            for job in jobs:
                if isinstance(job, SaveJob):
                    job.done()
                self._queue.task_done()

    def _commit_copied(self, jobs: list[SaveJob]) -> None:
        """Commits the round's jobs whose staging holds their units (the
        others are counted as save errors)."""
        copied = [job for job in jobs if job.copied()]
        if len(copied) < len(jobs):
            self._count_errors(sum(job.blocks for job in jobs) - sum(job.blocks for job in copied))
        if copied:
            self._commit_round(copied)

    def _commit_round(self, jobs: list[SaveJob]) -> None:
        """Commits a round's jobs in one transaction; one by one where that
        fails on a missing parent or on capacity (module invariants)."""
        if len(jobs) == 1:
            self._commit(jobs[0])
            return
        started, started_cpu = time.perf_counter(), time.thread_time()
        self._route.child_cpu_s = 0.0
        evented: dict[bytes, ucm_db.BlockEventFields] = {}
        for job in jobs:
            evented.update(job.evented() or {})
        chains = batch_order([(job, j) for job in jobs for j in range(len(job.chains))])
        try:
            self._voids.stored_by(chains, self._route.put(chains, evented or None))
        except (MissingAncestorError, StoreFullError):
            for job in jobs:
                self._commit(job)
            return
        except (UcmDbError, OSError) as exc:
            self._maybe_stored(chains)
            self._count_errors(sum(job.blocks for job in jobs), exc)
            return
        self._count_saved(jobs, started, started_cpu)

    def _commit(self, job: SaveJob) -> None:
        started, started_cpu = time.perf_counter(), time.thread_time()
        self._route.child_cpu_s = 0.0
        try:
            self._voids.stored(self._route.put([(job, j) for j in range(len(job.chains))], job.evented()), job)
            failed, why = 0, None
        except (MissingAncestorError, StoreFullError):
            failed, why = self._put_one_by_one(job)
        except (UcmDbError, OSError) as exc:
            self._maybe_stored([(job, j) for j in range(len(job.chains))])
            failed, why = len(job.chains), exc
        if failed:
            self._count_errors(job.blocks, why)
            return
        self._count_saved([job], started, started_cpu)

    def _count_saved(self, jobs: list[SaveJob], started: float, started_cpu: float) -> None:
        # CPU read before the wall clock (and after it at the start): the CPU interval lies inside the wall one.
        commit_cpu_s = time.thread_time() - started_cpu + self._route.child_cpu_s
        commit_s = time.perf_counter() - started
        self._counted_blocks += sum(job.blocks for job in jobs)
        self._counters.add(saved_blocks=sum(job.blocks for job in jobs), saved_bytes=sum(job.nbytes for job in jobs),
                           save_commit_s=commit_s, save_commit_cpu_s=commit_cpu_s)
        self._counters.observe("save_commit", commit_s)
        failures = self._failure_log.ended()
        if failures:
            logger.info("ucm-db: saves commit again (%d failed saves since the last warning)", failures)

    def _count_errors(self, blocks: int, exc: BaseException | None = None) -> None:
        """Counts failed saves (``_counted_blocks``: the round's blocks counted, saved or failed); ``exc``,
        why they failed, is logged at most once a minute (module invariants)."""
        self._counted_blocks += blocks
        self._counters.add(save_errors=blocks)
        held = self._failure_log.due() if exc is not None else None
        if held is not None:
            logger.warning("ucm-db: saving %d blocks failed (counted in save_errors; %d more failed saves since the last "
                           "such line, which repeats at most once a minute): %s", blocks, held, exc)

    def _maybe_stored(self, chains: list[tuple[SaveJob, int]]) -> None:
        """A put of ``chains`` raised after perhaps committing: voids count its units as stored (voids.py)."""
        self._voids.maybe_stored(chains)

    def _put_one_by_one(self, job: SaveJob) -> tuple[int, BaseException | None]:
        """Puts each chain on its own; returns how many failed, and why (None: only missing parents)."""
        failed, why = 0, None
        evented = job.evented()
        for j in range(len(job.chains)):
            try:
                self._voids.stored(self._route.put([(job, j)], evented), job)
            except MissingAncestorError:
                # The parent was evicted (or its save dropped) meanwhile: the prefix invariant forbids an orphan.
                failed += 1
                logger.debug("ucm-db: skipped a save whose parent unit is gone")
            except (UcmDbError, OSError) as exc:
                failed, why = failed + 1, exc
                if not isinstance(exc, StoreFullError):
                    self._maybe_stored([(job, j)])
        return failed, why

    def _update_ratio(self, namespace: Namespace) -> None:
        now = time.monotonic()
        if now - self._last_ratio_s < _RATIO_INTERVAL_S:
            return
        self._last_ratio_s = now
        stats = self._store.stats().namespaces.get(namespace.id.hex())
        if stats is not None and stats.stored_bytes:
            self._counters.add(compression_ratio=stats.raw_bytes / stats.stored_bytes)
