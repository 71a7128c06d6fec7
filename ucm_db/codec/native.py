"""The codec's byte-plane shuffle and checked copy: compiled (``ucm_db._native``) or numpy.

The extension is optional: built from ``ucm_db/_native.c`` at install time
when a C compiler and the Python headers are there, otherwise the numpy
fallbacks below are used. :data:`NATIVE_AVAILABLE` says which. The C pays
for itself: about 4x the fallback's GB/s on 2-byte elements (see
``_native.c``). Key derivation is not here: see :mod:`ucm_db.keys.chain`.

Invariants:
    * Each public function gives byte-identical results either way
      (tests/test_native.py compares them), and raises the same exception
      classes: ``ValueError`` for wrong lengths, ``TypeError`` for a
      read-only ``out``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Protocol, Union

import numpy as np
from ucm_db.buffers import Buffer


def _load_extension() -> ModuleType | None:
    try:
        return importlib.import_module("ucm_db._native")
    except ImportError:  # not built: no compiler or headers at install time
        return None


_native = _load_extension()

#: True when the compiled extension is in use.
NATIVE_AVAILABLE: bool = _native is not None


def extension() -> ModuleType | None:
    """The compiled extension itself (None if it is not built), for the
    native-only paths that have no numpy fallback (:mod:`ucm_db.codec.batch_loads`)."""
    return _native


def split_planes_py(src: Buffer, element_bytes: int) -> list[bytearray]:
    """numpy :func:`split_planes` (the same passes as ``codec_encode._shuffle``)."""
    _check_element_bytes(element_bytes)
    nbytes = memoryview(src).nbytes
    if nbytes % element_bytes:
        raise ValueError(f"src holds {nbytes} bytes, not a multiple of element_bytes {element_bytes}")
    words = np.frombuffer(src, dtype="<u2" if element_bytes == 2 else "<u4")
    planes = [bytearray(len(words)) for _ in range(element_bytes)]
    for i, plane in enumerate(planes):
        np.right_shift(words, 8 * i, out=np.frombuffer(plane, dtype=np.uint8), casting="unsafe")
    return planes


def merge_planes_py(planes: Sequence[Buffer], out: Buffer, element_bytes: int) -> None:
    """numpy :func:`merge_planes` (the same passes as ``codec_decode._unshuffle``)."""
    _check_element_bytes(element_bytes)
    if len(planes) != element_bytes:
        raise ValueError(f"got {len(planes)} planes for element_bytes {element_bytes}")
    views = [memoryview(p).cast("B") for p in planes]
    if any(len(v) != len(views[0]) for v in views):
        raise ValueError(f"planes differ in length: {[len(v) for v in views]}")
    target = memoryview(out)
    if target.readonly or not target.c_contiguous:
        raise TypeError(f"out must be a writable contiguous buffer, not a read-only or strided {type(out).__name__}")
    if target.nbytes != len(views[0]) * element_bytes:
        raise ValueError(f"out holds {target.nbytes} bytes where {element_bytes} planes of {len(views[0])} need {len(views[0]) * element_bytes}")
    dtype = np.dtype("<u2" if element_bytes == 2 else "<u4")
    words = np.frombuffer(target.cast("B"), dtype=dtype)
    if any(np.may_share_memory(words, np.frombuffer(v, dtype=np.uint8)) for v in views):
        raise ValueError("out overlaps a plane")
    top = element_bytes - 1
    np.left_shift(np.frombuffer(views[top], dtype=np.uint8), 8 * top, out=words, dtype=dtype, casting="unsafe")
    for i in range(1, top):
        words |= np.left_shift(np.frombuffer(views[i], dtype=np.uint8), 8 * i, dtype=dtype)
    np.bitwise_or(words, np.frombuffer(views[0], dtype=np.uint8), out=words, casting="unsafe")


def merge_planes_into_py(planes: Sequence[Buffer], outs: Buffer | Sequence[Buffer], element_bytes: int, skip_bytes: int) -> int:
    """numpy :func:`merge_planes_into`: the merged elements into ``outs`` (a
    buffer, or a list or tuple filled one after another) from ``skip_bytes``
    on; every out they cross ends between two elements. Returns the bytes written."""
    _check_element_bytes(element_bytes)
    if len(planes) != element_bytes:
        raise ValueError(f"got {len(planes)} planes for element_bytes {element_bytes}")
    nbytes = memoryview(planes[0]).nbytes * element_bytes
    merged = bytearray(nbytes)
    merge_planes_py(planes, merged, element_bytes)
    targets = [memoryview(o) for o in (outs if isinstance(outs, (list, tuple)) else (outs,))]
    for target in targets:
        if target.readonly or not target.c_contiguous:
            raise TypeError(f"out must be a writable contiguous buffer, not a read-only or strided {type(target.obj).__name__}")
    if skip_bytes < 0 or skip_bytes % element_bytes:
        raise ValueError(f"skip_bytes {skip_bytes} is not a whole number of {element_bytes}-byte elements")
    flats = [target.cast("B") for target in targets]
    at, end, pieces = 0, skip_bytes + nbytes, []  # at: where flats[i] starts
    for i, flat in enumerate(flats):
        if at >= end:
            break
        stop = at + len(flat)
        if skip_bytes < stop < end and stop % element_bytes:
            raise ValueError(f"out {i} ends inside an element ({len(flat)} bytes, element_bytes {element_bytes})")
        if stop > skip_bytes:
            pieces.append(flat[max(skip_bytes - at, 0) :])
        at = stop
    if at < end:
        raise ValueError(f"outs hold {at} bytes, fewer than skip_bytes {skip_bytes} plus the {nbytes} merged")
    copy_into_py(merged, pieces, None, 0)
    return nbytes


def merge_planes_into_slabs_py(
    planes: Sequence[Buffer], views: tuple[Buffer, ...], slab_bytes: tuple[int, ...], index: int, element_bytes: int, skip_bytes: int,
) -> int:
    """numpy :func:`merge_planes_into_slabs`: :func:`merge_planes_into_py`
    with the outs ``views[j][index * slab_bytes[j] : (index + 1) * slab_bytes[j]]``."""
    return merge_planes_into_py(planes, _slabs_of(views, slab_bytes, index), element_bytes, skip_bytes)


def _slabs_of(views: tuple[Buffer, ...], slab_bytes: tuple[int, ...], index: int) -> list[memoryview]:
    """Slab ``index`` of each view (a ValueError for any outside its view)."""
    if not views or len(views) != len(slab_bytes) or index < 0:
        raise ValueError(f"got {len(views)} views, {len(slab_bytes)} slab sizes and slab index {index}")
    outs = []
    for j, (view, size) in enumerate(zip(views, slab_bytes)):
        flat = memoryview(view)
        if size <= 0 or (index + 1) * size > flat.nbytes:
            raise ValueError(f"slab {index} of {size} bytes lies outside view {j} of {flat.nbytes} bytes")
        outs.append(flat[index * size : (index + 1) * size])
    return outs


class Hasher(Protocol):
    """A streaming checksum (``xxhash.xxh3_64`` and the like)."""

    def update(self, data: Buffer, /) -> object: ...


def copy_into_py(src: Buffer, outs: Buffer | Sequence[Buffer], hasher: Hasher | None, chunk_bytes: int) -> int:
    """Python :func:`copy_into`: ``src`` into ``outs`` (a buffer, or a list
    or tuple filled one after another, up to the end of ``src``), each chunk
    hashed just before its copy when ``hasher`` is given; returns ``len(src)``."""
    source = memoryview(src).cast("B")
    targets = [memoryview(o) for o in (outs if isinstance(outs, (list, tuple)) else (outs,))]
    for target in targets:
        if target.readonly or not target.c_contiguous:
            raise TypeError(f"out must be a writable contiguous buffer, not a read-only or strided {type(target.obj).__name__}")
    if sum(t.nbytes for t in targets) < len(source):
        raise ValueError(f"outs hold {sum(t.nbytes for t in targets)} bytes, fewer than the {len(source)} of src")
    step = chunk_bytes if chunk_bytes > 0 else max(len(source), 1)
    flats = [target.cast("B") for target in targets]
    at, i, filled = 0, 0, 0  # filled: bytes of flats[i] written
    while at < len(source):
        stop = min(len(source), at + step)
        if hasher is not None:
            hasher.update(source[at:stop])  # one chunk, however many outs it spans
        while at < stop:
            while filled == len(flats[i]):
                i, filled = i + 1, 0
            n = min(len(flats[i]) - filled, stop - at)
            flats[i][filled : filled + n] = source[at : at + n]
            filled, at = filled + n, at + n
    return len(source)


def copy_into_slabs_py(
    src: Buffer, views: tuple[Buffer, ...], slab_bytes: tuple[int, ...], index: int, hasher: Hasher | None, chunk_bytes: int,
) -> int:
    """Python :func:`copy_into_slabs`: :func:`copy_into_py` with the outs
    ``views[j][index * slab_bytes[j] : (index + 1) * slab_bytes[j]]``."""
    return copy_into_py(src, _slabs_of(views, slab_bytes, index), hasher, chunk_bytes)


def gather_slabs_py(views: tuple[Buffer, ...], slab_bytes: tuple[int, ...], indices: Sequence[int], out: Buffer) -> int:
    """numpy :func:`gather_slabs`: row ``r`` of ``out`` (rows of
    ``sum(slab_bytes)`` bytes) is slab ``indices[r]`` of each view, in order."""
    if not views or len(views) != len(slab_bytes):
        raise ValueError(f"got {len(views)} views and {len(slab_bytes)} slab sizes (as many sizes as views)")
    flats = [np.frombuffer(view, dtype=np.uint8) for view in views]
    if min(slab_bytes) <= 0:
        raise ValueError(f"slab sizes must be positive, got {slab_bytes}")
    target = memoryview(out)
    if target.readonly or not target.c_contiguous:
        raise TypeError("out must be a writable contiguous buffer")
    rows_out = np.frombuffer(target.cast("B"), dtype=np.uint8)
    for j, flat in enumerate(flats):
        if np.shares_memory(rows_out, flat):
            raise ValueError(f"out overlaps view {j}")
    at = np.asarray(list(indices), dtype=np.int64)
    slabs = min(flat.size // size for flat, size in zip(flats, slab_bytes))
    row_bytes = sum(slab_bytes)
    if at.size * row_bytes > rows_out.size:
        raise ValueError(f"out holds {rows_out.size} bytes, fewer than {at.size} rows of {row_bytes}")
    if at.size and (at.min() < 0 or at.max() >= slabs):
        raise ValueError(f"slab index {int(at.min() if at.min() < 0 else at.max())} outside the views' {slabs} slabs")
    rows = rows_out[: at.size * row_bytes].reshape(at.size, row_bytes)
    offset = 0
    for flat, size in zip(flats, slab_bytes):
        np.take(flat[: slabs * size].reshape(slabs, size), at, axis=0, out=rows[:, offset : offset + size], mode="clip")
        offset += size
    return int(at.size * row_bytes)


def _check_element_bytes(element_bytes: int) -> None:
    if element_bytes not in (2, 4):
        raise ValueError(f"element_bytes must be 2 or 4, got {element_bytes}")


#: ``split_planes(src, element_bytes)``: plane ``i`` holds byte ``i`` (least
#: significant first) of each little-endian element; sizes 2 and 4.
split_planes: Callable[[Buffer, int], list[bytearray]]
#: ``merge_planes(planes, out, element_bytes)``: the inverse, written into ``out``.
merge_planes: Callable[[Sequence[Buffer], Buffer, int], None]
#: ``merge_planes_into(planes, outs, element_bytes, skip_bytes)``: the
#: inverse of :func:`split_planes` written into a buffer or a scatter list,
#: ``skip_bytes`` into it (a decoded frame straight to its place among a
#: block's slabs); every out it crosses ends between two elements.
merge_planes_into: Callable[[Sequence[Buffer], Union[Buffer, Sequence[Buffer]], int, int], int]
#: ``merge_planes_into_slabs(planes, views, slab_bytes, index, element_bytes, skip_bytes)``:
#: :func:`merge_planes_into` whose outs are slab ``index`` of each view.
merge_planes_into_slabs: Callable[[Sequence[Buffer], tuple[Buffer, ...], tuple[int, ...], int, int, int], int]
#: ``copy_into(src, outs, hasher, chunk_bytes)``: ``src`` copied into a buffer
#: or a scatter list; with a hasher, each piece of at most ``chunk_bytes``
#: (0: all) is hashed right before its copy, while it is in cache (a checksum
#: verified as the bytes are copied reads them from memory once).
copy_into: Callable[[Buffer, Union[Buffer, Sequence[Buffer]], Union[Hasher, None], int], int]
#: ``copy_into_slabs(src, views, slab_bytes, index, hasher, chunk_bytes)``:
#: :func:`copy_into` whose outs are slab ``index`` of each view (tuples), so a
#: scatter list over many large buffers needs no Python object per slab.
copy_into_slabs: Callable[[Buffer, tuple[Buffer, ...], tuple[int, ...], int, Union[Hasher, None], int], int]
#: ``gather_slabs(views, slab_bytes, indices, out)``: the inverse of
#: :func:`copy_into_slabs` for many blocks: row ``r`` of ``out`` (rows of
#: ``sum(slab_bytes)`` bytes) is slab ``indices[r]`` of each view, in order;
#: checked whole before a byte moves, and the compiled one keeps the GIL for
#: up to 32 MiB (one call per save step on the model's thread, no hand-off).
gather_slabs: Callable[[tuple[Buffer, ...], tuple[int, ...], Sequence[int], Buffer], int]

if _native is not None:
    split_planes = _native.split_planes
    merge_planes = _native.merge_planes
    merge_planes_into = _native.merge_planes_into
    merge_planes_into_slabs = _native.merge_planes_into_slabs
    copy_into = _native.copy_into
    copy_into_slabs = _native.copy_into_slabs
    gather_slabs = _native.gather_slabs
else:
    split_planes = split_planes_py
    merge_planes = merge_planes_py
    merge_planes_into = merge_planes_into_py
    merge_planes_into_slabs = merge_planes_into_slabs_py
    copy_into = copy_into_py
    copy_into_slabs = copy_into_slabs_py
    gather_slabs = gather_slabs_py
