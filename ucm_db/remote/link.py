"""The link to the remote tier: pool, breaker, deadlines, fetches and streams.

:class:`RemoteLink` is what the remote wing (:mod:`ucm_db.remote.wing`)
holds: the :class:`~ucm_db.remote.tier.RemoteRoot`, a thread pool for
concurrent requests and a circuit breaker. It fetches; it never writes the
local tier (fetched blocks enter it through :mod:`ucm_db.remote.promotion`).

Invariants:
    * A remote call made on behalf of a lookup returns within its deadline:
      requests run on a pool and are waited on with a timeout; requests
      still running at the deadline are abandoned, and stop reading at their
      next chunk (:mod:`ucm_db.remote.object_reads`).
    * Memory: the objects one lookup fetches take at most
      :attr:`RemoteLink.lookup_max_bytes` (``remote_lookup_max_bytes``)
      from its :class:`~ucm_db.remote.object_reads.ByteBudget`, in chain
      order; an object that does not fit is left as if the deadline had cut
      it. A stream (:meth:`RemoteLink.fetch_in_order`) holds at most as much
      fetched and not yet consumed.
      The exception is a remote directory on a local disk while its reads
      stay fast (:mod:`ucm_db.remote.inline_reads`): requests then run in
      order on the caller's thread, none started past the deadline.
    * When the remote fails (an error other than "not found", or a deadline
      passing with no request answered; not for a fetch after a search
      that left it less time than one of the search's rounds took) the
      breaker opens for a backoff that
      doubles up to :data:`~ucm_db.remote.search.MAX_BACKOFF_S`; while open, reads skip the remote
      at once and the store serves what is local.
    * Remote presence along a chain is treated as monotone for the search
      (uploads go ancestors first); where it is not, the search can only
      over-estimate, and the fetch stops at the first block it cannot get.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Generator, Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from typing import Any

from ucm_db.auth import AuthKeys
from ucm_db.cpu_placement import place_current_thread
from ucm_db.remote.daemon_pool import DaemonPool
from ucm_db.remote.inline_reads import InlineReads, is_local_disk
from ucm_db.remote.search import Breaker, SearchResult, search_prefix
from ucm_db.remote.tier import RemoteObject, RemoteRoot, RemoteTier
from ucm_db.remote.object_reads import ByteBudget, ReadAbandoned, ReadLimits
from ucm_db.remote.sealing import SealingKeys

#: Threads for remote reads (probes and fetches) unless the store's
#: ``remote_read_concurrency`` says otherwise.
READ_THREADS = 16
#: Bytes of fetched objects promoted per local commit while later ones are
#: still being fetched (read-through of ``get``, warming, continuations).
PROMOTE_BATCH_BYTES = 16 << 20
_log = logging.getLogger("ucm_db")
#: Marks a call that did not finish before its deadline.
UNFINISHED: Any = object()
#: Deadline of bulk fetches (get of local misses, warming), which move data.
FETCH_DEADLINE_S = 30.0
#: Bytes of fetched objects one lookup holds at most, unless the store's
#: ``remote_lookup_max_bytes`` says otherwise.
LOOKUP_MAX_BYTES = 512 << 20


class RemoteLink:
    """The store's connection to its remote tier (see module invariants)."""

    def __init__(
        self, url: str, options: dict[str, Any], read_threads: int | None = None, *, max_object_bytes: int | None = None,
        lookup_max_bytes: int | None = None,
        auth: AuthKeys | None = None, sealing: SealingKeys | None = None,
    ) -> None:
        self.url = url
        self.root = RemoteRoot.from_url(url, options)
        self.root.auth = auth
        self.root.sealing = sealing
        if max_object_bytes is not None:
            self.root.max_object_bytes = max_object_bytes
        self.breaker = Breaker()
        self.read_threads = read_threads or READ_THREADS
        #: Bytes of fetched objects one lookup (or one stream) holds at most:
        #: never below the largest object read, which must fit one lookup.
        self.lookup_max_bytes = lookup_max_bytes or max(LOOKUP_MAX_BYTES, self.root.max_object_bytes)
        self._pool = DaemonPool(self.read_threads, "ucm-db-remote", place_current_thread)
        self._tiers: dict[bytes, RemoteTier] = {}
        self.last_search: SearchResult | None = None
        self.inline = InlineReads(self.root.is_local and is_local_disk(self.root.root))

    def tier(self, namespace_id: bytes) -> RemoteTier:
        tier = self._tiers.get(namespace_id)
        if tier is None:
            tier = self._tiers[namespace_id] = self.root.tier(namespace_id)
        return tier

    def after_fork(self) -> None:
        """In a forked child: the parent's pool threads do not exist here."""
        self._pool = DaemonPool(self.read_threads, "ucm-db-remote", place_current_thread)
        self.breaker = Breaker()
        self.root.after_fork()

    def close(self) -> None:
        """Never waits on a hung remote: abandons the requests running (on
        daemon threads: the process's exit does not wait for them either)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._pool.busy:
            _log.info("ucm-db: closing: abandoned %d read(s) from remote %s still running", self._pool.busy, self.url)

    def submit(self, call: Callable[[], Any]) -> Future[Any]:
        """Runs ``call`` on the pool, timed like any request; the caller
        decides how long to wait and what an error means to the breaker."""
        return self._pool.submit(self.inline.timed(call))

    # -- concurrency with a deadline ----------------------------------------------
    def run_all(self, calls: list[Callable[[], Any]], deadline: float, *, silence_trips: bool = True) -> list[Any] | None:
        """Runs calls on the pool until all are done or ``deadline``
        (monotonic); calls not finished by then are cancelled or abandoned.
        No call answering by the deadline opens the breaker unless
        ``silence_trips`` is False (the caller just had the remote answer).

        Returns:
            Each call's result, :data:`UNFINISHED` where it did not finish
            in time; None if the breaker is open or a call failed with an
            error other than "not found" (the breaker trips).
        """
        if not self.breaker.allow():
            return None
        if self.inline.use():
            return self._run_inline(calls, deadline, silence_trips)
        futures = [self._pool.submit(self.inline.timed(call)) for call in calls]
        done, pending = wait(futures, timeout=max(0.0, deadline - time.monotonic()), return_when=FIRST_EXCEPTION)
        for future in pending:
            future.cancel()  # queued ones never run; running ones finish unread
        if any(f.exception() is not None for f in done):
            self.breaker.failure()
            return None
        results = [f.result() if f in done else UNFINISHED for f in futures]
        if calls and silence_trips and all(r is UNFINISHED for r in results):
            self.breaker.failure()  # nothing answered in time: looks down
        elif not any(r is UNFINISHED for r in results):
            self.breaker.success()
        return results

    def _run_inline(self, calls: list[Callable[[], Any]], deadline: float, silence_trips: bool) -> list[Any] | None:
        """:meth:`run_all` on the caller's thread, in order: a call is not
        started past ``deadline`` (it is :data:`UNFINISHED`)."""
        results: list[Any] = []
        for call in calls:
            if time.monotonic() >= deadline:
                results.append(UNFINISHED)
                continue
            try:
                results.append(self.inline.run(call))
            except Exception:  # noqa: BLE001 - as a pooled call's error: the breaker trips
                self.breaker.failure()
                return None
        if calls and silence_trips and all(r is UNFINISHED for r in results):
            self.breaker.failure()  # nothing answered in time: looks down
        elif not any(r is UNFINISHED for r in results):
            self.breaker.success()
        return results

    # -- lookups -------------------------------------------------------------------
    def search(self, namespace_id: bytes, keys: Sequence[bytes], deadline: float) -> SearchResult:
        """Counts leading ``keys`` present on the remote (parallel k-ary search)."""
        tier = self.tier(namespace_id)

        def probe_many(indices: list[int]) -> list[bool] | None:
            results = self.run_all([_bind(tier.probe, keys[i]) for i in indices], deadline)
            if results is None or any(r is UNFINISHED for r in results):
                return None
            return [_probe_ok(r, keys, i) for r, i in zip(results, indices)]

        result = search_prefix(probe_many, len(keys))
        self.last_search = result
        return result

    def fetch_chain(
        self, namespace_id: bytes, keys: Sequence[bytes], parent: bytes | None, deadline: float, *,
        silence_trips: bool = True,
    ) -> list[RemoteObject]:
        """Fetches ``keys`` (a chain whose first block's parent is
        ``parent``) and returns the leading run that arrived verified and
        chained before the deadline. ``silence_trips``: as for
        :meth:`run_all` (False after a search that left the fetch less time
        than one of its rounds took; an error still opens the breaker)."""
        run = self.fetch_run(namespace_id, keys, parent, deadline, silence_trips=silence_trips)
        return [] if run is None else run[0]

    def fetch_run(
        self, namespace_id: bytes, keys: Sequence[bytes], parent: bytes | None, deadline: float, *,
        silence_trips: bool = True,
    ) -> tuple[list[RemoteObject], bool] | None:
        """:meth:`fetch_chain`, and whether every request answered (False:
        the deadline cut the fetch, so a short run says nothing of what the
        remote holds past it); None when the remote did not answer at all
        (breaker open, an error, no request done in time)."""
        results = self._fetch_all(namespace_id, keys, deadline, silence_trips=silence_trips)
        if results is None or (keys and all(r is UNFINISHED for r in results)):
            return None
        return _leading_run(results, parent)

    def _fetch_all(
        self, namespace_id: bytes, keys: Sequence[bytes], deadline: float, *, silence_trips: bool = True,
    ) -> list[Any] | None:
        """:meth:`run_all` of one fetch per key within ``deadline`` and one
        :class:`ByteBudget` of :attr:`lookup_max_bytes` (a fetch stopped by
        either is :data:`UNFINISHED`); reads still running when it returns
        stop at their next chunk."""
        tier = self.tier(namespace_id)
        budget = ByteBudget(self.lookup_max_bytes)
        try:
            calls = [_limited_fetch(tier, key, ReadLimits(deadline, budget, i)) for i, key in enumerate(keys)]
            return self.run_all(calls, deadline, silence_trips=silence_trips)
        finally:
            budget.close()

    def stream_chain(
        self, namespace_id: bytes, keys: Sequence[bytes], parent: bytes | None, *,
        chunk_blocks: int = 64, chunk_bytes: int = PROMOTE_BATCH_BYTES, timeout_s: float = FETCH_DEADLINE_S,
    ) -> Iterator[list[RemoteObject]]:
        """Fetches a chain (:meth:`fetch_in_order`, a window of at least two
        chunks) and yields verified, chained runs of up to ``chunk_blocks``
        blocks or ``chunk_bytes`` (whichever comes first) in order, so the
        caller promotes one run while the next is being fetched. Stops at
        the first block missing, corrupt, off-chain, failed, or slower than
        ``timeout_s``."""
        fetched = self.fetch_in_order(
            namespace_id, keys, math.inf, window=max(2 * self.read_threads, 2 * chunk_blocks), result_timeout_s=timeout_s,
        )
        expected = parent
        run: list[RemoteObject] = []
        run_bytes = 0
        try:
            for obj in fetched:
                if obj is None or obj.parent != expected:
                    break
                run.append(obj)
                run_bytes += len(obj.blob)
                expected = obj.key
                if len(run) >= chunk_blocks or run_bytes >= chunk_bytes:
                    yield run
                    run, run_bytes = [], 0
            if run:
                yield run
        finally:
            fetched.close()  # cancels what is still queued

    def fetch_in_order(
        self, namespace_id: bytes, keys: Sequence[bytes], deadline: float, *,
        window: int | None = None, result_timeout_s: float | None = None,
    ) -> Generator[RemoteObject | None, None, None]:
        """Fetches keys with up to ``window`` (default: twice the read
        threads) requests in flight and yields
        one result per key, in order (None: absent, corrupt, or not fetched
        in time), so the caller can promote the first ones while later ones
        are still on the wire. In time: by ``deadline`` (monotonic), and
        within ``result_timeout_s`` of waiting for each one if given.

        The breaker opens (and every later key yields None) on an error
        other than "not found", on a result slower than
        ``result_timeout_s``, or when the deadline passes before any
        request answered; it closes when every key answered.

        Memory: objects fetched and not yet consumed (the caller asking for
        the next one gives the previous one back) hold at most
        :attr:`lookup_max_bytes`; a fetch waits for room in order (see
        :class:`~ucm_db.remote.object_reads.ByteBudget`)."""
        if not self.breaker.allow():
            yield from itertools.repeat(None, len(keys))
            return
        tier = self.tier(namespace_id)
        budget = ByteBudget(self.lookup_max_bytes, wait_for_room=True)
        calls = (_limited_fetch(tier, key, ReadLimits(deadline, budget, i)) for i, key in enumerate(keys))
        try:
            if self.inline.use():
                yield from self._fetch_inline(calls, len(keys), deadline, result_timeout_s, budget)
                return
            yield from self._fetch_pooled(calls, len(keys), deadline, window or 2 * self.read_threads, result_timeout_s, budget)
        finally:
            budget.close()  # reads still running stop at their next chunk

    def _fetch_pooled(
        self, calls: Iterator[Callable[[], Any]], n: int, deadline: float, window: int, result_timeout_s: float | None,
        budget: ByteBudget,
    ) -> Generator[RemoteObject | None, None, None]:
        """:meth:`fetch_in_order` on the pool."""
        pending: deque[Future[Any]] = deque()
        next_at = answered = 0
        try:
            while answered < n:
                while next_at < n and len(pending) < window:
                    pending.append(self._pool.submit(self.inline.timed(next(calls))))
                    next_at += 1
                wait_s = max(0.0, deadline - time.monotonic())
                stalled = result_timeout_s is not None and result_timeout_s <= wait_s
                try:
                    obj = pending.popleft().result(timeout=result_timeout_s if stalled else wait_s)
                    if obj is UNFINISHED:  # the deadline or the budget stopped it
                        raise TimeoutError
                except Exception as exc:  # noqa: BLE001 - a timeout or a remote error ends the fetch
                    if answered == 0 or stalled or not isinstance(exc, TimeoutError):
                        self.breaker.failure()
                    yield from itertools.repeat(None, n - answered)
                    return
                yield obj
                budget.give_back(answered)
                answered += 1
            self.breaker.success()
        finally:
            for future in pending:
                future.cancel()  # queued ones never run; running ones finish unread

    def _fetch_inline(
        self, calls: Iterator[Callable[[], Any]], n: int, deadline: float, result_timeout_s: float | None,
        budget: ByteBudget,
    ) -> Generator[RemoteObject | None, None, None]:
        """:meth:`fetch_in_order` on the caller's thread (a fast local disk):
        no fetch starts past ``deadline``; an error opens the breaker and
        ends it, as does a fetch slower than ``result_timeout_s`` (after
        yielding what it fetched)."""
        for answered, call in enumerate(calls):
            if time.monotonic() >= deadline:
                if answered == 0:
                    self.breaker.failure()
                yield from itertools.repeat(None, n - answered)
                return
            started = time.perf_counter()
            try:
                obj = self.inline.run(call)
            except Exception:  # noqa: BLE001 - a remote error ends the fetch
                self.breaker.failure()
                yield from itertools.repeat(None, n - answered)
                return
            if obj is UNFINISHED:  # the deadline or the budget stopped it mid-read
                if answered == 0:
                    self.breaker.failure()
                yield from itertools.repeat(None, n - answered)
                return
            elapsed_s = time.perf_counter() - started
            yield obj
            budget.give_back(answered)
            if result_timeout_s is not None and elapsed_s > result_timeout_s:
                self.breaker.failure()  # as a pooled result this slow: the rest is not asked for
                yield from itertools.repeat(None, n - answered - 1)
                return
        self.breaker.success()

    def fetch_many(self, namespace_id: bytes, keys: Sequence[bytes], deadline: float) -> list[RemoteObject | None]:
        """Fetches unrelated keys; None for each one not available in time."""
        results = self._fetch_all(namespace_id, keys, deadline)
        if results is None:
            return [None] * len(keys)
        return [None if r is UNFINISHED else r for r in results]

def _leading_run(results: Sequence[Any], parent: bytes | None) -> tuple[list[RemoteObject], bool]:
    """The leading verified run of fetch results chained from ``parent``,
    and whether every request answered (False: a result is
    :data:`UNFINISHED`, so a short run says nothing of what lies past it)."""
    out: list[RemoteObject] = []
    expected = parent
    for obj in results:
        if obj is UNFINISHED:
            return out, False
        if obj is None or obj.parent != expected:
            break
        out.append(obj)
        expected = obj.key
    return out, True


def _bind(fn: Callable[[bytes], Any], key: bytes) -> Callable[[], Any]:
    return lambda: fn(key)


def _limited_fetch(tier: RemoteTier, key: bytes, limits: ReadLimits) -> Callable[[], Any]:
    """A fetch of ``key`` within ``limits``: :data:`UNFINISHED` when they stop it."""

    def call() -> Any:
        try:
            return tier.fetch(key, limits)
        except ReadAbandoned:
            return UNFINISHED

    return call


def _probe_ok(obj: RemoteObject | None, keys: Sequence[bytes], index: int) -> bool:
    """A probe counts as present only if the object chains to its
    predecessor in the caller's key list."""
    if obj is None:
        return False
    return index == 0 or obj.parent == keys[index - 1]
