"""Scatter lists of many blocks over a few large buffers, without an object per slab.

:class:`ScatterSlabs` stands in for ``get_into``'s list of scatter lists
where every block's list is "slab ``indices[i]`` of each of a few large
buffers" (a KV cache's layers: a connector unit is one slab per layer).
``Store.get_into`` copies a raw block into such slabs in one native call
(:func:`ucm_db.codec.native.copy_into_slabs`) instead of building one memoryview
per slab and a list per block: about ten Python objects per block fewer,
each of which also kept the garbage collector busy while a load ran.

Invariants:
    * ``slabs[i]`` is the scatter list ``[views[j][indices[i] * slab_bytes[j]
      : (indices[i] + 1) * slab_bytes[j]] for j ...]``: a block read into
      ``slabs`` gets the bytes it would get read into ``list(slabs)``.
    * A block read into slabs fills its slabs exactly (``sum(slab_bytes)``
      raw bytes): a sound block of another size is a miss (logged), one
      whose header is damaged a corrupt miss, and no slab keeps a tail of
      what it held before (a plain list of buffers needs only room).
    * Everything ``get_into`` checks of a scatter list is checked here, once,
      at construction: writable C-contiguous views, positive integer slab
      sizes no larger than their views, integer indices inside every view.
      A bad one raises :class:`~ucm_db.errors.ConfigError`.
    * :meth:`ScatterSlabs.gather_into` is the inverse: row ``i`` of its out is
      ``b"".join(slabs[i])``, checked whole before a byte moves.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any, overload

from ucm_db.codec import native
from ucm_db.errors import ConfigError


_WANTED = {"views": "one writable buffer per cache", "slab_bytes": "one int per view", "indices": "one slab index per block"}


class ScatterSlabs(Sequence[list[memoryview]]):
    """Block ``i``'s scatter list is slab ``indices[i]`` of each of ``views``
    (module invariants); pass it to ``Store.get_into`` as ``buffers``."""

    __slots__ = ("views", "slab_bytes", "indices")

    def __init__(self, views: Sequence[Any], slab_bytes: Sequence[int], indices: Sequence[int]) -> None:
        for name, value in (("views", views), ("slab_bytes", slab_bytes), ("indices", indices)):
            if isinstance(value, (str, bytes, bytearray, memoryview)) or not hasattr(value, "__len__") or not hasattr(value, "__iter__"):
                raise ConfigError(f"ScatterSlabs' {name} must be a sequence, got {type(value).__name__}",
                                  hint=f"pass {name} as a list: {_WANTED[name]}")
        if not views or len(views) != len(slab_bytes):
            raise ConfigError(f"got {len(views)} views and {len(slab_bytes)} slab sizes", hint="pass one positive slab size per view")
        flats = []
        for view in views:
            try:
                flat = memoryview(view)
            except TypeError as exc:
                raise ConfigError(f"a slab view must be a buffer, got {type(view).__name__}", hint="pass memoryviews of the caches") from exc
            if flat.readonly or not flat.c_contiguous:
                raise ConfigError("slab views must be writable and C-contiguous", hint="pass writable contiguous buffers")
            flats.append(flat.cast("B") if flat.format != "B" or flat.ndim != 1 else flat)
        sizes = tuple(_integers("slab_bytes", slab_bytes))
        if min(sizes) <= 0:
            raise ConfigError(f"slab sizes must be positive, got {sizes}", hint="pass each view's slab size in bytes")
        # A slab larger than its view holds no slab at all; with no indices
        # nothing else refused it, and sizes summing past 2**63 wrapped the
        # native gather's row size to 0 (a SIGFPE).
        over = [j for j, (f, size) in enumerate(zip(flats, sizes)) if size > f.nbytes]
        if over:
            j = over[0]
            raise ConfigError(f"slab size {sizes[j]} of view {j} is larger than the view's {flats[j].nbytes} bytes",
                              hint="pass each view's slab size in bytes, at most the view's size")
        slabs = tuple(f.nbytes // size for f, size in zip(flats, sizes))
        at = _integers("indices", indices)
        if at and (min(at) < 0 or max(at) >= min(slabs)):
            raise ConfigError(f"slab indices {min(at)}..{max(at)} outside the views' {min(slabs)} slabs",
                              hint="index slabs from 0 below the smallest view's slab count")
        self.views: tuple[memoryview, ...] = tuple(flats)
        self.slab_bytes: tuple[int, ...] = sizes
        self.indices: list[int] = at

    def __len__(self) -> int:
        return len(self.indices)

    @overload
    def __getitem__(self, i: int) -> list[memoryview]: ...

    @overload
    def __getitem__(self, i: slice) -> list[list[memoryview]]: ...

    def __getitem__(self, i: int | slice) -> list[memoryview] | list[list[memoryview]]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        at = self.indices[i]
        return [view[at * size : (at + 1) * size] for view, size in zip(self.views, self.slab_bytes)]

    @property
    def row_bytes(self) -> int:
        """Bytes of one block's scatter list (its slabs summed)."""
        return sum(self.slab_bytes)

    def gather_into(self, out: Any) -> int:
        """Copies every block's slabs, in order, into ``out``: row ``i``
        (``row_bytes`` long) is ``b"".join(self[i])``. The inverse of
        reading into these slabs, for saving what they hold; one native
        call that keeps the GIL for a save step's few MiB
        (:func:`ucm_db.codec.native.gather_slabs`). Returns the bytes written.

        Raises:
            ConfigError: ``out`` is read-only, not contiguous, smaller than
                ``len(self) * row_bytes`` or overlaps a view (nothing written).
        """
        try:
            return native.gather_slabs(self.views, self.slab_bytes, self.indices, out)
        except (TypeError, ValueError, BufferError) as exc:
            raise ConfigError(f"cannot gather {len(self)} slab rows into out: {exc}",
                              hint=f"pass a writable contiguous buffer of at least {len(self) * self.row_bytes} bytes apart from the views") from exc


def _integers(name: str, values: Sequence[Any]) -> list[int]:
    """``values`` as ints (numpy and other integer types too), or a
    :class:`ConfigError` naming ``name``: a str or float index failed in a
    comparison, a str size was taken as its number."""
    try:
        return list(map(operator.index, values))
    except TypeError:
        kinds = sorted({type(value).__name__ for value in values})
        raise ConfigError(f"ScatterSlabs' {name} must be integers, got {', '.join(kinds)}",
                          hint=f"pass {name} as a list of ints") from None
