"""Pinning chains in the local block index: pin, unpin and the pinned
counters (the records and their invariants are :mod:`ucm_db.index.pins`).
:class:`IndexPins` needs only the engine.

Invariants:
    * Each pin or unpin call is one write transaction: every chain's pin
      (or unpin) and the pinned counters, or nothing.
    * A pin covers what is stored *now* of each chain (its stored prefix
      under the namespace): a pin is made at the prefix's last block.
    * A call that would leave more than ``limit_bytes`` pinned in the whole
      store, and pins anything new, is refused (StoreFullError naming
      ``max_pinned_bytes``) and writes nothing. Pins already made stay
      whatever the limit (a process opened with a lower one refuses only
      new pins).
    * Unpinning a chain takes back every pin made at one of its stored
      blocks; a block stays pinned while a pin made further down another
      chain holds it (its ancestors are that chain's too).
"""

from __future__ import annotations

from collections.abc import Sequence

from ucm_db.engines.base import Engine, Txn
from ucm_db.errors import StoreFullError
from ucm_db.index import pins
from ucm_db.index.accounting import Changes
from ucm_db.index.reads import count_in
from ucm_db.stats import PinReport


class IndexPins:
    """Pin and unpin of the local block index over ``engine`` (see module invariants)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def pin_counts(self) -> dict[bytes, tuple[int, int]]:
        """Pinned (blocks, stored bytes) per namespace id (one read transaction)."""
        return self.engine.read(pins.pin_counts)

    def pin_chains(self, chains: Sequence[Sequence[bytes]], namespace_id: bytes, *, limit_bytes: int) -> PinReport:
        """Pins the stored prefix of each chain (and its ancestors).

        Raises:
            StoreFullError: the store would hold more than ``limit_bytes``
                pinned (nothing is pinned).
        """
        def run(txn: Txn) -> PinReport:
            changes = Changes(txn)
            before = list(changes.pins(namespace_id))
            counts = []
            for chain in chains:
                stored = count_in(txn, chain, namespace_id)
                if stored:
                    pins.pin_at(txn, changes, chain[stored - 1])
                counts.append(stored)
            after = changes.pins(namespace_id)
            total = pins.pinned_bytes(txn, changes)
            if total > limit_bytes and after[0] > before[0]:
                raise StoreFullError(
                    f"pinning these chains would pin {total} bytes in the store (this call adds {after[1] - before[1]} bytes "
                    f"in {after[0] - before[0]} blocks), over max_pinned_bytes={limit_bytes}; nothing was pinned",
                    hint="raise max_pinned_bytes (an option of ucm_db.open; `ucm-db pin --max-pinned-bytes`), "
                         "pin fewer or shorter chains, or unpin others (Store.unpin, `ucm-db unpin`)",
                )
            changes.commit()
            return PinReport(tuple(counts), after[0] - before[0], after[1] - before[1], after[0], after[1], total, limit_bytes)
        return self.engine.write(run)

    def unpin_chains(self, chains: Sequence[Sequence[bytes]], namespace_id: bytes, *, limit_bytes: int) -> PinReport:
        """Takes back the pins made at the chains' stored blocks; each
        chain's count in the report is its leading blocks still pinned (by
        pins on other chains)."""
        def run(txn: Txn) -> PinReport:
            changes = Changes(txn)
            before = list(changes.pins(namespace_id))
            still = []
            for chain in chains:
                stored = count_in(txn, chain, namespace_id)
                for key in chain[:stored]:
                    pins.unpin_at(txn, changes, key)
                still.append(_pinned_prefix(txn, chain, stored))
            after = changes.pins(namespace_id)
            total = pins.pinned_bytes(txn, changes)
            changes.commit()
            return PinReport(tuple(still), before[0] - after[0], before[1] - after[1], after[0], after[1], total, limit_bytes)
        return self.engine.write(run)


def _pinned_prefix(txn: Txn, chain: Sequence[bytes], stored: int) -> int:
    """Leading blocks of ``chain[:stored]`` pinned: a binary search (the
    pinned blocks of a chain are a prefix of it, pins.py)."""
    lo, hi = 0, stored
    while lo < hi:
        mid = (lo + hi) // 2
        if pins.is_pinned(txn, chain[mid]):
            lo = mid + 1
        else:
            hi = mid
    return lo
