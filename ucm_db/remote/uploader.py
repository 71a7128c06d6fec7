"""Background write-back: drains the local tier's durable upload queue.

A block put with ``remote_mode="write_back"`` is committed locally together
with a row in the ``uploads`` table (same transaction). The
:class:`Uploader` thread reads queued keys, uploads their objects to the
remote tier with bounded concurrency, and deletes the rows of the uploads
that succeeded.

Invariants:
    * A queue row is deleted only after its object is fully written, so a
      crash at any point loses nothing: the next process re-uploads (objects
      are immutable and named by key, so a repeat is harmless). Rows of
      blocks under a retracted ancestor (its tombstone on the remote:
      :mod:`ucm_db.remote.ancestry`) are deleted without an upload.
    * :attr:`Uploader.uploaded` counts an upload before its row leaves the
      queue, so when :meth:`Uploader.wait_drained` (``flush``) sees the queue
      empty, the counter already holds every upload of this process.
    * A block evicted or deleted locally leaves the queue in the same
      transaction (the local tier does that); nothing else removes rows.
    * A batch removes a row only while it is still the row of the block the
      batch planned (its ``created_ns``, checked in the removing
      transaction): a block removed and put again meanwhile keeps its new
      row and is uploaded by a later batch.
    * A batch holds the queued ancestors of its blocks
      (:mod:`ucm_db.remote.upload_plan`), and the parent of each of its
      roots is on the remote before it goes (uploaded again from the local
      tier if gc removed it: :mod:`ucm_db.remote.ancestry`). Within a
      batch, shallower blocks are uploaded first.
    * In one process, one upload batch runs at a time: the thread's or a
      write-through put's (``upload_now``), which sends a blob only while it
      is the block queued under the key (same head; one the thread uploaded
      since is skipped) and removes only that block's row. Run outside the
      election, once landed it reopens the retractions of its keys recorded
      (again) since it read them, pending or confirmed, and leaves alone
      those it saw, recorded before the block it sent was stored (that is
      the recomputed block: :func:`ucm_db.index.retractions.reopen`;
      tests/remote/test_audit_uploads_write_through.py,
      tests/remote/test_review_uploads_reopen.py).
    * A batch's objects are durable before its rows go: the directory
      fsyncs of a ``file://`` remote run once per distinct directory at the
      batch's end (:class:`~ucm_db.remote.files.DirSyncs`); a failed one
      keeps every row of the batch queued.
    * Failures back off exponentially (50 ms doubling to 5 s) and retry
      forever; rows stay queued.
    * One uploader per store directory across processes
      (:mod:`ucm_db.remote.election`). A stopped uploader (a store's close,
      which never waits for the remote, and logs the calls it abandons)
      lets go of the election only once every call it started on its pool
      has ended, or with its process (:mod:`ucm_db.remote.upload_pool`): the
      next uploader never confirms a retraction while an upload that read
      the block before its delete may still land.
    * Retractions (remote objects of blocks deleted locally,
      :mod:`ucm_db.remote.retraction`) are deleted by the elected uploader
      after each upload batch, under the same one-batch-at-a-time lock, and
      by a store's :meth:`Uploader.retract_now` right after its delete.
      ``wait_drained`` waits for them too.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

from ucm_db.crashpoints import crashpoint
from ucm_db.cpu_placement import place_current_thread
from ucm_db.errors import ClosedError, TierError
from ucm_db.index.upload_queue import QueuedAs
from ucm_db.remote.ancestry import AncestorRepair
from ucm_db.remote.codec_choice import RemoteCodec
from ucm_db.remote.election import LOCK_NAME as LOCK_NAME, UploaderElection  # LOCK_NAME: re-exported for tools
from ucm_db.remote.retraction import RemoteRetractions
from ucm_db.remote.sending import REMOTE_CODEC_RECORD as REMOTE_CODEC_RECORD, ObjectSender  # re-exported
from ucm_db.remote.upload_plan import BatchPlanner, Item, read_items
from ucm_db.remote.upload_pool import UploadPool
from ucm_db.index.local import LocalTier
from ucm_db.remote.tier import DirSyncs, RemoteRoot

BATCH_KEYS = 256
#: Stored bytes read from the local tier per batch (bounds the uploader's memory).
BATCH_BYTES = 64 << 20
IDLE_POLL_S = 0.5
MIN_BACKOFF_S = 0.05
MAX_BACKOFF_S = 5.0

_log = logging.getLogger("ucm_db")


class Uploader:
    """Drains the upload queue of ``local`` into ``remote`` (a daemon thread).

    Args:
        local: the store's local tier (owns the queue).
        remote: where objects go.
        store_dir: directory holding the election lock file.
        concurrency: uploads in flight at once.
    """

    def __init__(
        self, local: LocalTier, remote: RemoteRoot, store_dir: Path, *, concurrency: int,
        remote_codec: RemoteCodec | None = None,
    ) -> None:
        self.local = local
        self.remote = remote
        self.codec = remote_codec
        self.sender = ObjectSender(local, remote, remote_codec)
        self.concurrency = concurrency
        self.election = UploaderElection(store_dir)
        self._wake, self.closing = threading.Event(), threading.Event()  # closing: the store's close began
        self._stop = threading.Event()
        self._idle = threading.Condition()
        self._batch = threading.Lock()  # one batch at a time: the thread's or upload_now's
        self._pool = UploadPool(concurrency)
        self._thread = threading.Thread(target=self._run, name="ucm-db-uploader", daemon=True)
        self.retractions = RemoteRetractions(local, remote, self._pool)
        self.planner = BatchPlanner(local)
        self._waiting: set[bytes] = set()  # rows found below a held block: passed over until the queue has no other
        self.ancestry = AncestorRepair(local, remote, upload=self.sender.send, run=self._run_uploads,
                                       concurrency=concurrency)
        self.uploaded = 0
        self.failures = 0
        self.last_error: str | None = None

    def start(self) -> None:
        self._thread.start()

    def notify(self) -> None:
        """Wakes the thread (called after a put queued blocks)."""
        self._wake.set()

    def stop(self) -> None:
        """Stops without waiting for the remote; queued rows stay for next
        time. The election is let go once the calls left running on the
        pool have ended (module invariants)."""
        self._stop.set()
        self.closing.set()
        self._wake.set()
        if self._thread.ident is not None:  # started
            self._thread.join()
        running = self._pool.shutdown_then(self._release_lock)
        if running:
            self._log_abandoned(running)

    def _log_abandoned(self, running: int) -> None:
        sending = self.sender.sending
        _log.warning("ucm-db: closing: abandoned %d remote call(s) to %s still running (%d of them block uploads); their "
                     "blocks stay queued for the store's next uploader, and the process can exit meanwhile%s", running,
                     self.remote.root, sending, "; it stays the store directory's uploader until they end or it exits "
                     "(a retraction is confirmed only after them)" if self.election.held else "")

    # -- the loop ----------------------------------------------------------------
    def _run(self) -> None:
        place_current_thread()
        backoff_s = MIN_BACKOFF_S
        while not self._stop.is_set():
            if not self._take_lock():
                self._sleep(IDLE_POLL_S)
                continue
            try:
                moved, failed = self.drain_batch()
                moved += self.drain_retractions()[0]  # failures back off on their own: uploads go on
            except Exception as exc:  # noqa: BLE001 - keep draining; the error is reported by flush()
                moved, failed = 0, 1
                self.last_error = f"{type(exc).__name__}: {exc}"
            if failed:
                self.failures += failed
                self._sleep(backoff_s)
                backoff_s = min(backoff_s * 2, MAX_BACKOFF_S)
            elif moved:
                backoff_s = MIN_BACKOFF_S
            else:
                with self._idle:
                    self._idle.notify_all()
                self._sleep(IDLE_POLL_S)

    def _sleep(self, seconds: float) -> None:
        self._wake.wait(seconds)
        self._wake.clear()

    def drain_batch(self) -> tuple[int, int]:
        """Uploads one batch of queued blocks; returns ``(done, failed)``:
        done are uploaded, or left out under a retracted ancestor."""
        with self._batch:
            return self._drain_batch()

    def drain_retractions(self) -> tuple[int, int]:
        """The elected uploader's pass over retractions (remote/retraction.py): ``(deleted, failed)``."""
        if self.retractions.backing_off():
            return 0, 0
        with self._batch:
            deleted, failed = self.retractions.run(confirm=True, stop=self._stop)
        if failed:
            self.failures, self.last_error = self.failures + failed, self.retractions.last_error
        return deleted, failed

    def retract_now(self, deadline_s: float) -> int:
        """After a delete recorded retractions: deletes their remote objects
        within ``deadline_s``, confirmed only if this process is elected (else
        its pass deletes them again); returns those left undeleted."""
        if not self._batch.acquire(timeout=deadline_s):  # a batch of this process's runs: the elected pass follows it
            return len(self.local.uploads.retractions_due())
        try:
            deadline = time.monotonic() + deadline_s
            return self.retractions.run(confirm=self.election.held, stop=self._stop, deadline=deadline)[1]
        finally:
            self._batch.release()

    def _drain_batch(self) -> tuple[int, int]:
        keys = self.local.pending_uploads(limit=BATCH_KEYS, skip=self._waiting)
        if not keys:
            self._waiting.clear()  # only rows waiting for a settle are left: tried again after the idle wait
            return 0, 0
        keys, gone, stored_ns = self.planner.plan(keys, max_keys=BATCH_KEYS, max_bytes=BATCH_BYTES)
        items = read_items(self.local, keys)
        gone += [k for k, item in zip(keys, items) if item is None]
        work = sorted((item for item in items if item is not None), key=lambda it: it[3])
        namespaces = {item[2] for item in work}
        manifest = self._run_uploads([lambda: self._ensure_manifests(namespaces)])
        if manifest is None:
            return 0, 0
        if manifest[0] is not None:
            self.last_error = manifest[0]
            return 0, 1
        syncs = DirSyncs()  # the batch's directory fsyncs, run once each before its rows go (module invariants)
        repair = self.ancestry.before_batch(work, syncs=syncs)  # the parents of its roots first
        if repair is None:
            return 0, 0
        left_out = repair.held_back | repair.dropped
        self._waiting |= repair.waiting
        work = [item for item in work if item[0] not in left_out]
        results = self._run_uploads([partial(self.sender.send, item, self.remote.tier(item[2], syncs=syncs))
                                     for item in work])
        synced = None if results is None else self._run_uploads(syncs.calls(self.concurrency))
        if results is None or synced is None:
            return 0, 0  # stopping: unfinished rows stay queued
        sync_error = next((error for error in synced if error is not None), None)
        if sync_error is not None:  # not durable: what hangs under the ancestors sent is checked again
            self.ancestry.forget(repair.sent)
        done = [item[0] for item, error in zip(work, results) if error is None and sync_error is None]
        errors = repair.errors + [error for error in [*results, sync_error] if error is not None]
        self.ancestry.remember(done)
        if errors:
            self.last_error = errors[0]
        # Counted before their rows leave the queue: whoever sees the queue
        # empty (wait_drained, so flush) sees them counted. The objects are
        # on the remote already; a failed queue delete re-uploads them later
        # (and counts them again: ``uploaded`` counts uploads, not blocks).
        self.uploaded += len(done)
        # Rows of blocks that vanished (raced with eviction) are dropped too,
        # each only if it is still the row of the block planned here: one
        # removed and put again since has a new row, left for a later batch.
        crashpoint("remote.before_mark_uploaded")
        self.local.mark_uploaded({key: stored_ns.get(key) for key in done + gone + list(repair.dropped)})
        self.sender.record_choice()
        return len(done) + len(repair.dropped), len(errors)

    def _run_uploads(self, calls: list[Callable[[], str | None]]) -> list[str | None] | None:
        """Runs remote calls on the pool; returns their errors (None for a
        success), or None if asked to stop first (:meth:`UploadPool.run`)."""
        return self._pool.run(calls, self._stop)

    def _ensure_manifests(self, namespace_ids: set[bytes]) -> None:
        if all(namespace_id in self.remote.manifests_written for namespace_id in namespace_ids):
            return
        descriptions = self.local.namespace_descriptions()
        for namespace_id in namespace_ids:
            self.remote.ensure_manifest(namespace_id, descriptions.get(namespace_id, {}))

    # -- election ----------------------------------------------------------------
    def _take_lock(self) -> bool:
        return self.election.take()

    def _release_lock(self) -> None:
        self.election.release()

    # -- waiting -----------------------------------------------------------------
    def wait_drained(self, timeout_s: float | None) -> None:
        """Blocks until the queue is empty (whichever process drains it).

        Raises:
            UploaderElsewhereError: still not empty after ``timeout_s``, and
                another process (or store) is the uploader: names it.
            TierError: still not empty after ``timeout_s`` (this process
                uploads: the remote failed or is slow); rows stay queued.
            ClosedError: ``closing`` is set (the store's close, which waits for this flush, began)."""
        end = None if timeout_s is None else time.monotonic() + timeout_s
        while self.local.pending_uploads(limit=1) or self.retractions.pending():
            if self.closing.is_set():  # the store's close began: it would wait for this flush
                raise ClosedError(f"the store closed while flush waited for its uploads to {self.remote.root}")
            if end is not None and time.monotonic() >= end:
                raise self._drain_timeout(timeout_s)
            self._wake.set()
            with self._idle:
                self._idle.wait(0.05)

    def _drain_timeout(self, timeout_s: float | None) -> TierError:
        left, retracted = len(self.local.pending_uploads()), len(self.local.uploads.retractions_due())
        return self.election.flush_timeout(f"{left} block(s) still waiting for upload to {self.remote.root} (and "
                                           f"{retracted} deleted block(s) for the delete of their remote objects) after "
                                           f"{timeout_s} s", self.last_error)

    def upload_now(self, items: list[tuple[bytes, bytes | None, bytes, bytes]]) -> list[str]:
        """Uploads ``(key, parent, namespace id, blob)`` items at once
        (write-through) and dequeues those that succeeded; returns errors.
        Items no longer queued for the block the blob is (the thread's batch
        took them; deleted, and maybe put again since) are skipped."""
        with self._batch:
            current = self.local.uploads.queued_as({item[0]: item[3] for item in items})
            return self._upload_now([item for item in items if item[0] in current], current)

    def _upload_now(self, items: list[tuple[bytes, bytes | None, bytes, bytes]], current: dict[bytes, QueuedAs],
                    ) -> list[str]:
        if not items:
            return []
        closing = ["the store is closing: the blocks stay queued"] * len(items)
        run = partial(self._pool.run, stop=self.closing)  # a put's remote calls never hold up close
        manifest = run([lambda: self._ensure_manifests({item[2] for item in items})])
        if manifest is None or manifest[0] is not None:
            return closing if manifest is None else [str(manifest[0])] * len(items)
        work: list[Item] = [(key, parent, ns, 0, blob) for key, parent, ns, blob in items]
        syncs = DirSyncs()
        repair = self.ancestry.before_batch(work, run=run, syncs=syncs)  # the parents of its roots first
        if repair is None:
            return closing
        left_out = repair.held_back | repair.dropped
        work = [item for item in work if item[0] not in left_out]
        ran = run([partial(self.sender.send, item, self.remote.tier(item[2], syncs=syncs)) for item in work])
        if ran is None:
            return closing
        results = list(ran)
        done = [item[0] for item, error in zip(work, results) if error is None]
        # Landed outside the elected uploader's batches: a delete recorded
        # since the blocks were read is owed again (module invariants).
        seen = {key: queued.retracted_ns for key, queued in current.items()}
        self.local.uploads.reopen_retracted(done + list(repair.sent), seen)
        errors = repair.errors + [error for error in results if error is not None]
        synced = run(syncs.calls(self.concurrency))  # durable before the rows go (module invariants)
        sync_errors = [error for error in synced or [] if error is not None]
        if synced is None or sync_errors:
            self.ancestry.forget(repair.sent)
            return closing if synced is None else [*errors, *sync_errors]
        self.ancestry.remember(done)
        self.uploaded += len(done)  # before the rows leave the queue (see drain_batch)
        self.local.mark_uploaded({key: current[key].created_ns for key in done + list(repair.dropped)})
        return errors

    def forget_lock_after_fork(self) -> None:
        """In a forked child: drop the inherited lock descriptor (closing
        this copy leaves the parent's lock alone)."""
        self.election.forget_after_fork()


def describe(uploader: Uploader | None) -> dict[str, Any]:
    """Counters for stats and the CLI."""
    if uploader is None:
        return {}
    ancestry = uploader.ancestry
    out: dict[str, Any] = {"uploaded": uploader.uploaded, "failures": uploader.failures, "last_error": uploader.last_error,
                           "retracted": uploader.retractions.deleted, "ancestor_checks": ancestry.checks,
                           "ancestors_reuploaded": ancestry.reuploaded, "ancestors_missing": ancestry.missing,
                           "ancestors_retracted": ancestry.retracted, "dropped_under_retracted": ancestry.dropped,
                           "ancestors_taken": ancestry.taken}
    if uploader.codec is not None:
        out["codec"] = asdict(uploader.codec.choice())
    return out
