"""KV cache layouts: the one module that knows how backends arrange paged KV.

Every supported layout reduces, per layer, to a list of *block-major
segments*: tensors whose first dimension is the vLLM block id, so that
``segment[b]`` is everything that segment holds for block ``b``:

=================  ===========================================  ==========================
layout             per-layer tensor(s)                          segments of one layer
=================  ===========================================  ==========================
``cpu``            ``[num_blocks, kv_heads, block, 2*head]``    ``[t]`` (CPU: K transposed
                   (vLLM 0.32's view of every paged KV cache:   inside, bytes opaque;
                   CPU, CUDA and ROCm backends alike)           CUDA: a token's K then V)
``flash``          ``[2, num_blocks, block, heads, head]``      ``[t[0], t[1]]`` (K, V)
                   (CUDA FlashAttention before vLLM 0.32)
``mla``            ``[num_blocks, block, dim]``                 ``[t]``
``kv_tuple``       ``(k_cache, v_cache)``, each                 ``[k, v]``
                   ``[num_blocks, block, heads, head]``
                   (vllm-ascend)
=================  ===========================================  ==========================

The connector stores a block as *units* of one KV head (:mod:`ucm_db.keys.units`,
``docs/tp.md``): a unit is one frame per layer (layers in registration
order), a layer's frame is that head's slice of each segment for the block,
back to back (``cpu``: the head's ``[block, 2*head]`` slab, contiguous in a
CPU cache, strided in a CUDA one allocated token-major, each token's K and V
side by side; ``flash``/``kv_tuple``: the head's K ``[block, head]`` then
its V, strided). MLA has one unit (its latent; vLLM 0.32: a ``cpu`` view
of one head). The namespace names the view (``engine_facts.kv_view``). Unit staging is
``uint8 [blocks, local heads, unit bytes]``, so the store decodes each unit
straight into its row and the copies into the KV caches are strided views.
Where a head's share of a block is one contiguous slab per layer (``cpu``,
contiguous host tensors, no kernel blocks inside a vLLM block), a load skips
staging: :meth:`KVLayout.unit_slabs` hands the store those slabs as each
unit's scatter list. The worker does so for either codec in ``block``
and ``async`` load modes (``ucm-db bench load`` measures it).
A *whole* block (every local head per frame, the segments' bytes back to back: :meth:`KVLayout.gather`) is what
ucm-db stored before units; the connector no longer reads one (``ucm-db migrate`` splits those written on CPU into
units, drops the rest: :mod:`ucm_db.maintenance.pre_units`). The store only ever sees bytes.

Invariants:
    * Copies use plain torch ops (``index_select``, ``index_copy_``, ``copy_``) on integer views of each segment's
      width (bit-exact, whatever kernels a dtype has: CPU torch has no float8 ``index_copy_``), so the same code moves
      NPU, CUDA and CPU tensors; nothing assumes contiguity of a segment beyond what ``copy_`` handles.
    * Whole blocks are copied, never token slices: some kernels (CPU, AMX)
      permute tokens inside a block.
    * If the kernel block is smaller than vLLM's block (``kernel_ratio`` > 1),
      one vLLM block spans ``kernel_ratio`` consecutive kernel blocks.
    * A unit's bytes are a function of that head's KV only, never of how
      many heads the rank holds: a head unit gathered at any TP size is
      byte-identical (tested for TP 1-8 in ``tests/connector``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Union

import numpy as np
import torch

import ucm_db
from ucm_db.connector import device_saves
from ucm_db.connector.device_saves import SaveCopy
from ucm_db.errors import ConfigError

KVCacheEntry = Union[torch.Tensor, Sequence[torch.Tensor]]
LAYOUT_KINDS = ("cpu", "flash", "mla", "kv_tuple")


@dataclass(frozen=True)
class LayerSegments:
    """One layer's block-major segments and their bytes per block."""

    name: str
    segments: tuple[torch.Tensor, ...]
    segment_bytes: tuple[int, ...]
    #: Axis of the KV heads in ``segment[b]`` (None: MLA, no heads).
    head_axis: int | None = None

    @property
    def block_bytes(self) -> int:
        return sum(self.segment_bytes)

    @property
    def heads(self) -> int:
        return 1 if self.head_axis is None else int(self.segments[0].shape[1 + self.head_axis])


class KVLayout:
    """Block-major view of registered KV caches (see module docstring)."""

    def __init__(self, kind: str, layers: Sequence[LayerSegments]) -> None:
        if not layers:
            raise ConfigError("no KV cache layers were registered", hint="the model has no attention layers ucm-db can store")
        self.kind = kind
        self.layers = tuple(layers)
        self.layer_bytes = tuple(layer.block_bytes for layer in self.layers)
        self.layer_offsets = tuple(int(x) for x in np.cumsum((0,) + self.layer_bytes[:-1]))
        self.block_bytes = sum(self.layer_bytes)
        self.layer_index = {layer.name: i for i, layer in enumerate(self.layers)}
        self.device = self.layers[0].segments[0].device
        heads = {layer.heads for layer in self.layers}
        if len(heads) != 1:
            raise ConfigError(f"KV layers hold different numbers of KV heads {sorted(heads)}", hint="ucm-db stores models with uniform attention layers")
        #: KV heads this rank holds (1 for MLA): the units of one block.
        self.heads = heads.pop()
        self.unit_layer_bytes = tuple(size // self.heads for size in self.layer_bytes)
        self.unit_layer_offsets = tuple(int(x) for x in np.cumsum((0,) + self.unit_layer_bytes[:-1]))
        self.unit_bytes = sum(self.unit_layer_bytes)
        self._layer_bytes_views = _layer_byte_views(self)
        self._save_stream = device_saves.SaveStream(self.device)  # its stream is made at a first save from an accelerator

    def describe(self) -> str:
        """Shapes and dtypes, for logs and error messages."""
        first = self.layers[0]
        shapes = ", ".join(f"{tuple(s.shape)}:{s.dtype}" for s in first.segments)
        return f"{self.kind}: {len(self.layers)} layers x [{shapes}], {self.block_bytes} bytes per block"

    def new_staging(self, num_blocks: int) -> torch.Tensor:
        """A CPU byte buffer holding ``num_blocks`` whole blocks, one per row."""
        return torch.empty((num_blocks, self.block_bytes), dtype=torch.uint8)

    def gather(self, block_ids: Sequence[int], staging: torch.Tensor) -> None:
        """Copies blocks ``block_ids`` out of the KV caches into staging rows."""
        ids = self.index_on_device(block_ids)
        for i in range(len(self.layers)):
            for seg, dst in self._segment_views(i, staging[: len(block_ids)]):
                dst.copy_(seg.index_select(0, ids))

    def scatter(self, block_ids: Sequence[int], staging: torch.Tensor, layer: int | None = None) -> None:
        """Copies staging rows into the KV caches at ``block_ids`` (one layer
        if ``layer`` is given, else all)."""
        ids = self.index_on_device(block_ids)
        layers = range(len(self.layers)) if layer is None else (layer,)
        for i in layers:
            for seg, src in self._segment_views(i, staging[: len(block_ids)]):
                seg.index_copy_(0, ids, src.to(seg.device))

    def frames(self, row: np.ndarray) -> list[memoryview]:
        """A staged block's per-layer frames (views, no copy)."""
        return [memoryview(row[off : off + size]) for off, size in zip(self.layer_offsets, self.layer_bytes)]

    # -- head units (see module docstring) ---------------------------------------
    def new_unit_staging(self, num_blocks: int) -> torch.Tensor:
        """A CPU byte buffer of ``num_blocks`` blocks' units: ``[blocks, heads, unit bytes]``;
        page-locked (pinned) where the KV caches are on an accelerator, so
        the copy to or from them is one DMA transfer. torch's pinned
        allocator rounds a buffer up to a power of two and keeps its pages
        locked once freed (reused for later buffers of that size): callers
        pool what they take. Pageable where pinning fails."""
        shape = (num_blocks, self.heads, self.unit_bytes)
        if self.device.type != "cpu":  # loads stage in bounded chunks (worker/device_loads.py)
            try:
                return torch.empty(shape, dtype=torch.uint8, pin_memory=True)
            except RuntimeError:  # no pinned memory on this platform: a copy through a bounce buffer
                pass
        return torch.empty(shape, dtype=torch.uint8)

    def gather_units(self, block_ids: Sequence[int], staging: torch.Tensor) -> None:
        """Copies the units of blocks ``block_ids`` into unit staging; the
        rows hold them when it returns (:meth:`gather_units_async`, waited for)."""
        self.gather_units_async(block_ids, staging).wait()

    def gather_units_async(self, block_ids: Sequence[int], staging: torch.Tensor) -> SaveCopy:
        """Queues the copy of the units of blocks ``block_ids`` into unit
        staging; the rows hold them once the returned copy's ``wait()``
        returns. Where a unit's layer is one slab (:attr:`writes_units_in_place`):
        one native call for all layers straight into the staging rows, no
        temporary, keeping the GIL (torch's index_select and strided copy
        measured 0.16 GB/s on a loaded 2-core host), done at once. From an
        accelerator into host rows: on the layout's save stream
        (:mod:`ucm_db.connector.device_saves`), not waited for."""
        if self._layer_bytes_views is not None and staging.device.type == "cpu" and staging.is_contiguous():
            _take_slabs(self, block_ids, staging.numpy()[: len(block_ids)])
            return device_saves.done()
        rows = staging[: len(block_ids)]
        if rows.device == self.device or not len(block_ids):
            self.gather_on_device(self.index_on_device(block_ids), rows)
            return device_saves.done()
        return self._save_stream.gather(self, block_ids, rows)

    def gather_on_device(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Queues the copies of blocks ``ids``' units into ``rows``, both on the KV caches' device."""
        for i in range(len(self.layers)):
            for seg, axis, dst in self._unit_views(i, rows):
                src = seg.index_select(0, ids)
                dst.copy_(src.unsqueeze(1) if axis is None else src.movedim(1 + axis, 1))

    def staging_on_device(self, staging: torch.Tensor) -> torch.Tensor:
        """Unit staging rows on the KV caches' device: ``staging`` itself
        there (no copy), else one copy of all its rows (asynchronous from
        pinned memory; ordered before the scatter on the same stream)."""
        if staging.device == self.device:
            return staging
        return staging.to(self.device, non_blocking=staging.is_pinned())

    def scatter_units(self, block_ids: Sequence[int], staging: torch.Tensor, layer: int | None = None) -> None:
        """Copies unit staging into the KV caches at ``block_ids`` (one
        layer if ``layer`` is given, else all). Host rows bound for an
        accelerator go over in one transfer (:meth:`staging_on_device`),
        and the strided copies run there; :meth:`settle` waits for them."""
        ids = self.index_on_device(block_ids)
        rows = self.staging_on_device(staging[: len(block_ids)])
        for i in range(len(self.layers)) if layer is None else (layer,):
            for seg, axis, src in self._unit_views(i, rows):
                seg.index_copy_(0, ids, src[:, 0] if axis is None else src.movedim(1, 1 + axis))

    def settle(self) -> None:
        """Returns once the copies this thread queued on the KV caches'
        device are done (nothing on the host): a load reports its blocks
        only after the bytes are in the KV caches, whichever stream vLLM's
        forward then reads them on, and its pinned rows are free again."""
        if self.device.type != "cpu":
            torch.accelerator.current_stream(self.device).synchronize()

    def mark(self) -> torch.Event | None:
        """An event at the end of what this thread's stream on the KV caches'
        device holds now (None for host KV caches). vLLM queues on a stream
        of its own: a load another thread runs waits for the model thread's
        mark at hand-over (:meth:`after`), so nothing queued before it (block
        zeroing, a preempted request's last forward) lands on the loaded
        bytes. Generic: a generic stream may ignore a backend's own event."""
        if self.device.type == "cpu":
            return None
        event = torch.Event(device=self.device)
        event.record(torch.accelerator.current_stream(self.device))
        return event

    def after(self, event: torch.Event | None) -> None:
        """This thread's later work on the KV caches' device waits for ``event`` (:meth:`mark`)."""
        if event is not None:
            torch.accelerator.current_stream(self.device).wait_event(event)

    @property
    def writes_units_in_place(self) -> bool:
        """Whether a unit can be decoded straight into the KV caches
        (:meth:`unit_slabs`): a ``cpu`` layout of contiguous host tensors,
        one vLLM block per kernel block, where a head's share of a block is
        one contiguous slab per layer."""
        return self._layer_bytes_views is not None

    def unit_slabs(self, block_ids: Sequence[int]) -> ucm_db.ScatterSlabs:
        """For each block of ``block_ids`` and each local head (block-major,
        the order of unit staging rows), the KV caches' slabs of that unit,
        one per layer in unit order: ``Store.get_into``'s buffers, as
        :class:`ucm_db.ScatterSlabs` (no Python object per slab). Only where
        :attr:`writes_units_in_place`."""
        views = self._layer_bytes_views
        if views is None:
            raise ConfigError(f"the {self.kind} layout cannot take units in place", hint="stage units and scatter them instead")
        heads = self.heads
        if heads == 1:
            return ucm_db.ScatterSlabs(views, self.unit_layer_bytes, block_ids)
        return ucm_db.ScatterSlabs(views, self.unit_layer_bytes, [block_id * heads + head for block_id in block_ids for head in range(heads)])

    def unit_frames(self, unit_row: np.ndarray) -> ucm_db.Framed:
        """One staged unit as its per-layer frames, which lie back to back
        in the row (no copy; stored uncompressed, the row is the body)."""
        return ucm_db.Framed(memoryview(unit_row), self.unit_layer_bytes)  # type: ignore[arg-type]

    def _unit_views(self, layer: int, staging: torch.Tensor) -> list[tuple[torch.Tensor, int | None, torch.Tensor]]:
        """(segment, head axis, typed ``[blocks, heads, *slab]`` view of the
        unit staging) triples of one layer."""
        out = []
        offset = self.unit_layer_offsets[layer]
        spec = self.layers[layer]
        for seg, size in zip(spec.segments, spec.segment_bytes):
            slab, seg = size // self.heads, seg.view(_BITS.get(seg.element_size(), seg.dtype))
            shape = list(seg.shape[1:])
            if spec.head_axis is not None:
                del shape[spec.head_axis]
            typed = staging[:, :, offset : offset + slab].view(seg.dtype)
            out.append((seg, spec.head_axis, typed.unflatten(2, tuple(shape))))
            offset += slab
        return out

    def index_on_device(self, block_ids: Sequence[int]) -> torch.Tensor:
        """``block_ids`` as an index tensor on the KV caches' device; to an
        accelerator through pinned memory, queued on the stream (from
        pageable memory the copy would wait for the stream)."""
        ids = torch.as_tensor(list(block_ids), dtype=torch.long)
        if self.device.type == "cpu":
            return ids
        try:
            return ids.pin_memory().to(self.device, non_blocking=True)
        except RuntimeError:  # no pinned memory here: a copy that waits
            return ids.to(self.device)

    def _segment_views(self, layer: int, staging: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(segment, matching typed view of the staging rows) pairs."""
        out = []
        offset = self.layer_offsets[layer]
        spec = self.layers[layer]
        for seg, size in zip(spec.segments, spec.segment_bytes):
            seg = seg.view(_BITS.get(seg.element_size(), seg.dtype))
            typed = staging[:, offset : offset + size].view(seg.dtype)
            out.append((seg, typed.unflatten(1, tuple(seg.shape[1:]))))
            offset += size
        return out


def _take_slabs(layout: KVLayout, block_ids: Sequence[int], rows: np.ndarray) -> None:
    """Unit staging rows ``[blocks, heads, unit bytes]`` filled from the
    layers' slabs (:func:`_layer_byte_views`): head ``h`` of block ``b`` is
    slab ``b * heads + h`` of each layer."""
    heads = layout.heads
    ids = np.asarray(block_ids, dtype=np.int64)
    assert layout._layer_bytes_views is not None
    num_blocks = len(layout._layer_bytes_views[0]) // (heads * layout.unit_layer_bytes[0])
    if ids.size and (ids.min() < 0 or ids.max() >= num_blocks):
        raise IndexError(f"block ids {block_ids} out of range for a KV cache of {num_blocks} blocks")
    at = (ids[:, None] * heads + np.arange(heads)).reshape(-1).tolist()
    flat = rows.view()
    flat.shape = (len(block_ids) * heads, layout.unit_bytes)  # raises rather than copy: writes must reach rows
    # One native call for every layer, keeping the GIL: a call per layer handed the
    # GIL to a busy writer thread up to 8 times per step (ucm_db.codec.native.gather_slabs).
    ucm_db.ScatterSlabs(layout._layer_bytes_views, layout.unit_layer_bytes, at).gather_into(flat)


def _layer_byte_views(layout: KVLayout) -> list[memoryview] | None:
    """Each layer's KV cache as one flat byte view, where units can be
    written in place (see :attr:`KVLayout.writes_units_in_place`); None
    elsewhere. A ``cpu`` cache ``[blocks, heads, block, 2*head]`` is
    block-major then head-major, so head ``h`` of block ``b`` is the slab at
    ``(b * heads + h) * slab`` bytes."""
    if layout.kind != "cpu":
        return None
    views = []
    for spec, slab in zip(layout.layers, layout.unit_layer_bytes):
        if len(spec.segments) != 1 or spec.head_axis != 0:
            return None  # kernel blocks inside a vLLM block: a head's share is not one slab
        seg = spec.segments[0]
        if seg.device.type != "cpu" or not seg.is_contiguous() or seg[0, 0].numel() * seg.element_size() != slab:
            return None
        views.append(memoryview(seg.view(torch.uint8).reshape(-1).numpy()))
    return views


def detect_layout(kv_caches: Mapping[str, KVCacheEntry], num_blocks: int | None = None) -> KVLayout:
    """Builds the :class:`KVLayout` of registered KV caches.

    Args:
        kv_caches: layer name -> tensor, or (k_cache, v_cache) tuple.
        num_blocks: vLLM's block count (resolves ambiguous shapes and the
            kernel block ratio); None to infer from the tensors.

    Raises:
        ConfigError: a layout ucm-db does not know.
    """
    kinds = set()
    layers = []
    for name, entry in kv_caches.items():
        kind, segments = _layer_segments(name, entry, num_blocks)
        kinds.add(kind)
        layers.append(_make_layer(name, segments, num_blocks, _HEAD_AXIS[kind]))
    if len(kinds) > 1:
        raise ConfigError(f"KV caches mix layouts {sorted(kinds)}", hint="ucm-db supports one KV layout per model")
    return KVLayout(kinds.pop() if kinds else "cpu", layers)


def _layer_segments(name: str, entry: KVCacheEntry, num_blocks: int | None) -> tuple[str, list[torch.Tensor]]:
    if isinstance(entry, (tuple, list)):
        if len(entry) != 2 or not all(isinstance(t, torch.Tensor) for t in entry):
            raise ConfigError(f"layer {name}: expected a (k_cache, v_cache) tuple", hint="report this KV layout to ucm-db")
        return "kv_tuple", list(entry)
    if not isinstance(entry, torch.Tensor):
        raise ConfigError(f"layer {name}: KV cache is a {type(entry).__name__}, not a tensor", hint="report this KV layout to ucm-db")
    if entry.dim() == 5 and entry.shape[0] == 2 and (num_blocks is None or entry.shape[0] < num_blocks):
        return "flash", [entry[0], entry[1]]
    if entry.dim() == 3:
        return "mla", [entry]
    if entry.dim() == 4:
        return "cpu", [entry]
    raise ConfigError(f"layer {name}: unknown KV cache shape {tuple(entry.shape)}", hint="report this KV layout to ucm-db")


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # copies' view of each width (others: as is)
#: Axis of the KV heads in one block's slice of a segment, per layout kind.
_HEAD_AXIS: dict[str, int | None] = {"cpu": 0, "flash": 1, "kv_tuple": 1, "mla": None}


def _make_layer(name: str, segments: list[torch.Tensor], num_blocks: int | None, head_axis: int | None) -> LayerSegments:
    fixed = []
    ratio = False
    for seg in segments:
        if num_blocks is not None and seg.shape[0] != num_blocks:
            if seg.shape[0] % num_blocks:
                raise ConfigError(
                    f"layer {name}: {seg.shape[0]} kernel blocks is not a multiple of {num_blocks} vLLM blocks",
                    hint="report this KV layout to ucm-db",
                )
            seg = seg.unflatten(0, (num_blocks, seg.shape[0] // num_blocks))
            ratio = True
        fixed.append(seg)
    sizes = tuple(int(s[0].numel()) * s.element_size() for s in fixed)
    # Kernel blocks inside a vLLM block add one leading axis before the heads.
    axis = None if head_axis is None else head_axis + int(ratio)
    return LayerSegments(name, tuple(fixed), sizes, axis)
