"""The engines' shared/exclusive gate: many transactions at once, or one
exclusive step alone.

The LMDB engine holds its transactions ``shared`` and changes the map size
``exclusive``; the RocksDB engine holds its read transactions ``shared`` and
closes the database in ``closing`` (its commits and reopens never wait for reads).

Wait rules (one set for both engines):
    * ``shared`` waits while an exclusive step runs or waits for the gate.
    * ``exclusive`` waits for an earlier exclusive step to end, then marks
      the gate taken at once (so no new ``shared`` holder comes in: an
      exclusive step never starves behind a stream of readers), then waits
      for the shared holders to leave.
    * Neither is re-entrant: a thread holding the gate must not take it again.
    * ``closing`` is ``exclusive`` for the engine's close: it waits for the
      transactions in flight to end, and once it ends the gate is closed
      for good: ``shared`` and ``exclusive`` raise
      :class:`~ucm_db.errors.ClosedError` instead of letting a transaction
      start on a closed (unmapped) environment, those waiting meanwhile
      included.

The RocksDB engine takes ``exclusive`` only under its own write lock, so for
it the first wait of ``exclusive`` never waits; the LMDB engine grows or
adopts the map from any thread, where that wait keeps two resizes apart.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from ucm_db.errors import ClosedError


class SharedExclusiveGate:
    """Many ``shared`` holders at once, or one ``exclusive`` holder alone
    (see the module's wait rules)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shared = 0
        self._exclusive = False
        self._closed: str | None = None  # why the gate is closed (the engine's message); None while open

    @property
    def closed(self) -> bool:
        return self._closed is not None

    def refuse_if_closed(self) -> None:
        if self._closed is not None:
            raise ClosedError(self._closed)

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            while self._exclusive:
                self._cond.wait()
            if self._closed is not None:
                raise ClosedError(self._closed)
            self._shared += 1
        try:
            yield
        finally:
            with self._cond:
                self._shared -= 1
                self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._exclusive_hold(closing=None):
            yield

    @contextmanager
    def closing(self, message: str) -> Iterator[None]:
        """``exclusive``, then closed for good (module rules): every later
        ``shared`` or ``exclusive`` raises ``ClosedError(message)``. On a
        closed gate it holds nothing and waits for nothing."""
        with self._exclusive_hold(closing=message):
            yield

    @contextmanager
    def _exclusive_hold(self, *, closing: str | None) -> Iterator[None]:
        with self._cond:
            while self._exclusive:
                self._cond.wait()
            taken = closing is None or self._closed is None  # a closed gate: a close holds nothing
            if taken:
                self.refuse_if_closed()
                self._exclusive = True
                while self._shared:
                    self._cond.wait()
        try:
            yield
        finally:
            if taken:
                with self._cond:
                    self._exclusive = False
                    if closing is not None:
                        self._closed = closing
                    self._cond.notify_all()
