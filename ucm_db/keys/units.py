"""Storage units: the KV of one block split by KV-head and layer range.

A block's KV is a grid of ``heads x layers`` (:class:`KVGrid`: the model's
*whole* KV, every KV head and every layer, whatever the tensor- or
pipeline-parallel size). What the store holds for a block is one or more
*units*, each a rectangle of that grid (:class:`UnitSpan`), stored under
its own key derived from the block key (:func:`unit_key`), as one frame per
layer. ``docs/tp.md`` has the picture; the rules:

Invariants:
    * One unit per (block, KV head, layer range of a pipeline stage): the
      spans of a block are fixed by the model and the pipeline partition,
      never by the tensor-parallel size, so writers at any TP size write the
      same keys and readers at any TP size find them. No byte is stored
      twice: a second writer of a key finds it present and skips it.
    * A unit covering the whole grid is keyed by the block key itself (MLA,
      single-KV-head models; whole blocks written before units existed were
      keyed so too, and ``ucm-db migrate`` splits them, :mod:`ucm_db.maintenance.pre_units`);
      any other unit by ``BLAKE2b(block key || span tag)``, so a key still
      names its whole token prefix, its namespace and its rectangle.
    * Each span forms its own chain (``unit_key(k[i], s)``'s parent is
      ``unit_key(k[i-1], s)``) and keeps the store's prefix invariant, so
      presence along one span's chain is monotone: :func:`stored_prefix`
      is one binary search plus one probe per further span (a binary
      search only for a span whose chain is shorter).
    * Nothing here knows tensors: :mod:`ucm_db.connector.layouts` turns KV
      caches into unit frames.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, overload

from ucm_db.errors import ConfigError
from ucm_db.keys import KEY_BYTES, Namespace

_UNIT_PERSON = b"ucm-db/unit"
#: The unit-key hasher (person set, nothing hashed), copied per key: copying a
#: ready hasher skips the constructor's keyword parsing and parameter block
#: (0.6 against 1.1 us a key), as key_chain's block keys do.
_UNIT_HASHER = hashlib.blake2b(digest_size=KEY_BYTES, person=_UNIT_PERSON)


@dataclass(frozen=True, slots=True)
class UnitSpan:
    """A rectangle of a block's KV grid: heads ``[head_start, head_stop)``
    of layers ``[layer_start, layer_stop)``."""

    head_start: int
    head_stop: int
    layer_start: int
    layer_stop: int

    def __post_init__(self) -> None:
        if not (0 <= self.head_start < self.head_stop and 0 <= self.layer_start < self.layer_stop):
            raise ConfigError(f"empty or negative unit span {self}", hint="a span needs at least one head and one layer")

    @property
    def heads(self) -> range:
        return range(self.head_start, self.head_stop)

    @property
    def layers(self) -> range:
        return range(self.layer_start, self.layer_stop)

    def tag(self) -> bytes:
        """Canonical bytes naming the span inside a unit key."""
        return f"h{self.head_start}:{self.head_stop}/l{self.layer_start}:{self.layer_stop}".encode()


@dataclass(frozen=True, slots=True)
class KVGrid:
    """The whole KV of one block: ``heads`` KV heads (1 for MLA's latent)
    by ``layers`` attention layers."""

    heads: int
    layers: int

    def __post_init__(self) -> None:
        for name in ("heads", "layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"KVGrid.{name} must be a positive integer, got {value!r}", hint=f"pass the model's {name}")

    @property
    def whole(self) -> UnitSpan:
        return UnitSpan(0, self.heads, 0, self.layers)

    def check(self, span: UnitSpan) -> UnitSpan:
        if span.head_stop > self.heads or span.layer_stop > self.layers:
            raise ConfigError(f"unit span {span} lies outside the {self.heads}x{self.layers} KV grid", hint="check the head and layer ranges")
        return span

    def head_spans(self, layers: tuple[int, int] | None = None) -> list[UnitSpan]:
        """The storage units of one layer range: one per KV head."""
        start, stop = layers if layers is not None else (0, self.layers)
        return [self.check(UnitSpan(h, h + 1, start, stop)) for h in range(self.heads)]


def unit_key(block_key: bytes, span: UnitSpan, grid: KVGrid) -> bytes:
    """The store key of ``span`` of the block ``block_key`` (see invariants)."""
    return _keyed(block_key, _tag_in(span, grid))


def _tag_in(span: UnitSpan, grid: KVGrid) -> bytes | None:
    """``span``'s tag, or None for the whole grid (keyed by the block key)."""
    return None if span == grid.whole else grid.check(span).tag()


def _keyed(block_key: bytes, tag: bytes | None) -> bytes:
    """The unit key of ``tag``'s span of ``block_key`` (hashing ``key ||
    tag`` in one update gives the digest of two updates)."""
    if tag is None:
        return block_key
    h = _UNIT_HASHER.copy()
    h.update(block_key + tag)
    return h.digest()


def unit_keys_of(block_keys: Sequence[bytes], spans: Sequence[UnitSpan], grid: KVGrid) -> list[bytes]:
    """Every unit key of ``block_keys`` x ``spans``, block-major (the keys
    of block 0's spans, then block 1's): ``unit_key`` of each, derived in
    one pass (each span's tag and wholeness found once)."""
    tags = [_tag_in(span, grid) for span in spans]
    if None in tags:
        return [_keyed(k, tag) for k in block_keys for tag in tags]
    # A router's query derives thousands: each block key is hashed once and
    # its state copied per tag (the digest of key || tag, as _keyed's).
    span_tags = [tag for tag in tags if tag is not None]
    out: list[bytes] = []
    append, fresh = out.append, _UNIT_HASHER.copy
    for key in block_keys:
        keyed = fresh()
        keyed.update(key)
        for tag in span_tags:
            h = keyed.copy()
            h.update(tag)
            append(h.digest())
    return out


class UnitKeys(Sequence[bytes]):
    """The unit keys of one span along ``block_keys[start:stop]``, derived
    when read (a lookup's binary search reads O(log n) of them)."""

    __slots__ = ("_block_keys", "_grid", "_span", "_tag", "_start", "_stop")

    def __init__(self, block_keys: Sequence[bytes], grid: KVGrid, span: UnitSpan, start: int = 0, stop: int | None = None) -> None:
        self._block_keys = block_keys
        self._grid = grid
        self._tag = _tag_in(span, grid)  # checks the span; found once: a lookup's search reads many keys
        self._span = span
        self._start = start
        self._stop = len(block_keys) if stop is None else min(stop, len(block_keys))

    def __len__(self) -> int:
        return max(0, self._stop - self._start)

    @overload
    def __getitem__(self, index: int) -> bytes: ...

    @overload
    def __getitem__(self, index: slice) -> UnitKeys: ...

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                raise ValueError("UnitKeys slices take step 1")
            return UnitKeys(self._block_keys, self._grid, self._span, self._start + start, self._start + max(start, stop))
        if index < 0:
            index += len(self)
        if not 0 <= index < self._stop - self._start:
            raise IndexError(index)
        return _keyed(self._block_keys[self._start + index], self._tag)

    def parent(self) -> bytes | None:
        """The unit key before the first one (None at the chain's start)."""
        return _keyed(self._block_keys[self._start - 1], self._tag) if self._start else None


def head_range(total_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """KV heads ``[start, stop)`` that tensor-parallel rank ``tp_rank``
    holds. With fewer heads than ranks each head is replicated on
    ``tp_size // total_heads`` consecutive ranks (vLLM's rule)."""
    if tp_size <= total_heads:
        if total_heads % tp_size:
            raise ConfigError(f"{total_heads} KV heads do not split over TP size {tp_size}", hint="use a TP size dividing the KV heads")
        per_rank = total_heads // tp_size
        return tp_rank * per_rank, (tp_rank + 1) * per_rank
    if tp_size % total_heads:
        raise ConfigError(f"TP size {tp_size} is not a multiple of {total_heads} KV heads", hint="use a TP size the KV heads divide")
    head = tp_rank // (tp_size // total_heads)
    return head, head + 1


def writes_heads(total_heads: int, tp_size: int, tp_rank: int) -> bool:
    """Whether ``tp_rank`` writes its heads: of the ranks holding a
    replicated head only the first does, so each head has one writer."""
    return tp_size <= total_heads or tp_rank % (tp_size // total_heads) == 0


def stored_prefix(
    store: Any, namespace: Namespace, grid: KVGrid, spans: Sequence[UnitSpan], block_keys: Sequence[bytes],
    start: int = 0, stop: int | None = None,
) -> int:
    """Leading blocks of ``block_keys[start:stop]`` whose units of every
    span in ``spans`` are stored: a binary search on the first span's
    chain, then for each further span one probe of its last unit (present
    means its whole chain is, by the prefix invariant), searching that
    chain only where the probe misses."""
    stop = len(block_keys) if stop is None else min(stop, len(block_keys))
    found = max(0, stop - start)
    for i, span in enumerate(spans):
        if found == 0:
            return 0
        chain = UnitKeys(block_keys, grid, span, start, start + found)
        if i and store.lookup(namespace, chain[found - 1 : found]) == 1:
            continue
        found = store.lookup(namespace, chain)
    return found


@dataclass(frozen=True, slots=True)
class ReadPiece:
    """Part of a reader's rectangle that one stored unit supplies: heads
    ``heads`` and layers ``layers`` (absolute), found at ``head_offset``
    and ``layer_offset`` inside the unit."""

    unit: UnitSpan
    heads: range
    layers: range

    @property
    def head_offset(self) -> int:
        return self.heads.start - self.unit.head_start

    @property
    def layer_offset(self) -> int:
        return self.layers.start - self.unit.layer_start


def plan_read(want: UnitSpan, stored: Sequence[UnitSpan]) -> list[ReadPiece]:
    """The pieces of stored units that make up ``want`` (heads and layers a
    reader rank needs), each stored byte read at most once.

    Works for any partition of the grid into rectangles: per-head units of
    one pipeline stage, whole blocks, or units of another pipeline
    partition (a reader at PP size 2 assembling its layers from units
    written at PP size 4 reads the frames of two stages' units).

    Raises:
        ConfigError: the stored units do not cover ``want``.
    """
    pieces = []
    covered = 0
    for unit in stored:
        heads = range(max(want.head_start, unit.head_start), min(want.head_stop, unit.head_stop))
        layers = range(max(want.layer_start, unit.layer_start), min(want.layer_stop, unit.layer_stop))
        if heads and layers:
            pieces.append(ReadPiece(unit, heads, layers))
            covered += len(heads) * len(layers)
    if covered != len(want.heads) * len(want.layers):
        raise ConfigError(f"stored units do not cover {want} exactly once", hint="pass a partition of the KV grid")
    return pieces


def readable_at(description: Mapping[str, Any]) -> str:
    """Which deployments read a namespace's blocks, from the description the
    store recorded for it (for ``ucm-db inspect``): a namespace with a TP or
    PP rank holds per-rank blocks written before units, which the connector
    no longer reads (``ucm-db migrate`` drops them: :mod:`ucm_db.maintenance.pre_units`)."""
    tp, pp = int(description.get("tp_size", 1)), int(description.get("pp_size", 1))
    if tp == 1 and pp == 1:
        return "any TP size"
    return f"no TP size (per-rank blocks of TP={tp} PP={pp} from before units: `ucm-db migrate` drops them)"
