"""Pinning chains in the local block index: pin, unpin and the pinned
counters (the records and their invariants are :mod:`ucm_db.index.pins`).
:class:`IndexPins` needs only the engine.

Invariants:
    * Each pin or unpin call is one write transaction: every chain's pin
      (or unpin) and the pinned counters, or nothing.
    * A pin covers what is stored *now* of each chain (its stored prefix
      under the namespace): a pin is made at the prefix's last block, and
      named by the chain (its last key as given). One pin per chain:
      pinning a chain again moves its pin to what is stored of it now, and
      adds no second one (pins are idempotent per chain, not counted).
    * Unpinning a chain takes back that chain's pin and no other: a block
      stays pinned while any other chain's pin holds it, at it or below (a
      system prompt pinned on its own stays pinned when a conversation
      continuing it is unpinned, and the other way round). A chain with no
      pin of its own takes back the deepest *legacy* pin on its pinned
      blocks (made by ucm-db before pins were named by chain, :mod:`pins`),
      as that version's unpin did, one per call; pinning a chain whose tip
      holds a legacy pin takes that pin as the chain's own.
    * A chain whose first block was stored before the namespace's epoch
      last moved (``pinsince:``, read in the pin's own transaction, so a
      bump cannot slip between the check and the pin) is keyed at an older
      epoch: the call raises :class:`~ucm_db.errors.StaleEpochError` and
      pins nothing. Its blocks are never served again; a pin would keep
      them forever. ``guard`` (the namespace's epoch is known) runs first
      in the same transaction.
    * A call that would leave more than ``limit_bytes`` pinned in the whole
      store, and pins anything new, is refused (StoreFullError naming
      ``max_pinned_bytes``) and writes nothing; a ``limit_bytes`` of 0
      refuses every call that finds any of its chains stored (a pin again
      of a pinned chain, or over blocks another pin holds, too). Pins
      already made stay whatever the limit (a process opened with a lower
      one refuses only new pins).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from ucm_db.engines.base import Engine, Txn
from ucm_db.errors import StaleEpochError, StoreFullError
from ucm_db.index import pins, records
from ucm_db.index.accounting import Changes
from ucm_db.index.reads import count_in
from ucm_db.stats import PinReport

logger = logging.getLogger("ucm_db")


class IndexPins:
    """Pin and unpin of the local block index over ``engine`` (see module invariants)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def pin_counts(self) -> dict[bytes, tuple[int, int]]:
        """Pinned (blocks, stored bytes) per namespace id (one read transaction)."""
        return self.engine.read(pins.pin_counts)

    def pin_chains(
        self, chains: Sequence[Sequence[bytes]], namespace_id: bytes, *, limit_bytes: int,
        guard: Callable[[Txn], None] | None = None,
    ) -> PinReport:
        """Pins the stored prefix of each chain (and its ancestors).

        Args:
            guard: run first inside the write transaction; what it raises
                refuses the call (the store's epoch gate).

        Raises:
            StoreFullError: the store would hold more than ``limit_bytes``
                pinned (nothing is pinned).
            StaleEpochError: a chain was stored before the namespace's
                epoch last moved (nothing is pinned).
        """
        def run(txn: Txn) -> PinReport:
            if guard is not None:
                guard(txn)
            changes = Changes(txn)
            before = list(changes.pins(namespace_id))
            moved_ns = epoch_moved_ns(txn, namespace_id)
            counts = []
            for number, chain in enumerate(chains, 1):
                stored = count_in(txn, chain, namespace_id)
                if stored:
                    _refuse_stale(txn, chain[0], moved_ns, number, len(chains))
                    _pin_chain(txn, changes, chain, stored, namespace_id)
                counts.append(stored)
            after = changes.pins(namespace_id)
            total = pins.pinned_bytes(txn, changes)
            if (total > limit_bytes and after[0] > before[0]) or (limit_bytes == 0 and any(counts)):
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
        """Takes back each chain's own pin (module invariants); each
        chain's count in the report is its leading blocks still pinned (by
        pins of chains outside this call) once the whole call's pins are
        taken back."""
        def run(txn: Txn) -> PinReport:
            changes = Changes(txn)
            before = list(changes.pins(namespace_id))
            reach = []
            for chain in chains:
                stored = count_in(txn, chain, namespace_id)
                pinned = _pinned_prefix(txn, chain, stored)
                if pinned:
                    _unpin_chain(txn, changes, chain, pinned)
                reach.append(pinned)
            # Counted once every chain's pin is taken back: a later chain of the
            # call may have held an earlier one's blocks.
            still = [_pinned_prefix(txn, chain, pinned) for chain, pinned in zip(chains, reach)]
            after = changes.pins(namespace_id)
            total = pins.pinned_bytes(txn, changes)
            changes.commit()
            return PinReport(tuple(still), before[0] - after[0], before[1] - after[1], after[0], after[1], total, limit_bytes)
        return self.engine.write(run)


def epoch_moved_ns(txn: Txn, namespace_id: bytes) -> int | None:
    """When the namespace's epoch last moved (``pinsince:``, :mod:`pins`);
    None where it never did since that record was kept, or the record is
    damaged (logged: the next move writes it anew)."""
    try:
        data = records.get_checked(txn, pins.PIN_SINCE_PREFIX + namespace_id, size=pins.PIN_SINCE.size)
    except records.DamagedRecord as exc:
        logger.warning("ucm-db: %s; pins of chains stored before the last epoch move are not refused until the next one", exc)
        return None
    return None if data is None else int(pins.PIN_SINCE.unpack(data)[0])


def _refuse_stale(txn: Txn, first: bytes, moved_ns: int | None, number: int, count: int) -> None:
    """StaleEpochError where the chain starting at the stored ``first`` was
    stored before the epoch moved at ``moved_ns`` (module invariants)."""
    stored_ns = None if moved_ns is None else pins.root_stored_ns(txn, first)
    if moved_ns is not None and stored_ns is not None and stored_ns < moved_ns:
        raise StaleEpochError(
            f"chain {number} of the {count} to pin was stored before the namespace's epoch last moved: its keys are "
            "rooted at an older epoch, whose blocks are never served again; nothing was pinned")


def _pin_chain(txn: Txn, changes: Changes, chain: Sequence[bytes], stored: int, namespace_id: bytes) -> None:
    """Makes ``chain``'s pin at its stored tip, moving the pin it made
    before (if any, at a block above: its stored prefix only grows while
    pinned; above ``chain[0]`` too, where the chain is given as a slice of
    itself) there."""
    chain_id, tip = chain[-1], chain[stored - 1]
    made = pins.chain_pin_in(txn, chain[:_pinned_prefix(txn, chain, stored)], chain_id)
    if made is None:  # the chain given as a slice may have made its pin above it
        made = pins.chain_pin_above(txn, chain[0], chain_id)
    if made != tip:
        pins.pin_chain(txn, changes, tip, chain_id, namespace_id)
        if made is not None:
            pins.unpin_chain(txn, changes, made, chain_id)


def _unpin_chain(txn: Txn, changes: Changes, chain: Sequence[bytes], pinned: int) -> None:
    """Takes back ``chain``'s own pin, found among its ``pinned`` leading
    blocks; without one, the deepest legacy pin there (module invariants)."""
    chain_id = chain[-1]
    made = pins.chain_pin_in(txn, chain[:pinned], chain_id)
    if made is not None:
        pins.unpin_chain(txn, changes, made, chain_id)
        return
    legacy = pins.legacy_pin_in(txn, chain[:pinned])
    if legacy is not None:
        pins.unpin_chain(txn, changes, legacy, None)


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
