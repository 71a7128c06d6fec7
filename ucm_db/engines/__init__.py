"""Tiers: where encoded blocks live.

* :mod:`ucm_db.tiers.base` -- the block-level :class:`Tier` and the
  transactional :class:`Engine` interfaces.
* :mod:`ucm_db.tiers.local` -- :class:`LocalTier`, the local block index
  (prefix invariant, LRU, accounting) over an engine: LMDB
  (:mod:`ucm_db.tiers.lmdb`), RocksDB (:mod:`ucm_db.tiers.rocksdb`) or
  memory (:mod:`ucm_db.tiers.memory`, for tests).
* :mod:`ucm_db.tiers.remote` -- the fsspec remote tier.

Engines are built in one place, :func:`ucm_db.format.open_engine`. The
package imports nothing itself, so loading one tier loads no other.
"""
