"""Promotion: the one way fetched remote blocks enter the local tier.

Every block read from the remote and kept locally (a lookup continuing its
local prefix, a ``get`` of local misses, warming, a background
continuation) goes through :func:`promote`; nothing else in ucm_db puts a
fetched block into the local tier.

Invariants:
    * Promotion keeps the local prefix invariant: blocks are put in chain
      order, each with the parent its object names, and the first one only
      if its parent is local (or it is a chain's first block). An object
      whose parent disagrees with the caller's chain is a miss.
    * Promoted blocks are not queued for upload (they came from the remote).
    * A block deleted here whose retraction is recorded (its remote object
      is, or was lately, to be deleted: :mod:`ucm_db.index.retractions`) is
      never promoted, checked inside the promoting transaction: the run
      holding it is not promoted (its wrong KV must not come back).
    * A promotion describes its namespace as a put does: the caller's
      :class:`PromotionTarget` names the :class:`~ucm_db.keys.Namespace`
      the blocks were fetched for, and its first promoted block records the
      namespace's description (:attr:`Namespace.description_json
      <ucm_db.keys.Namespace.description_json>`, which hashes to its id) in
      the same transaction, so ``invalidate``, ``lookup``, ``pin`` and
      ``export`` find it by model (before, a store filled by warming or
      read-through had no description and could not be invalidated by
      name). Objects of any other namespace are never promoted under it.
      Like a put, it first registers the namespace's epoch (the store's
      epoch gate): a described namespace without an epoch record reads as
      lost once the store is sealed (:mod:`ucm_db.store.epochs`).
    * A read never fails on what it cannot promote: a run whose first parent
      is gone, that meets another namespace's block, or that does not fit
      beside the pinned blocks and the local prefix it continues
      (``StoreFullError``) is not promoted (:func:`promote` returns 0); a
      lookup reports the local prefix, a ``get`` serves what it fetched.
    * A lookup whose deadline cut its fetch short, or that fetched more than
      :data:`SYNC_PROMOTE_BYTES`, hands the rest of the found prefix to one
      background thread (:class:`Continuations`, bounded queue), so
      remote-only hits arrive asynchronously and the next lookup finds them
      local. A lookup thus waits at most its deadline on the remote plus one
      local commit of at most that many bytes.
    * The fetch after a search opens the breaker on silence only when it
      was left at least the time one of the search's rounds took: a search
      that used up most of the deadline has just shown the remote answering
      and holding the prefix, and leaves the fetch no time to answer.
    * A continuation queued while the breaker is open (another lookup's
      failure, an error in the fetch) first waits out its backoff (at most
      :data:`~ucm_db.remote.search.MAX_BACKOFF_S`), and is dropped if the
      breaker opened again meanwhile. A remote that is really down then
      fails the continuation's own fetch, which stops it.
    * Finishing in the background is best effort: at most
      :data:`MAX_CONTINUATIONS` are queued (more are dropped), and a lookup
      whose requests got no answer at all leaves nothing to continue.
    * A lookup asks the remote only for what it could promote: nothing when
      the first key's parent is not local; a continuation of at most
      :data:`DIRECT_FETCH_KEYS` keys is fetched outright (one request per
      key, no search), a longer one searched first.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from ucm_db.cpu_placement import place_current_thread
from ucm_db.remote.daemon_pool import DaemonPool
from ucm_db.errors import DamagedRecordError, MissingAncestorError, StoreFullError
from ucm_db.keys import Namespace
from ucm_db.remote import link as link_module
from ucm_db.remote.link import RemoteLink
from ucm_db.remote.search import MAX_BACKOFF_S, SEARCH_FANOUT
from ucm_db.engines.base import Buffer
from ucm_db.index import retractions
from ucm_db.index.local import BlockEntry, LocalTier
from ucm_db.index.namespace_guard import ForeignNamespaceError
from ucm_db.remote.tier import RemoteObject

#: A remote continuation of at most this many keys is fetched at once, with
#: no presence search first: one round of requests instead of two or more
#: (a single round trip where ``remote_read_concurrency`` is at least this;
#: a hit's bytes are wanted anyway; a miss costs one request per key, about
#: what the search's probes would). The connector's first lookup segment fits.
DIRECT_FETCH_KEYS = 2 * SEARCH_FANOUT
#: Background promotions of chain tails queued at once (more are dropped).
MAX_CONTINUATIONS = 8
#: Bytes a lookup commits locally before returning; the rest of what it
#: fetched is promoted in the background (bounds a lookup's local commit).
SYNC_PROMOTE_BYTES = 32 << 20
#: Longest close() waits for a background promotion's commit.
CLOSE_WAIT_S = 5.0


@dataclass(frozen=True, slots=True)
class PromotionTarget:
    """The namespace fetched blocks are promoted into (module invariants).

    Attributes:
        namespace: the namespace the caller fetched for; its id is the
            objects' and its description is recorded with them, so the
            two can never disagree.
        register: registers the namespace's epoch before its blocks enter
            the local tier, as before a put (the store's
            :meth:`EpochGate.before_put <ucm_db.store.epoch_gate.EpochGate.before_put>`:
            one write the first time per process, nothing after); raises
            :class:`~ucm_db.errors.DamagedRecordError` for an unknown epoch.
    """

    namespace: Namespace
    register: Callable[[Namespace], None]

    @property
    def namespace_id(self) -> bytes:
        return self.namespace.id


def promote(local: LocalTier, objects: Sequence[RemoteObject], target: PromotionTarget) -> int:
    """Puts a verified chain run of ``target``'s namespace into the local
    tier, recording the namespace's description with it where it has none;
    returns blocks put.

    Nothing is put (0) when the run cannot enter the local tier: an object
    is of another namespace, the namespace's epoch is unknown, its first
    parent has meanwhile been evicted locally, one of its blocks is
    retracted, a key or parent is stored
    under another namespace, or it does not fit beside the pinned blocks
    and the protected local prefix it continues. The caller sees a shorter
    prefix, never a broken invariant, and a read never fails on it: a
    ``get`` still serves what it fetched, just not kept locally.
    """
    namespace = target.namespace
    namespace_id = namespace.id
    if not objects or any(o.namespace_id != namespace_id for o in objects):
        return 0  # never described as a namespace they are not of
    entries = [BlockEntry.of_blob(o.key, o.parent, o.blob, o.raw_bytes, o.namespace_id) for o in objects]
    try:
        target.register(namespace)
    except DamagedRecordError:  # its epoch is unknown: the namespace is not served, nothing promoted
        return 0
    try:
        local.put_blocks(entries, namespace_desc=(namespace_id, namespace.description_json), enqueue_upload=False,
                         guard=lambda txn: retractions.refuse(txn, [e.key for e in entries]))
    except (MissingAncestorError, ForeignNamespaceError, StoreFullError):  # a read never fails on what it cannot promote
        return 0
    return len(entries)


class Continuations:
    """One background thread promoting chain tails that a lookup could not
    wait for (at most :data:`MAX_CONTINUATIONS` queued)."""

    def __init__(self, link: RemoteLink) -> None:
        self._link = link
        self._start()

    def _start(self) -> None:
        self._background = DaemonPool(1, "ucm-db-promote", place_current_thread)  # exit never waits on a hung fetch
        self._continuing_lock = threading.Lock()
        self._promote_lock = threading.Lock()
        self._continuing = 0
        self._closed = False
        self._closing = threading.Event()  # wakes a continuation waiting out the breaker
        self.promoted_in_background = 0

    def after_fork(self) -> None:
        """In a forked child: the parent's thread does not exist here."""
        self._start()

    def close(self) -> None:
        """Stops taking work and waits (at most :data:`CLOSE_WAIT_S`) for a
        commit in progress; a running continuation stops at its next run."""
        self._closed = True
        self._closing.set()
        self._background.shutdown(wait=False, cancel_futures=True)
        if self._promote_lock.acquire(timeout=CLOSE_WAIT_S):
            self._promote_lock.release()

    def continue_later(
        self, local: LocalTier, target: PromotionTarget, keys: list[bytes], parent: bytes | None,
        fetched: Sequence[RemoteObject] = (),
    ) -> bool:
        """Queues a background promotion of a chain tail whose first
        ``len(fetched)`` objects are already here (at most
        :data:`MAX_CONTINUATIONS` queued; more are dropped, not blocked on)."""
        with self._continuing_lock:
            if self._closed or self._continuing >= MAX_CONTINUATIONS:
                return False
            self._continuing += 1
        self._background.submit(self._continue, local, target, keys, parent, list(fetched))
        return True

    def _continue(
        self, local: LocalTier, target: PromotionTarget, keys: list[bytes], parent: bytes | None, fetched: list[RemoteObject],
    ) -> None:
        try:
            runs = [fetched[i : i + 64] for i in range(0, len(fetched), 64)]
            if fetched:
                parent = fetched[-1].key
            for run in itertools.chain(runs, self._stream_after_backoff(target.namespace_id, keys[len(fetched):], parent)):
                with self._promote_lock:  # close() waits for a promotion in progress
                    if self._closed or promote(local, run, target) < len(run):
                        break
                self.promoted_in_background += len(run)
        except Exception:  # noqa: BLE001 - best effort: a later lookup retries
            pass
        finally:
            with self._continuing_lock:
                self._continuing -= 1

    def _stream_after_backoff(
        self, namespace_id: bytes, keys: list[bytes], parent: bytes | None,
    ) -> Iterator[list[RemoteObject]]:
        """The link's stream of ``keys``, once the breaker lets requests
        through (nothing if the store closes while waiting)."""
        if not keys or self._closing.wait(min(self._link.breaker.open_for_s(), MAX_BACKOFF_S)):
            return
        if not self._link.breaker.allow():
            return  # failed again meanwhile: a later lookup retries
        yield from self._link.stream_chain(namespace_id, keys, parent)


def extend_prefix(
    link: RemoteLink, later: Continuations, local: LocalTier, target: PromotionTarget, keys: Sequence[bytes],
    local_n: int, deadline_s: float,
) -> tuple[int, int]:
    """Promotes remote blocks continuing the local prefix ``keys[:local_n]``
    of ``target``'s namespace.

    Returns:
        ``(blocks now local, bytes fetched)``.
    """
    deadline = time.monotonic() + deadline_s
    namespace_id = target.namespace_id
    rest = keys[local_n:]
    parent = keys[local_n - 1] if local_n else first_parent(keys)
    if local_n == 0 and parent is not None and not local.exists([parent])[0]:
        # Nothing fetched could be promoted: a unit looked up alone past
        # its chain's local prefix (the connector's probe of a block's
        # last unit), or a parent evicted meanwhile. No request at all.
        return 0, 0
    if len(rest) <= DIRECT_FETCH_KEYS:
        run = link.fetch_run(namespace_id, rest, parent, deadline)
        if run is None:
            return local_n, 0  # the remote is down or silent: nothing to continue later
        objects, complete = run
        present = len(objects) if complete else len(rest)  # cut short: the rest may be there
    else:
        search_started = time.monotonic()
        found = link.search(namespace_id, rest, deadline)
        if found.count == 0:
            return local_n, 0
        present = found.count
        # Silence from a fetch left less time than one of the search's rounds
        # took says nothing of the remote; from one left more, it does.
        round_s = (time.monotonic() - search_started) / max(1, found.rounds)
        objects = link.fetch_chain(namespace_id, rest[:present], parent, deadline,
                                   silence_trips=deadline - time.monotonic() >= round_s)
    now, rest_fetched = _split_by_bytes(objects, SYNC_PROMOTE_BYTES)
    promoted = promote(local, now, target)
    if promoted == len(now) and promoted < present:
        # The deadline (or the commit budget) cut the promotion short:
        # finish in the background so the next lookup finds it local.
        tail_parent = now[-1].key if now else parent
        later.continue_later(local, target, list(rest[promoted:present]), tail_parent, rest_fetched)
    return local_n + promoted, sum(len(o.blob) for o in now[:promoted])


class DecodeQueue(Protocol):
    """What :func:`read_through` needs of the codec pool's pending decodes
    (:class:`ucm_db.codec.pool.PendingDecodes`)."""

    def add(self, blob: Buffer, call: Callable[[], None]) -> None: ...


def read_through(
    link: RemoteLink, local: LocalTier, target: PromotionTarget, keys: Sequence[bytes], missing: list[int], deadline: float,
    use: Callable[[int, Buffer], None], decodes: DecodeQueue,
) -> None:
    """Fetches ``keys[i]`` for each ``i`` in ``missing`` (in order),
    promotes what keeps the prefix invariant, and hands each verified blob
    to ``decodes.add(blob, call)``, ``call()`` running ``use(i, blob)``; the
    caller joins ``decodes``.

    Objects arrive in order while later ones are fetched: each batch of
    :data:`~ucm_db.remote.link.PROMOTE_BATCH_BYTES` is promoted then,
    overlapping the commit with the transfer (a batch's first parent is the
    previous batch's last block, promoted already)."""
    batch: list[RemoteObject | None] = []
    batch_bytes = 0

    def promote_batch() -> None:
        for run in promotable_runs(local, batch):
            promote(local, run, target)

    fetched = link.fetch_in_order(target.namespace_id, [keys[i] for i in missing], deadline)
    for obj, i in zip(fetched, missing):  # fetched first: the generator runs to its end (breaker.success)
        batch.append(obj)
        if obj is not None:
            decodes.add(obj.blob, _bind_use(use, i, obj.blob))
            batch_bytes += len(obj.blob)
        if batch_bytes >= link_module.PROMOTE_BATCH_BYTES:
            promote_batch()
            batch, batch_bytes = [], 0
    promote_batch()


def _bind_use(use: Callable[[int, Buffer], None], i: int, blob: Buffer) -> Callable[[], None]:
    return lambda: use(i, blob)


def _split_by_bytes(objects: list[RemoteObject], budget_bytes: int) -> tuple[list[RemoteObject], list[RemoteObject]]:
    """The leading objects within ``budget_bytes`` (at least one), and the rest."""
    total = 0
    for i, obj in enumerate(objects):
        total += len(obj.blob)
        if total > budget_bytes and i > 0:
            return objects[:i], objects[i:]
    return objects, []


def first_parent(keys: Sequence[bytes]) -> bytes | None:
    """The key before ``keys[0]``: a ``BlockKeys`` slice's ``parent``, a
    ``UnitKeys`` slice's ``parent()``, None for a plain list (a chain's
    start). A lookup of a segment that starts mid-chain (the connector looks
    a long prompt up in segments) must check the remote objects against
    that parent, not None, or it finds none of them."""
    parent = getattr(keys, "parent", None)
    found = parent() if callable(parent) else parent
    return bytes(found) if isinstance(found, (bytes, bytearray, memoryview)) else None


def promotable_runs(
    local: LocalTier, objects: Sequence[RemoteObject | None],
) -> list[list[RemoteObject]]:
    """Splits fetched objects (in the caller's order) into runs that can be
    promoted: each run's first parent is local or absent, and each next
    object's parent is the previous object."""
    present = [o for o in objects if o is not None]
    parents_local = local.exists([o.parent for o in present if o.parent is not None]) if present else []
    local_parent = iter(parents_local)
    runs: list[list[RemoteObject]] = []
    previous: RemoteObject | None = None
    for obj in objects:
        if obj is None:
            previous = None
            continue
        ok_local = obj.parent is None or next(local_parent)
        if previous is not None and obj.parent == previous.key:
            runs[-1].append(obj)
        elif ok_local:
            runs.append([obj])
        else:
            previous = None
            continue
        previous = obj
    return runs
