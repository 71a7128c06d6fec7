"""One read transaction seen as an engine: several reads of a tier answered
from one snapshot.

A report built from several of a tier's reads (totals, namespace counters,
pins, a scan of the metadata) contradicts itself where a writer commits
between them, as each read takes a transaction of its own. Built over an
open read transaction, :class:`SnapshotEngine` answers every ``read`` from
it, so a :class:`~ucm_db.index.local.LocalTier` over it reads one commit.

Invariants:
    * Every ``read`` runs in the one transaction given; it is valid only
      while that transaction is open (inside the engine's ``read`` call
      that made it).
    * Nothing is written: ``write`` and ``sync`` raise.
    * No read of the engine's own is opened inside it (a second read
      transaction in the thread of an open one can wait forever on the
      engine's gate): the figures the engine reads in a transaction of its
      own (free pages, used extent) are None here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from ucm_db.engines.base import Engine, Txn
from ucm_db.errors import TierError

T = TypeVar("T")


class SnapshotEngine(Engine):
    """``engine``'s read transaction ``txn`` as an engine (module invariants)."""

    def __init__(self, engine: Engine, txn: Txn) -> None:
        self.name = engine.name
        self.multi_process = engine.multi_process
        self.persistent = engine.persistent
        self._engine = engine
        self._txn = txn

    def read(self, fn: Callable[[Txn], T]) -> T:
        return fn(self._txn)

    def write(self, fn: Callable[[Txn], T]) -> T:
        raise TierError("a snapshot of a store is read-only", hint="write through the store itself")

    def sync(self) -> None:
        raise TierError("a snapshot of a store is read-only", hint="sync the store itself")

    def close(self) -> None:
        """The snapshot owns nothing: the engine stays open."""

    def file_bytes(self) -> int:
        return self._engine.file_bytes()

    def free_page_bytes(self) -> int | None:
        """None: the engine reads it in a transaction of its own, which a
        thread inside this one must not open (ask the engine outside)."""
        return None

    def used_extent_bytes(self) -> int | None:
        """None, as :meth:`free_page_bytes`."""
        return None
