"""The local tier's block index over an engine: blocks, per-block metadata,
LRU order, byte-accurate accounting, the change feed, quarantine and the
durable upload queue, all changed inside the engine's transactions.

:class:`~ucm_db.index.local.LocalTier` is its face, a facade holding one
part per job (reads, writes, upkeep, pinning, upload queue, damage). The
package imports nothing itself.
"""
