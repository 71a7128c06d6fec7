"""Tiers: where encoded blocks live.

* :class:`~ucm_db.tiers.local.LocalTier` -- the local block index (prefix
  invariant, LRU, accounting) over a transactional engine;
  :class:`LmdbTier` and :class:`MemoryTier` are its two built-in flavours
  (RocksDB lives in :mod:`ucm_db.tiers.rocksdb`).
* :mod:`ucm_db.tiers.remote` -- the fsspec remote tier.
"""

from __future__ import annotations

from pathlib import Path

from ucm_db.tiers.base import Engine, Tier, TierCapabilities
from ucm_db.tiers.local import LocalTier
from ucm_db.tiers.lmdb import LmdbEngine
from ucm_db.tiers.memory import MemoryEngine


class LmdbTier(LocalTier):
    """A local tier in an LMDB environment directory (multi-process)."""

    def __init__(self, path: str | Path, *, capacity_bytes: int, sync: bool = True, map_size_bytes: int | None = None) -> None:
        map_size = map_size_bytes or max(64 << 20, 2 * capacity_bytes + (256 << 20))
        super().__init__(LmdbEngine(path, map_size_bytes=map_size, sync=sync), capacity_bytes=capacity_bytes)


class MemoryTier(LocalTier):
    """A local tier in memory: the reference behaviour, for tests."""

    def __init__(self, *, capacity_bytes: int) -> None:
        super().__init__(MemoryEngine(), capacity_bytes=capacity_bytes)


__all__ = ["Engine", "LmdbTier", "LocalTier", "MemoryTier", "Tier", "TierCapabilities"]
