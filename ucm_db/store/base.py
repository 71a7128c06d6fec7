"""The store's handles and the guards every operation passes: the base of
:class:`~ucm_db.store.Store` and of the operation mixins
(:mod:`ucm_db.store.writes`, :mod:`ucm_db.store.reads`,
:mod:`ucm_db.store.feed`).

Invariants:
    * Every public operation first calls :meth:`StoreBase._check_open` (or
      :meth:`StoreBase._check_writable`): a closed store raises
      ClosedError, and a forked child gets its own codec threads and
      maintenance thread (the parent's are not in it) before it does
      anything.
    * A read-only store refuses every write with a TierError naming the fix;
      a store whose maintenance thread died refuses puts.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from ucm_db.store.background import Background
from ucm_db.codec.pool import CodecPool
from ucm_db.config import StoreConfig
from ucm_db.errors import ClosedError, TierError
from ucm_db.storelock import StoreLock
from ucm_db.engines.base import Engine
from ucm_db.index.local import LocalTier

if TYPE_CHECKING:
    from ucm_db.remote.wing import RemoteWing
    from ucm_db.store.epoch_gate import EpochGate


class StoreBase:
    """The handles a store holds (set by :class:`~ucm_db.store.Store`'s
    ``__init__``) and the per-process parts made again after a fork."""

    path: Path
    config: StoreConfig
    _engine: Engine
    _tier: LocalTier
    _dir_lock: StoreLock
    _closed: bool
    _lock: threading.Lock
    _pid: int
    _pool: CodecPool | None
    _background: Background | None
    #: The remote wing (link, promotion, uploader); None without a ``remote``.
    _wing: RemoteWing | None
    #: The namespaces' epochs as this store serves them (lookups, reads, puts).
    _epochs: EpochGate

    def _ensure_process(self) -> None:
        """Starts this process's thread pool and maintenance thread (again
        after a fork)."""
        if self._pid == os.getpid():
            return
        with self._lock if self._pid == -1 else _fresh_lock(self):
            if self._pid == os.getpid():
                return
            self._pool = CodecPool(self.config.encode_threads)
            self._background = Background(self.path, self._engine, self._tier, self.config)
            if self._wing is not None:
                self._wing.start_process(forked=self._pid != -1)  # a forked child: the parent's threads are gone
            self._pid = os.getpid()
            self._background.start()

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"store {self.path} is closed")
        self._ensure_process()

    @property
    def _codecs(self) -> CodecPool:
        """This process's codec threads (made again after a fork)."""
        assert self._pool is not None  # made in __init__ and after every fork
        return self._pool

    @property
    def _activity(self) -> Background:
        """This process's background work (made again after a fork)."""
        assert self._background is not None  # made in __init__ and after every fork
        return self._background

    def _refuse_read_only(self, operation: str) -> None:
        if self.config.read_only:
            raise TierError(f"{operation} on store {self.path}, which is open read-only",
                            hint="open it without read_only=True (on a writable volume) to store or delete blocks")

    def _check_writable(self) -> None:
        self._check_open()
        self._refuse_read_only("put")
        failure = self._activity.failure
        if failure is not None:
            raise TierError(
                f"store {self.path}: its maintenance thread (background sync) died: {failure!r}; puts are refused",
                hint="close and reopen the store; if it happens again, report the error",
            )


def _fresh_lock(store: StoreBase) -> threading.Lock:
    # After fork the parent's lock may be held by a thread that does not
    # exist here: give the child a new one.
    store._lock = threading.Lock()
    return store._lock
