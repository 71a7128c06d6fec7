"""What the parts of a :class:`~ucm_db.store.Store` share: its handles
(engine, local tier, remote wing, epoch gate), the guards every operation
passes, this process's codec threads and maintenance thread, and the close.

The parts (:mod:`ucm_db.store.writes`, :mod:`ucm_db.store.reads`,
:mod:`ucm_db.store.feed`, :mod:`ucm_db.store.pinning`,
:mod:`ucm_db.store.presence`) each take one :class:`StoreState` and use its
public members only; none holds another part.

Invariants:
    * Every public operation of a part first calls
      :meth:`StoreState.check_open` (or :meth:`StoreState.check_writable`):
      a closed store raises ClosedError, and a forked child gets its own
      codec threads and maintenance thread (the parent's are not in it)
      before it does anything.
    * A read-only store refuses every write with a TierError naming the fix;
      a store whose maintenance thread died refuses puts.
    * The handles never change while the store is open; ``codecs`` and
      ``activity`` are this process's (read them at each use, never keep
      them: a fork makes them again).
    * ``close`` releases the store (engine closed, directory lock let go)
      even when this process's flush or final sync fails; that failure is
      raised afterwards.
    * Every public operation of the store runs between :meth:`StoreState.enter`
      and :meth:`StoreState.leave` (one lock round-trip each, per call, never
      per block). Once ``close`` has begun, ``enter`` raises ClosedError;
      ``close`` waits for the operations in flight to leave before it stops
      a thread, shuts the codec pool or closes the engine, so no read copies
      from an unmapped LMDB map and no call meets a shut pool.
    * ``close`` called again, or from two threads at once, is one close: the
      later calls wait until the store is released. Called from inside an
      operation (a callback on the caller's thread, or a signal handler that
      landed inside ``enter``/``leave`` or the release itself) or from one of
      the store's own threads (the codec, maintenance and remote threads it
      would join, known by their idents, not by name), it would wait for
      itself: it refuses new operations at once and hands the release to a
      thread of its own (``ucm-db-close``), which logs a failure instead of
      raising it; an ``atexit`` hook waits (bounded) for such a release, so a
      process that exits right after still flushes and syncs.
    * ``close`` first ends the waits of ``flush`` for the upload queue
      (ClosedError), then waits at most :data:`CLOSE_WAIT_S` in all for the
      operations in flight, logging the threads still counted every
      :data:`CLOSE_LOG_EVERY_S` (a call an interrupt left counted must not
      keep the store open for good); past it, it releases anyway: the
      engine's close still waits for the transactions running (its gate's
      ``closing``), and a call meets ClosedError after.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from concurrent.futures import Executor
from collections.abc import Callable
from typing import TYPE_CHECKING

from ucm_db.codec.pool import CodecPool
from ucm_db.engines.lmdb import commit_ids_of
from ucm_db.errors import ClosedError, TierError
from ucm_db.store import provisional
from ucm_db.store.background import Background
from ucm_db.store.epoch_gate import EpochGate
from ucm_db.store.opening import OpenedStore

if TYPE_CHECKING:
    from ucm_db.remote.wing import RemoteWing

logger = logging.getLogger("ucm_db")
#: The prefix of the names of the threads a store starts (a close from one is recognised by its ident, not its name).
STORE_THREAD_PREFIX = "ucm-db-"
#: The fields of a store's parts that hold its threads or thread pools (read by :meth:`StoreState._is_own_thread`).
_OWN_THREAD_FIELDS = ("_thread", "_pool", "_background")
#: Longest wait of close for the operations in flight, in all, before it releases anyway (module invariants).
CLOSE_WAIT_S = 180.0
#: How often that wait logs the threads still counted.
CLOSE_LOG_EVERY_S = 30.0
#: Longest wait at interpreter exit for the releases handed off.
EXIT_WAIT_S = 60.0
#: The releases handed off and still running (joined at exit, bounded).
_HANDED_OFF: set[threading.Thread] = set()
#: Every StoreState of this process, for :func:`_after_fork_in_child` (no getpid per operation).
_STATES: weakref.WeakSet[StoreState] = weakref.WeakSet()


class StoreState:
    """One open store's handles, guards and per-process parts (module invariants)."""

    def __init__(self, opened: OpenedStore) -> None:
        self.path = opened.path
        self.config = opened.config
        self.engine = opened.engine
        self.tier = opened.tier
        self._dir_lock = opened.dir_lock
        #: The remote wing (link, promotion, uploader); None without a ``remote``.
        self.wing: RemoteWing | None = None
        if self.config.remote is not None:
            from ucm_db.remote.wing import RemoteWing  # loaded only by a store with a remote

            self.wing = RemoteWing(self.config, opened.auth_keys, self.tier, self.path, opened.sealing_keys)
        #: The namespaces' epochs as this store serves them (lookups, reads, puts).
        self._commit_ids = commit_ids_of(self.engine)
        self.epochs = EpochGate(self.engine, self.path, read_only=self.config.read_only, remote=self.wing,
                                commits=self._commit_ids)
        self.closed = False
        self.lock = threading.Lock()
        self._calls = threading.RLock()  # guards closed and _holders; re-entrant: a signal handler may close inside
        self._releaser: int | None = None  # the thread running the release (a close from it does not wait)
        self._holders: dict[int, int] = {}  # thread ident -> its operations in flight (nested calls each count)
        self._drained = threading.Event()  # closed, and no operation in flight
        self._released = threading.Event()  # close has closed the engine and let the lock go
        _STATES.add(self)  # a forked child forgets the parent's operations (_after_fork_in_child)
        self._pid = -1
        self._pool: CodecPool | None = None
        self._background: Background | None = None
        self.ensure_process()

    def ensure_process(self) -> None:
        """Starts this process's thread pool and maintenance thread (again
        after a fork)."""
        if self._pid == os.getpid():
            return
        if self._pid != -1:
            # After fork the parent's lock may be held by a thread that does
            # not exist here: the child takes a new one.
            self.lock = threading.Lock()
        with self.lock:
            if self._pid == os.getpid():
                return
            self._pool = CodecPool(self.config.encode_threads)
            sweep = (lambda: provisional.sweep(self, retract_now=False), provisional.SWEEP_INTERVAL_S)  # dead writers' provisional blocks
            self._background = Background(self.path, self.engine, self.tier, self.config, sweep=sweep)
            if self.wing is not None:
                self.wing.start_process(forked=self._pid != -1)  # a forked child: the parent's threads are gone
            self._pid = os.getpid()
            self._background.start()

    def enter(self) -> None:
        """Starts a public operation (module invariants): ClosedError once
        close has begun; pair it with :meth:`leave`."""
        ident = threading.get_ident()
        with self._calls:
            holders = self._holders
            holders[ident] = holders.get(ident, 0) + 1  # counted even when refused: leave() always follows
            if self.closed:  # checked after the count: a close from a signal handler here saw it
                raise ClosedError(f"store {self.path} is closed")

    def leave(self) -> None:
        """Ends the operation :meth:`enter` started on this thread (called
        after it in a ``finally`` even when enter was interrupted, so a
        missing count is not an error)."""
        ident = threading.get_ident()
        with self._calls:
            holders = self._holders
            held = holders.get(ident, 0)
            if held > 1:
                holders[ident] = held - 1  # never popped and put back: a close in between sees it counted
            elif held:
                del holders[ident]
            if self.closed and not holders:
                self._drained.set()

    def forget_calls_after_fork(self) -> None:
        """Called in a forked child, at the fork: the parent's operations
        are not running here, its lock may have been held by a thread that
        is gone, and a close the parent had begun has nothing to release
        here."""
        self._calls = threading.RLock()
        self._holders = {}
        self._releaser = None
        self._drained, self._released = threading.Event(), threading.Event()
        if self.closed:
            self._drained.set()
            self._released.set()

    def check_open(self) -> None:
        if self.closed:
            raise ClosedError(f"store {self.path} is closed")
        self.ensure_process()

    def refuse_read_only(self, operation: str) -> None:
        if self.config.read_only:
            raise TierError(f"{operation} on store {self.path}, which is open read-only",
                            hint="open it without read_only=True (on a writable volume) to store or delete blocks")

    def check_writable(self) -> None:
        """:meth:`check_open`, and refuses a put on a read-only store, one
        whose maintenance thread died, or one whose syncs fail
        (:meth:`~ucm_db.store.background.Background.sync_refusal`)."""
        self.check_open()
        self.refuse_read_only("put")
        failure = self.activity.failure
        if failure is not None:
            raise TierError(
                f"store {self.path}: its maintenance thread (background sync) died: {failure!r}; puts are refused",
                hint="close and reopen the store; if it happens again, report the error",
            )
        refusal = self.activity.sync_refusal()
        if refusal is not None:
            raise refusal

    @property
    def codecs(self) -> CodecPool:
        """This process's codec threads (made again after a fork)."""
        assert self._pool is not None  # made in __init__ and after every fork
        return self._pool

    @property
    def activity(self) -> Background:
        """This process's background work (made again after a fork)."""
        assert self._background is not None  # made in __init__ and after every fork
        return self._background

    def close(self) -> None:
        """Closes the store once, after the operations in flight; a call
        from inside one or from a store thread hands the release off
        (module invariants). Later calls wait for the release."""
        ident = threading.get_ident()
        # Inside enter/leave on this thread (a signal handler): the lock is ours and the count may be mid-change.
        reentered = getattr(self._calls, "_is_owned", lambda: False)()
        with self._calls:
            handed_off = reentered or ident in self._holders or ident == self._releaser
            handed_off = handed_off or self._is_own_thread(threading.current_thread())
            first, self.closed = not self.closed, True
            if not self._holders:
                self._drained.set()
        if not first:
            if not handed_off:
                self._released.wait()
            return
        self._end_upload_waits()
        if handed_off:
            thread = threading.Thread(target=self._release_logged, name=f"{STORE_THREAD_PREFIX}close", daemon=True)
            _HANDED_OFF.add(thread)
            thread.start()
        else:
            self._release()

    def _is_own_thread(self, thread: threading.Thread) -> bool:
        """Whether ``thread`` is one this store started in this process (one
        its release joins or waits on: codec, maintenance, prefault, remote),
        by identity, never by name."""
        if self._pid != os.getpid():
            return False
        wing = self.wing
        owners = [self._background, self._pool, getattr(self.engine, "prefault", None)]
        if wing is not None:
            owners += [wing.uploader, wing.link, wing.continuations]
        # The holders' threads and pools are private to them: read by name here (_OWN_THREAD_FIELDS).
        holders = [getattr(owner, field, None) for owner in owners if owner is not None for field in _OWN_THREAD_FIELDS]
        # A pool's worker may run its first task before the pool lists it: its own arguments name its pool.
        worker_of = next((arg() for arg in getattr(thread, "_args", ()) if isinstance(arg, weakref.ref)), None)
        return any(holder is thread or (isinstance(holder, Executor) and (
            holder is worker_of or thread in list(getattr(holder, "_threads", ())))) for holder in holders)

    def _end_upload_waits(self) -> None:
        """Ends every ``flush`` waiting for the upload queue (ClosedError):
        a remote that is down would keep the close waiting for it."""
        if self.wing is not None and self.wing.uploader is not None and self._pid == os.getpid():
            self.wing.uploader.closing.set()

    def _wait_for_calls(self) -> None:
        """Waits for the operations in flight, at most CLOSE_WAIT_S in all
        (module invariants), logging the threads still counted."""
        end = time.monotonic() + CLOSE_WAIT_S
        while not self._drained.wait(max(0.0, min(CLOSE_LOG_EVERY_S, end - time.monotonic()))):
            with self._calls:
                counted = dict(self._holders)
            names = {thread.ident: thread.name for thread in threading.enumerate()}
            left = end - time.monotonic()
            logger.warning("ucm-db: closing store %s: still waiting for calls in flight on thread(s) %s%s",
                           self.path, {ident: names.get(ident, "(gone)") for ident in counted},
                           f"; releasing anyway in {left:.0f} s" if left > 0 else "; releasing it anyway")
            if left <= 0:
                return

    def _release_logged(self) -> None:
        try:
            self._release()
        except BaseException as exc:  # noqa: BLE001 - no caller to raise it to: logged
            logger.warning("ucm-db: closing store %s (handed off by a close from inside an operation) failed: %r",
                           self.path, exc)

    def _release(self) -> None:
        """Waits for the operations in flight, then stops this process's
        threads and closes the engine and the directory lock."""
        self._releaser = threading.get_ident()
        try:
            self._wait_for_calls()
            try:
                if self._pid == os.getpid():
                    self._stop_process()
            finally:
                try:
                    try:
                        self.engine.close()
                    finally:
                        if self._commit_ids is not None:
                            self._commit_ids.close()
                finally:
                    self._dir_lock.release()
        finally:
            self._released.set()
            _HANDED_OFF.discard(threading.current_thread())

    def _stop_process(self) -> None:
        """Stops this process's threads, flushes counters and syncs. Every
        step runs even when an earlier one fails; the first failure is
        raised at the end."""
        steps: list[Callable[[], object]] = [self.activity.stop]
        if self.wing is not None:
            steps += self.wing.close_steps()
        steps += [self.activity.flush_activity, self.engine.sync]
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


def _after_fork_in_child() -> None:
    for state in list(_STATES):
        state.forget_calls_after_fork()


def _join_handed_off() -> None:
    """At interpreter exit: waits (EXIT_WAIT_S in all) for the releases
    handed off, so their final flush and sync are not lost."""
    end = time.monotonic() + EXIT_WAIT_S
    for thread in list(_HANDED_OFF):
        thread.join(max(0.0, end - time.monotonic()))
        if thread.is_alive():
            logger.warning("ucm-db: a store's close (handed off) did not end within %s s of exit", EXIT_WAIT_S)


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_join_handed_off)
