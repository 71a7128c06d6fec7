"""What a reader keyed at a store's current epoch gets: the one read the
epoch tests share (the connector keys its lookups the same way)."""

from __future__ import annotations

from collections.abc import Sequence

import ucm_db
from ucm_db.errors import TierError
from ucm_db.keys import Namespace


def served(store: ucm_db.Store, ns: Namespace, tokens: Sequence[int], *, unreadable_epoch_is_miss: bool = True) -> list[bytes]:
    """The blocks of ``tokens`` a reader keyed at ``store.epoch(ns)`` finds:
    the stored prefix, read. An epoch that cannot be read (a TierError) is
    nothing served where ``unreadable_epoch_is_miss`` (as the connector
    treats it), and raises otherwise (a test that expects a readable epoch)."""
    try:
        epoch = store.epoch(ns)
    except TierError:
        if not unreadable_epoch_is_miss:
            raise
        return []
    keys = ns.block_keys(list(tokens), epoch=epoch)
    return [bytes(b) for b in store.get(ns, keys[: store.lookup(ns, keys)]) if b is not None]
