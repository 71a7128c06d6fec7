"""Presence queries for routers: :meth:`~ucm_db.Store.lookup_many`, the
stored prefix of many chains from one snapshot of the local tier
(:class:`StorePresence`, a part of :class:`~ucm_db.store.Store` built on its
:class:`~ucm_db.store.state.StoreState`: the local tier, the epoch gate).

A router choosing an engine for a prompt asks how much of it each node's
store holds. One :meth:`~ucm_db.Store.lookup` per prompt costs a read
transaction each; ``lookup_many`` answers a batch from one read
transaction, about two reads per chain stored whole or not at all
(:func:`ucm_db.index.reads.count_in`), a binary search otherwise.

Stores written by the vLLM connector hold per-head *units*
(:mod:`ucm_db.keys.units`), not whole blocks: a block counts only when the
unit of every KV head (of every pipeline stage) is stored, what the
connector itself counts as a hit (:func:`~ucm_db.keys.units.stored_prefix`,
run here against the same snapshot). :func:`whole_model_units` reads that
grid from the namespace's layout descriptor.

Invariants:
    * Local tier only: the remote is never asked, nothing is promoted.
    * Nothing is written and nothing is touched: no LRU recency, no hit or
      miss counts (a router's probe is not a use).
    * A namespace whose epoch is unknown reads as all zeros (not served).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence

from ucm_db.arguments import require_namespace
from ucm_db.errors import ConfigError
from ucm_db.index.reads import SnapshotPresence, require_key
from ucm_db.keys import KEY_BYTES, Namespace
from ucm_db.keys.units import KVGrid, UnitSpan, stored_prefix, unit_keys_of
from ucm_db.store.state import StoreState


class StorePresence:
    """``lookup_many`` of :class:`~ucm_db.store.Store` (module invariants)."""

    def __init__(self, state: StoreState) -> None:
        self._state = state
        self._tier = state.tier
        self._epochs = state.epochs

    def lookup_many(
        self, namespace: Namespace, chains: Sequence[Sequence[bytes]], *,
        grid: KVGrid | None = None, spans: Sequence[UnitSpan] | None = None,
    ) -> list[int]:
        """Each chain's stored prefix in the local tier (the number of its
        leading blocks stored), all from one read transaction.

        Args:
            chains: key chains, e.g. :meth:`Namespace.block_keys` of each
                prompt (keyed at :meth:`epoch`).
            grid, spans: given both, the chains are *block* keys of a store
                of units (:mod:`ucm_db.keys.units`) and a block counts only
                if its unit of every span is stored (e.g. ``spans`` from
                :func:`whole_model_units`: every KV head of the model).

        Returns:
            One count per chain, in order. Writes nothing, touches nothing
            and counts no hits (module invariants).
        """
        self._state.check_open()
        require_namespace(namespace, "lookup_many")
        checked = chain_list(chains, "lookup_many", flat_ok=False)
        units = unit_spans(grid, spans, "lookup_many")
        if not self._epochs.serves(namespace):
            return [0] * len(checked)  # its epoch is unknown (store/epoch_gate.py)
        if grid is None or units is None:
            return self._tier.with_snapshot(lambda presence: [presence.count(c) for c in checked],
                                            namespace_id=namespace.id)
        return self._tier.with_snapshot(lambda presence: _unit_prefixes(presence, namespace, grid, units, checked),
                                        namespace_id=namespace.id)


def unit_spans(grid: object, spans: object, operation: str) -> list[UnitSpan] | None:
    """``spans`` checked against ``grid`` (lookup_many's, pin's and unpin's
    arguments), or None when neither is given (whole-block keys). Anything
    but a :class:`KVGrid` and a non-empty sequence of :class:`UnitSpan`
    inside it is a ConfigError (an int grid or a tuple span was an
    AttributeError)."""
    hint = "pass grid and spans from maintenance.whole_model_units(namespace), or neither for whole-block keys"
    if grid is None and spans is None:
        return None
    if grid is None or spans is None:
        raise ConfigError(f"{operation} takes grid and spans together (or neither)", hint=hint)
    if not isinstance(grid, KVGrid):
        raise ConfigError(f"{operation}: grid must be a KVGrid, got {type(grid).__name__}", hint=hint)
    if isinstance(spans, (str, bytes, bytearray, memoryview)) or not isinstance(spans, Iterable):
        raise ConfigError(f"{operation}: spans must be a sequence of UnitSpan, got {type(spans).__name__}", hint=hint)
    checked = list(spans)
    if not checked:
        raise ConfigError(f"{operation}: spans is empty", hint=hint)
    for span in checked:
        if not isinstance(span, UnitSpan):
            raise ConfigError(f"{operation}: spans hold UnitSpan values, got {type(span).__name__}", hint=hint)
    return [grid.check(span) for span in checked]


def _unit_prefixes(presence: SnapshotPresence, namespace: Namespace, grid: KVGrid, spans: list[UnitSpan],
                   chains: list[Sequence[bytes]]) -> list[int]:
    """:func:`~ucm_db.keys.units.stored_prefix` of each chain in one
    snapshot, its first reads made for the whole batch (unit keys derived
    in one ``unit_keys_of`` call each, every span's tag found once): the
    first span's last unit; where it is stored, every other span's last
    unit (all stored: the whole chain, by each span's prefix invariant);
    where it is not, the first span's first unit (absent: 0). A chain
    stored whole costs one read per span, one stored nowhere two; only a
    chain stored in part takes the search itself."""
    found = [0] * len(chains)
    asked: list[int] = []
    lasts: list[bytes] = []
    for i, chain in enumerate(chains):
        if not len(chain):
            continue
        # A list's own item read: BlockKeys' __getitem__ is Python code.
        last = list.__getitem__(chain, -1) if isinstance(chain, list) else chain[-1]
        if type(last) is not bytes or len(last) != KEY_BYTES:
            require_key(last)  # the keys hashed without a read's check; the rest are the search's
        asked.append(i)
        lasts.append(last)
    ends = presence.present(unit_keys_of(lasts, spans[:1], grid), derived=True)
    ended = [n for n, end in enumerate(ends) if end]
    rest = spans[1:]
    others = presence.present(unit_keys_of([lasts[n] for n in ended], rest, grid), derived=True) if rest else []
    width = len(rest)
    partial = [asked[n] for k, n in enumerate(ended) if not all(others[k * width : (k + 1) * width])]
    for n in ended:
        found[asked[n]] = len(chains[asked[n]])
    unended = [asked[n] for n, end in enumerate(ends) if not end]
    firsts = [chains[i][0] for i in unended]
    for key in firsts:
        if type(key) is not bytes or len(key) != KEY_BYTES:
            require_key(key)
    starts = presence.present(unit_keys_of(firsts, spans[:1], grid), derived=True)
    partial += [i for i, start in zip(unended, starts) if start]
    for i in partial:
        found[i] = stored_prefix(presence, namespace, grid, spans, chains[i])
    return found


def chain_list(chains: object, operation: str, *, flat_ok: bool) -> list[Sequence[bytes]]:
    """``chains`` as a list of key chains. With ``flat_ok`` a flat sequence
    of keys is one chain. A chain's keys are checked where they are read."""
    if isinstance(chains, (bytes, bytearray, memoryview, str)) or not isinstance(chains, Sequence):
        raise ConfigError(f"{operation} takes a list of key chains, got {type(chains).__name__}",
                          hint="pass e.g. [ns.block_keys(prompt, epoch=store.epoch(ns)) for prompt in prompts]")
    if flat_ok and (not chains or isinstance(chains[0], (bytes, bytearray, memoryview))):
        return [chains]  # type: ignore[list-item]
    for chain in chains:
        if isinstance(chain, (bytes, bytearray, memoryview, str)) or not isinstance(chain, Sequence):
            raise ConfigError(f"{operation} takes a list of key chains; one is a {type(chain).__name__}",
                              hint="wrap a single chain: [keys]")
    return list(chains)


def whole_model_units(namespace: Namespace, layer_partition: Sequence[int] | None = None) -> tuple[KVGrid, list[UnitSpan]] | None:
    """The units a block of ``namespace`` is stored as by the vLLM
    connector, every KV head of every pipeline stage (what its reader
    needs for a hit), or None for a namespace of whole blocks.

    A namespace of units is one whose layout is the connector's descriptor
    (JSON naming ``kv_heads`` and ``layers``) at TP and PP size 1 (the
    connector's namespaces do not depend on either; one with a rank is a
    per-rank namespace from before units). A model with one KV head (MLA's
    latent included) at one stage is stored as whole blocks.

    Args:
        layer_partition: layers per pipeline stage of the deployment that
            wrote the blocks (as vLLM split them, or
            ``VLLM_PP_LAYER_PARTITION``); None: one stage.

    Raises:
        ConfigError: the partition does not add up to the model's layers.
    """
    if namespace.tp_size != 1 or namespace.pp_size != 1:
        return None
    try:
        layout = json.loads(namespace.layout)
    except ValueError:
        return None
    heads, layers = (layout.get("kv_heads"), layout.get("layers")) if isinstance(layout, dict) else (None, None)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (heads, layers)):
        return None
    assert isinstance(heads, int) and isinstance(layers, int)
    stages = list(layer_partition) if layer_partition else [layers]
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in stages) or sum(stages) != layers:
        raise ConfigError(f"layer partition {stages} does not split the model's {layers} layers",
                          hint=f"give each pipeline stage's layer count, adding up to {layers} (e.g. as VLLM_PP_LAYER_PARTITION)")
    grid = KVGrid(heads, layers)
    spans: list[UnitSpan] = []
    start = 0
    for count in stages:
        spans += grid.head_spans((start, start + count))
        start += count
    return None if spans == [grid.whole] else (grid, spans)
