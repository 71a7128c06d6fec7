"""vLLM's null block in a step's transfers: the block id (0) vLLM's
managers put where a request's blocks fell out of a window or were
skipped (sliding window, chunked local, RSWA, any manager's skipped
blocks). It holds no request's KV, and vLLM expects it to stay as it is.
It is never a request's own block, so the guard runs for every lone group,
whatever its spec.

Invariants:
    * A load never writes the null block (no attention reads it): its pairs
      are dropped from the transfer. A sync transfer left empty is dropped;
      an async one is kept empty, so the worker still reports the request
      finished (vLLM waits for that report).
    * A save that would read the null block is dropped, and so is every
      later save of that request (a chain has no gap): the request's stored
      prefix ends before it.
"""

from __future__ import annotations

from dataclasses import replace

from ucm_db.connector.metadata import BlockTransfer, UcmDbConnectorMetadata

#: The id of vLLM's null block (``BlockPool.null_block``: the first block, never allocated to a request).
NULL_BLOCK_ID = 0


def without_null(load: BlockTransfer) -> BlockTransfer:
    """``load`` less the blocks vLLM left null (outside a window)."""
    if NULL_BLOCK_ID not in load.block_ids:
        return load
    pairs = [(k, b) for k, b in zip(load.keys, load.block_ids) if b != NULL_BLOCK_ID]
    return replace(load, keys=tuple(k for k, _ in pairs), block_ids=tuple(b for _, b in pairs))


def drop_null_loads(meta: UcmDbConnectorMetadata) -> None:
    """``meta``'s loads less the null block (module invariants): an emptied
    sync load is dropped, an emptied async one kept for its report."""
    meta.loads = [t for t in map(without_null, meta.loads) if t.block_ids]
    meta.async_loads = list(map(without_null, meta.async_loads))


class NullBlockGuard:
    """The module's invariants over one KV cache group's step metadata, where
    ``active`` (a model with one KV cache group; a hybrid's groups are
    guarded by hybrid/hooks.py); otherwise it passes the metadata through."""

    def __init__(self, active: bool) -> None:
        self.active = active
        self._broken: set[str] = set()  # requests whose saves stopped at a null block

    def apply(self, meta: UcmDbConnectorMetadata) -> UcmDbConnectorMetadata:
        if not self.active:
            return meta
        drop_null_loads(meta)
        meta.saves = [t for t in meta.saves if self.keeps(t)]
        return meta

    def keeps(self, save: BlockTransfer) -> bool:
        """False for a save that reads the null block, and for every later one of its request."""
        if save.req_id not in self._broken and NULL_BLOCK_ID not in save.block_ids:
            return True
        self._broken.add(save.req_id)
        return False

    def forget(self, req_id: str) -> None:
        self._broken.discard(req_id)
