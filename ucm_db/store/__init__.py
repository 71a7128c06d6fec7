"""The tiered block store: the public object behind :func:`ucm_db.open`.

A :class:`Store` turns ``(namespace, keys, payloads)`` into encoded blocks in a
:class:`~ucm_db.index.local.LocalTier`, and back. It holds its operations as
parts, plain objects built on one :class:`~ucm_db.store.state.StoreState`
(handles, guards, this process's threads): writes, reads, the change feed and
epochs, pins, presence queries (one module each); its methods hand each call
to its part.

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
    * Every block enters the local tier through the write part's one path
      (``put``, ``put_segments``, and ``put_encoded`` for blocks already
      encoded, e.g. an archive's), remote promotion aside: the epoch gate,
      one commit, the group-durability count and upload queueing apply to
      all of them (:mod:`ucm_db.store.writes`).
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

import functools
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

from ucm_db.format import (  # noqa: F401 - re-exported: ucm_db.store.STORE_FORMAT_VERSION and friends
    CREATED_KEY, FORMAT_VERSION_KEY, SETTINGS_KEY, STORE_FORMAT_VERSION,
)
from ucm_db.arguments import UNSET, Unset, require_namespace
from ucm_db.codec.slabs import ScatterSlabs
from ucm_db.keys import Namespace
from ucm_db.stats import NamespaceStats, StoreStats
from ucm_db.store.feed import StoreFeed
from ucm_db.store.opening import open_store
from ucm_db.store.pinning import StorePins
from ucm_db.store.presence import StorePresence
from ucm_db.store.provisional import ProvisionalOwner, sweep_opened
from ucm_db.store.reads import StoreReads
from ucm_db.store.state import StoreState
from ucm_db.store.writes import StoreWrites

if TYPE_CHECKING:
    from ucm_db.buffers import Buffer
    from ucm_db.codec.pool import Payload
    from ucm_db.events import BlockEventFields, ChangeBatch, EventInventory
    from ucm_db.index.local import PutResult
    from ucm_db.keys.units import KVGrid, UnitSpan
    from ucm_db.remote.warming import WarmProgress, WarmReport
    from ucm_db.stats import PinReport
    from ucm_db.store.background import Background

#: Default seconds flush() waits for the upload queue to drain.
FLUSH_UPLOAD_TIMEOUT_S = 60.0

_Method = TypeVar("_Method", bound=Callable[..., Any])


def _operation(method: _Method) -> _Method:
    """Runs a :class:`Store` method as one operation of its state: refused
    with ClosedError once close has begun, waited for by close
    (:mod:`ucm_db.store.state`)."""
    @functools.wraps(method)
    def run(self: Store, *args: Any, **kwargs: Any) -> Any:
        state = self._state
        try:  # enter inside: an interrupt right after its count still reaches leave (which tolerates no count)
            state.enter()
            return method(self, *args, **kwargs)
        finally:
            state.leave()
    return cast(_Method, run)


def _doc(implementation: Callable[..., Any]) -> Callable[[_Method], _Method]:
    """Makes a :class:`Store` method an operation (:func:`_operation`) with
    the docstring of the part's method it hands the call to: written once,
    beside the code it describes."""
    def documented(method: _Method) -> _Method:
        method.__doc__ = implementation.__doc__
        return _operation(method)
    return documented


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


class Store:
    """A KV block store (see module invariants). Use :func:`ucm_db.open`.

    It holds its operations as parts, one module per job, each built on the
    store's :class:`~ucm_db.store.state.StoreState` (handles, guards, this
    process's threads; :mod:`ucm_db.store.state`): writes
    (:mod:`ucm_db.store.writes`), reads (:mod:`ucm_db.store.reads`), the
    change feed and epochs (:mod:`ucm_db.store.feed`), pins
    (:mod:`ucm_db.store.pinning`), presence queries
    (:mod:`ucm_db.store.presence`); opening in :mod:`ucm_db.store.opening`.
    Its methods hand each call to its part (the docstrings are the
    parts'); this class itself does flush, warm, close and stats."""

    def __init__(self, path: str | os.PathLike[str], **options: Any) -> None:
        state = StoreState(open_store(path, options))
        self.path = state.path
        self.config = state.config
        self._state = state
        # The handles: for components.local_tier and remote_link, the index repairs of maintenance, the tests.
        self._engine, self._tier, self._wing, self._epochs = state.engine, state.tier, state.wing, state.epochs
        self._writes = StoreWrites(state)
        self._reads = StoreReads(state)
        self._feed = StoreFeed(state)
        self._pins = StorePins(state)
        self._presence = StorePresence(state)
        sweep_opened(state)  # provisional blocks of writers that died (store/provisional.py)

    @property
    def _activity(self) -> Background:
        """This process's background work (made again after a fork)."""
        return self._state.activity

    # -- writes (store/writes.py) ------------------------------------------------------
    @_doc(StoreWrites.put)
    def put(
        self, namespace: Namespace, keys: Sequence[bytes], payloads: Sequence[Payload], *,
        parent: bytes | None | Unset = UNSET, codec_name: str | None = None,
        event_fields: Mapping[bytes, BlockEventFields] | None = None,
    ) -> PutResult:
        return self._writes.put(namespace, keys, payloads, parent=parent, codec_name=codec_name, event_fields=event_fields)

    @_doc(StoreWrites.put_segments)
    def put_segments(
        self, namespace: Namespace, segments: Sequence[tuple[Sequence[bytes], Sequence[Payload]]], *,
        codec_name: str | None = None, event_fields: Mapping[bytes, BlockEventFields] | None = None,
        provisional: Mapping[bytes, bytes] | None = None,
    ) -> PutResult:
        return self._writes.put_segments(namespace, segments, codec_name=codec_name, event_fields=event_fields,
                                         provisional=provisional)

    @_operation
    def provisional_owner(self) -> ProvisionalOwner:
        """A writer that may take back what it puts (:mod:`ucm_db.store.provisional`):
        its :meth:`~ProvisionalOwner.tag` s name blocks of :meth:`put_segments`
        (``provisional``) that, should this process die before it settles
        them, a sweep deletes with their descendants.

        Raises:
            TierError: the store is open read-only, or its directory takes
                no record locks (then go on without provisional puts).
        """
        return ProvisionalOwner(self._state)

    @_doc(StoreWrites.put_encoded)
    def put_encoded(self, namespace: Namespace, blocks: Sequence[tuple[bytes, bytes | None, Buffer]]) -> PutResult:
        return self._writes.put_encoded(namespace, blocks)

    @_doc(StoreWrites.delete)
    def delete(self, namespace: Namespace, keys: Sequence[bytes], *, remote: bool = False) -> int:
        return self._writes.delete(namespace, keys, remote=remote)

    @_doc(StoreWrites.quarantine)
    def quarantine(self, key: bytes, reason: str, *, recheck: bool = True) -> bool:
        return self._writes.quarantine(key, reason, recheck=recheck)

    # -- reads (store/reads.py, store/presence.py) --------------------------------------
    @_doc(StoreReads.lookup)
    def lookup(
        self, namespace: Namespace, keys: Sequence[bytes], *, remote: bool = True, remote_deadline_s: float | None = None,
    ) -> int:
        return self._reads.lookup(namespace, keys, remote=remote, remote_deadline_s=remote_deadline_s)

    @_doc(StoreReads.get)
    def get(self, namespace: Namespace, keys: Sequence[bytes]) -> list[bytearray | None]:
        return self._reads.get(namespace, keys)

    @_doc(StoreReads.get_into)
    def get_into(
        self, namespace: Namespace, keys: Sequence[bytes], buffers: Sequence[Buffer | list[Buffer] | tuple[Buffer, ...]] | ScatterSlabs,
        *, touch: bool = True,
    ) -> list[bool]:
        return self._reads.get_into(namespace, keys, buffers, touch=touch)

    @_doc(StoreReads.touch)
    def touch(self, namespace: Namespace, keys: Sequence[bytes]) -> None:
        self._reads.touch(namespace, keys)

    @_doc(StorePresence.lookup_many)
    def lookup_many(
        self, namespace: Namespace, chains: Sequence[Sequence[bytes]], *,
        grid: KVGrid | None = None, spans: Sequence[UnitSpan] | None = None,
    ) -> list[int]:
        return self._presence.lookup_many(namespace, chains, grid=grid, spans=spans)

    # -- pins (store/pinning.py) --------------------------------------------------------
    @_doc(StorePins.pin)
    def pin(
        self, namespace: Namespace, keys: Sequence[bytes] | Sequence[Sequence[bytes]], *,
        grid: KVGrid | None = None, spans: Sequence[UnitSpan] | None = None,
    ) -> PinReport:
        return self._pins.pin(namespace, keys, grid=grid, spans=spans)

    @_doc(StorePins.unpin)
    def unpin(
        self, namespace: Namespace, keys: Sequence[bytes] | Sequence[Sequence[bytes]], *,
        grid: KVGrid | None = None, spans: Sequence[UnitSpan] | None = None,
    ) -> PinReport:
        return self._pins.unpin(namespace, keys, grid=grid, spans=spans)

    # -- change feed and epochs (store/feed.py) ----------------------------------------
    @_doc(StoreFeed.changes_since)
    def changes_since(self, seq: int, limit: int = 1024, *, namespace: Namespace | None = None, feed_id: str | None = None) -> ChangeBatch:
        return self._feed.changes_since(seq, limit, namespace=namespace, feed_id=feed_id)

    @_doc(StoreFeed.event_inventory)
    def event_inventory(self, *, namespace: Namespace | None = None, namespace_id: bytes | None = None) -> EventInventory:
        return self._feed.event_inventory(namespace=namespace, namespace_id=namespace_id)

    @_doc(StoreFeed.feed_position)
    def feed_position(self) -> int:
        return self._feed.feed_position()

    @_doc(StoreFeed.epoch)
    def epoch(self, namespace: Namespace) -> int:
        return self._feed.epoch(namespace)

    @_doc(StoreFeed.bump_epoch)
    def bump_epoch(self, namespace: Namespace) -> int:
        return self._feed.bump_epoch(namespace)

    # -- durability --------------------------------------------------------------------
    @_operation
    def flush(self, *, upload_timeout_s: float | None = FLUSH_UPLOAD_TIMEOUT_S) -> None:
        """Writes pending activity, makes every commit durable and, with a
        remote, waits until the upload queue is empty, then makes its
        emptying durable too (a power loss then uploads nothing again).

        Args:
            upload_timeout_s: longest wait for the upload queue (None: no
                limit).

        Raises:
            TierError: uploads still pending after ``upload_timeout_s``
                (they stay queued and resume).
        """
        self._state.check_open()
        self._activity.flush_activity()
        self._activity.sync_now()
        if self._wing is not None:
            self._wing.wait_drained(upload_timeout_s)
            self._activity.sync_now()

    @_operation
    def warm(
        self,
        namespace: Namespace,
        *,
        token_sequences: Sequence[Sequence[int]] | None = None,
        keys: Iterable[bytes] | Iterable[Iterable[bytes]] | None = None,
        progress: WarmProgress | None = None,
    ) -> WarmReport:
        """Pulls what the remote has of these chains into the local tier
        ahead of traffic; see :func:`ucm_db.remote.warming.warm`. Token
        sequences are keyed at the namespace's epoch (:meth:`epoch`: a
        namespace whose epoch is unknown is refused).

        Raises:
            RemoteEpochUnknownError: (a TierError) the remote's epoch of the
                namespace is not known within a bulk step's deadline (its
                manifest did not answer, or, with an auth key, its epoch is
                not signed by one): nothing is fetched, as a lookup reads
                nothing through then (:mod:`ucm_db.store.epoch_gate`).
        """
        from ucm_db.remote.warming import RemoteEpochUnknownError, warm

        self._state.check_open()
        require_namespace(namespace, "warm")
        wait_s = None if self._wing is None else self._wing.bulk_deadline_s
        epoch = self._epochs.epoch(namespace, wait_s)
        if self._wing is not None and not self._epochs.remote_ok(namespace, wait_s):
            raise RemoteEpochUnknownError.of(namespace, self.config.remote, self._epochs.remote_problem(namespace))
        link = None if self._wing is None else self._wing.link
        return warm(self._tier, link, namespace, token_sequences=token_sequences, keys=keys, progress=progress, epoch=epoch,
                    register=self._epochs.before_put)

    def close(self) -> None:
        """Flushes and closes; further calls raise ClosedError.

        Calls in flight in other threads end first (those that start after
        close began raise ClosedError); a second close waits for the first.
        From inside a call (a callback) or a store thread it returns at once
        and the store is released once the calls in flight have ended. The
        store is released (engine closed, lock let go) even when the flush
        or the final sync fails; that failure is raised afterwards."""
        self._state.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- introspection -------------------------------------------------------------
    @_operation
    def stats(self) -> StoreStats:
        """Counters of the whole store (all processes), plus this process's
        unflushed hits and misses."""
        self._state.check_open()
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
            remote={} if self._wing is None else self._wing.stats(),
        )
