"""The tiered block store: the public object behind :func:`ucm_db.open`.

A :class:`Store` turns ``(namespace, keys, payloads)`` into encoded blocks in a
:class:`~ucm_db.index.local.LocalTier`, and back.

Invariants:
    * A block is visible only after the transaction that put it commits.
    * Every payload read is verified (header, owning key, checksum) before
      it is reported read (``get_into`` verifies a raw body as it copies it:
      a failed block's flag is False, its buffers may hold its bytes); a
      corrupt block reads as a miss and is quarantined with its descendants.
    * Reader activity (LRU touches, hit and miss counts) is kept in memory
      and written by the maintenance thread, or folded into a put that
      evicts (:mod:`ucm_db.store.background`): reads never open a write
      transaction, and an eviction always sees them.
    * The store is safe for threads, and for several processes on one node
      with the LMDB engine; it re-opens itself in a forked child.
    * With a ``remote``: every block put is queued for upload in its own
      commit (write-back drains the queue in the background; write-through
      uploads before ``put`` returns); local misses in lookup/get read
      through to the remote and promote into the local tier (the remote
      wing, :mod:`ucm_db.remote`); a lookup waits at most
      ``remote_deadline_s`` on the remote.
    * Every namespace's epoch is known or the namespace is not served
      (lookups miss, puts are refused, never epoch 0 by default); it is the
      higher of the store's and the remote's (:mod:`ucm_db.store.epoch_gate`).
    * A pinned block and its ancestors are never evicted
      (:mod:`ucm_db.store.pinning`); ``lookup_many`` answers many chains from
      one snapshot of the local tier (:mod:`ucm_db.store.presence`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ucm_db.format import (  # noqa: F401 - re-exported: ucm_db.store.STORE_FORMAT_VERSION and friends
    CREATED_KEY, FORMAT_VERSION_KEY, SETTINGS_KEY, STORE_FORMAT_VERSION,
)
from ucm_db.arguments import require_namespace
from ucm_db.keys import Namespace
from ucm_db.stats import NamespaceStats, StoreStats
from ucm_db.store.epoch_gate import EpochGate
from ucm_db.store.feed import StoreFeed
from ucm_db.store.opening import open_store
from ucm_db.store.pinning import StorePins
from ucm_db.store.presence import StorePresence
from ucm_db.store.reads import StoreReads
from ucm_db.store.writes import StoreWrites

if TYPE_CHECKING:
    from ucm_db.remote.warming import WarmProgress, WarmReport

#: Default seconds flush() waits for the upload queue to drain.
FLUSH_UPLOAD_TIMEOUT_S = 60.0


def open(path: str | os.PathLike[str], **options: Any) -> Store:  # noqa: A001 - public API name
    """Opens (creating if needed) the store at ``path``.

    Args:
        path: store directory on a local disk.
        **options: :class:`~ucm_db.config.StoreConfig` fields by name. On an
            existing store, omitted persisted settings (capacity, codec,
            durability, engine) come from the store; a conflicting one is a
            :class:`~ucm_db.errors.ConfigError`. ``read_only=True`` opens an
            existing store (on a read-only volume too) without writing
            anything; puts and deletes then raise
            :class:`~ucm_db.errors.TierError`.
    """
    return Store(path, **options)


class Store(StoreWrites, StoreReads, StoreFeed, StorePins, StorePresence):
    """A KV block store (see module invariants). Use :func:`ucm_db.open`.

    Its operations live in one module per job: writes
    (:mod:`ucm_db.store.writes`), reads (:mod:`ucm_db.store.reads`), the
    change feed and epochs (:mod:`ucm_db.store.feed`), pins
    (:mod:`ucm_db.store.pinning`), presence queries
    (:mod:`ucm_db.store.presence`); opening in
    :mod:`ucm_db.store.opening`, the guards in :mod:`ucm_db.store.base`.
    This class holds what ties them: ``__init__``, flush, warm, close and
    stats."""

    def __init__(self, path: str | os.PathLike[str], **options: Any) -> None:
        opened = open_store(path, options)
        self.path = opened.path
        self.config = opened.config
        self._engine = opened.engine
        self._tier = opened.tier
        self._dir_lock = opened.dir_lock
        self._closed = False
        self._lock = threading.Lock()
        self._pid = -1
        self._pool = None
        self._background = None
        self._wing = None
        if self.config.remote is not None:
            from ucm_db.remote.wing import RemoteWing  # loaded only by a store with a remote

            self._wing = RemoteWing(self.config, opened.auth_keys, self._tier, self.path, opened.sealing_keys)
        self._epochs = EpochGate(self._engine, self.path, read_only=self.config.read_only, remote=self._wing)
        self._ensure_process()

    # -- durability --------------------------------------------------------------------
    def flush(self, *, upload_timeout_s: float | None = FLUSH_UPLOAD_TIMEOUT_S) -> None:
        """Writes pending activity, makes every commit durable and, with a
        remote, waits until the upload queue is empty.

        Args:
            upload_timeout_s: longest wait for the upload queue (None: no
                limit).

        Raises:
            TierError: uploads still pending after ``upload_timeout_s``
                (they stay queued and resume).
        """
        self._check_open()
        self._activity.flush_activity()
        self._engine.sync()
        if self._wing is not None:
            self._wing.wait_drained(upload_timeout_s)

    def warm(
        self,
        namespace: Namespace,
        *,
        token_sequences: Sequence[Sequence[int]] | None = None,
        keys: Sequence[bytes] | Sequence[Sequence[bytes]] | None = None,
        progress: WarmProgress | None = None,
    ) -> WarmReport:
        """Pulls what the remote has of these chains into the local tier
        ahead of traffic; see :func:`ucm_db.remote.warming.warm`. Token
        sequences are keyed at the namespace's epoch (:meth:`epoch`: a
        namespace whose epoch is unknown is refused)."""
        from ucm_db.remote.warming import warm

        self._check_open()
        require_namespace(namespace, "warm")
        epoch = self._epochs.epoch(namespace)
        link = None if self._wing is None else self._wing.link
        return warm(self._tier, link, namespace, token_sequences=token_sequences, keys=keys, progress=progress, epoch=epoch)

    def close(self) -> None:
        """Flushes and closes; further calls raise ClosedError.

        The store is released (engine closed, lock let go) even when the
        flush or the final sync fails; that failure is raised afterwards."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._pid == os.getpid():
                self._close_this_process()
        finally:
            try:
                self._engine.close()
            finally:
                self._dir_lock.release()

    def _close_this_process(self) -> None:
        """Stops this process's threads, flushes counters and syncs. Every
        step runs even when an earlier one fails; the first failure is
        raised at the end."""
        steps: list[Callable[[], object]] = [self._activity.stop]
        if self._wing is not None:
            steps += self._wing.close_steps()
        steps += [self._activity.flush_activity, self._engine.sync]
        if self._pool is not None:
            steps.append(self._pool.shutdown)
        first: BaseException | None = None
        for step in steps:
            try:
                step()
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                first = first or exc
        if first is not None:
            raise first

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- introspection -------------------------------------------------------------
    def stats(self) -> StoreStats:
        """Counters of the whole store (all processes), plus this process's
        unflushed hits and misses."""
        self._check_open()
        totals = self._tier.totals()
        hits, misses = self._activity.pending_counts()
        descriptions = self._tier.namespace_descriptions()
        pinned = self._tier.pin_counts()
        namespaces = {
            ns_id.hex(): NamespaceStats(descriptions.get(ns_id, {}), *counts, *pinned.get(ns_id, (0, 0)))
            for ns_id, counts in self._tier.namespace_counts().items()
            if counts[0]
        }
        return StoreStats(
            path=str(self.path), engine=self.config.engine, format_version=STORE_FORMAT_VERSION,
            settings=self.config.to_dict(), capacity_bytes=self.config.capacity_bytes,
            blocks=totals.blocks, raw_bytes=totals.raw_bytes, stored_bytes=totals.stored_bytes,
            file_bytes=self._engine.file_bytes(), hits=totals.hits + hits, misses=totals.misses + misses,
            evictions=totals.evictions, quarantined=totals.quarantined,
            pending_uploads=len(self._tier.pending_uploads()), namespaces=namespaces,
            maintenance_errors=self._activity.errors + (self._activity.failure is not None),
            pinned_bytes=sum(stored for _blocks, stored in pinned.values()), max_pinned_bytes=self.config.pinned_limit_bytes,
            remote=self._remote_stats(),
        )

    def _remote_stats(self) -> dict[str, Any]:
        return {} if self._wing is None else self._wing.stats()
