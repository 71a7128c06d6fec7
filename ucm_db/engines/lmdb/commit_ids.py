"""The last commit's transaction id, read from a map of LMDB's two meta
pages without a call into LMDB.

A serving engine's scheduler asks the store's epoch every step, and the
store answers from memory while nothing was committed
(:meth:`ucm_db.store.epoch_gate.EpochGate.epoch`). Every py-lmdb call gives
up the GIL, and in an engine whose model and ucm-db threads share the
process, taking it back cost a median 75 us of wall clock for 14 us of
CPU (``ucm-db bench hooks``). Reading the map keeps the GIL and costs well
under a microsecond.

Invariants:
    * The id is the larger of the two meta pages' transaction ids (the
      layout of :mod:`ucm_db.engines.lmdb.meta`). Every commit, any
      process's, writes a higher id into one of them, so a commit whose
      meta page was written before a read is never missed. A page read
      while LMDB writes it may read as any number: at worst a change
      reported where none finished (the caller reads again), or the commit
      being written taken as not yet made.
    * LMDB writes a commit's meta page before it hands the commit to new
      readers (its lock file's txnid), so a read transaction begun in
      between reads the commit before while :meth:`CommitIds.last`
      already names the new one: a cache must be keyed by the id its read
      saw (:meth:`CommitIds.seen_by`), and trusted only while
      :meth:`CommitIds.last` equals it.
    * Nothing is read through LMDB; the map is read-only, two pages long,
      and closed with the store. A file whose meta page cannot be decoded,
      or another engine (:func:`commit_ids_of`), gives no ids (None):
      callers then read every time.
"""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path

from ucm_db.engines.base import Engine, Txn
from ucm_db.engines.lmdb.engine import LmdbEngine
from ucm_db.engines.lmdb.meta import TXNID_OFFSET, read_meta_pages
from ucm_db.engines.lmdb.txn import LmdbTxn

_TXNID = struct.Struct("<Q")


class CommitIds:
    """A read-only map of one data file's meta pages (module invariants)."""

    def __init__(self, data_path: Path) -> None:
        self._map: mmap.mmap | None = None
        self._second_page = 0
        pages, _problems = read_meta_pages(data_path)
        if not pages:
            return
        self._second_page = pages[0].page_bytes
        fd = os.open(data_path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            self._map = mmap.mmap(fd, 2 * self._second_page, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)

    def last(self) -> int | None:
        """The last committed transaction's id; None where the meta pages
        could not be read at opening, or after :meth:`close`."""
        view = self._map
        if view is None:
            return None
        try:
            return max(_TXNID.unpack_from(view, TXNID_OFFSET)[0],
                       _TXNID.unpack_from(view, self._second_page + TXNID_OFFSET)[0])
        except ValueError:  # closed by another thread meanwhile
            return None

    @staticmethod
    def seen_by(txn: Txn) -> int | None:
        """The id of the commit ``txn`` reads (an LMDB transaction's), else None."""
        return txn.snapshot_id() if isinstance(txn, LmdbTxn) else None

    def close(self) -> None:
        view, self._map = self._map, None
        if view is not None:
            view.close()


def commit_ids_of(engine: Engine) -> CommitIds | None:
    """The commit ids of an LMDB store's data file (its engine opened it);
    None for another engine, or a data file that cannot be read."""
    if not isinstance(engine, LmdbEngine):
        return None
    try:
        return CommitIds(engine.path / "data.mdb")
    except (OSError, ValueError):  # gone, or shorter than its two meta pages: read every time
        return None
