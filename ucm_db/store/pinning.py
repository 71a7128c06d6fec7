"""Pinning: :meth:`~ucm_db.Store.pin` and :meth:`~ucm_db.Store.unpin` keep
chains (a system prompt, a few-shot preamble) out of eviction:
:class:`StorePins`, a part of :class:`~ucm_db.store.Store` built on its
:class:`~ucm_db.store.state.StoreState` (the local tier, the epoch gate).

Invariants:
    * A pinned block and all its ancestors are never evicted; a put that
      needs room when only pinned (or its own) blocks are left raises
      :class:`~ucm_db.errors.StoreFullError` as with nothing evictable.
    * A pin covers the chain's blocks stored when it is made; pins live in
      the local index (:mod:`ucm_db.index.pins`), so they survive restarts
      and ``compact``, and are seen by every process at once. They are not
      uploaded, exported or warmed: a pin belongs to one store.
    * Pins never outlive what they pin: a delete or a quarantine takes the
      blocks' pins, and invalidating the namespace (:meth:`bump_epoch`,
      ``ucm-db invalidate``, an engine's ``reset_cache``, an epoch adopted
      from a remote or an archive) releases all its pins in the same
      transaction (its blocks are never served again).
    * Nothing of an older epoch is pinned: a pin of a chain stored before
      the namespace's epoch last moved raises
      :class:`~ucm_db.errors.StaleEpochError` and pins nothing; the check
      and the epoch's (known) state are read inside the pin's own write
      transaction, so a bump in between cannot slip past it
      (:mod:`ucm_db.index.pinning`).
    * One pin per chain (named by its last key as given): pinning it again
      adds no second pin, and ``unpin`` of a chain takes back its own pin
      only, never one another chain (a system prompt pinned on its own)
      made on blocks they share.
    * The store's pinned bytes stay within ``max_pinned_bytes`` when a pin
      is made (:attr:`~ucm_db.config.StoreConfig.pinned_limit_bytes`); a pin
      beyond it writes nothing and raises StoreFullError naming the setting.
    * Each call is one write transaction, synced before it returns (a pin
      survives a power cut once made, whatever the durability).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from ucm_db.arguments import key_list, require_namespace
from ucm_db.keys import Namespace
from ucm_db.keys.units import KVGrid, UnitKeys, UnitSpan
from ucm_db.stats import PinReport
from ucm_db.store.state import StoreState
from ucm_db.store.presence import chain_list, unit_spans


class StorePins:
    """``pin`` and ``unpin`` of :class:`~ucm_db.store.Store` (module invariants)."""

    def __init__(self, state: StoreState) -> None:
        self._state = state
        self._tier = state.tier
        self._epochs = state.epochs

    def pin(
        self, namespace: Namespace, keys: Sequence[bytes] | Sequence[Sequence[bytes]], *,
        grid: KVGrid | None = None, spans: Sequence[UnitSpan] | None = None,
    ) -> PinReport:
        """Pins the stored blocks of a chain (or of each of several): they
        and their ancestors are never evicted until unpinned (module
        invariants). Pinning a chain pinned already adds no second pin (it
        covers what is stored of the chain now); one :meth:`unpin` of the
        chain takes it back.

        Args:
            keys: one chain of keys (e.g. ``ns.block_keys(tokens,
                epoch=store.epoch(ns))``) or a list of chains. What is
                stored of each chain now (its stored prefix) is pinned.
            grid, spans: given both, the chains are *block* keys of a store
                of units (:mod:`ucm_db.keys.units`, as
                :meth:`lookup_many` takes them): each span's unit chain is
                pinned, and the report counts whole-model blocks (the
                fewest any span has pinned).

        Raises:
            StoreFullError: the store would hold more than
                ``max_pinned_bytes`` pinned (nothing is pinned).
            StaleEpochError: (a ValueError) a chain's blocks were stored
                before the namespace's epoch last moved: keys of an older
                epoch (nothing is pinned).
            EpochUnknownError: (a TierError) the namespace is not served.
            TierError: the store is open read-only.
        """
        self._state.check_open()
        require_namespace(namespace, "pin")
        self._state.refuse_read_only("pin")
        chains, width = _unit_chains(keys, "pin", grid, spans)
        self._epochs.epoch(namespace)  # first contact with a remote: a higher epoch there is recorded (and moves pins on)
        report = self._tier.pin_chains(  # the epoch's state and when it moved are read in the pin's transaction
            chains, namespace.id, limit_bytes=self._state.config.pinned_limit_bytes,
            guard=lambda txn: self._epochs.check_put(txn, namespace.id))
        self._state.engine.sync()
        return _per_block(report, width)

    def unpin(
        self, namespace: Namespace, keys: Sequence[bytes] | Sequence[Sequence[bytes]], *,
        grid: KVGrid | None = None, spans: Sequence[UnitSpan] | None = None,
    ) -> PinReport:
        """Takes back the pin a chain made (or each of several chains;
        ``grid`` and ``spans`` as for :meth:`pin`): name the chain as it was
        pinned (the same keys: its last key names the pin). Its blocks are
        evicted as any block again, unless another chain's pin still holds
        them (a prefix pinned on its own, a longer chain continuing them:
        the report's ``chains`` says how many leading blocks stay pinned).
        A chain with no pin of its own takes back the deepest pin an older
        ucm-db made on its blocks, as that version did.

        Raises:
            TierError: the store is open read-only.
        """
        self._state.check_open()
        require_namespace(namespace, "unpin")
        self._state.refuse_read_only("unpin")
        chains, width = _unit_chains(keys, "unpin", grid, spans)
        report = self._tier.unpin_chains(chains, namespace.id, limit_bytes=self._state.config.pinned_limit_bytes)
        self._state.engine.sync()
        return _per_block(report, width)


def _unit_chains(keys: object, operation: str, grid: KVGrid | None, spans: Sequence[UnitSpan] | None) -> tuple[list[Sequence[bytes]], int]:
    """The key chains to pin: the chains given, or with ``grid`` and
    ``spans`` each one's unit chain of every span (chain-major); and how
    many chains each given one became."""
    chains = [key_list(chain, operation) for chain in chain_list(keys, operation, flat_ok=True)]
    units = unit_spans(grid, spans, operation)
    if grid is None or units is None:
        return chains, 1
    return [list(UnitKeys(chain, grid, span)) for chain in chains for span in units], len(units)


def _per_block(report: PinReport, width: int) -> PinReport:
    """``report`` with one count per chain given: the fewest of its ``width`` unit chains."""
    if width == 1:
        return report
    counts = report.chains
    return replace(report, chains=tuple(min(counts[i : i + width]) for i in range(0, len(counts), width)))
