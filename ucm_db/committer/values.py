"""The value types of :mod:`ucm_db.committer`: a buffer both processes map,
a chain's units named in one, and a put's answer."""

from __future__ import annotations

import ctypes
import mmap
from dataclasses import dataclass

from ucm_db.keys import BlockKeys


class SharedBuffer:
    """``nbytes`` of memory the caller and its commit process both map.

    :attr:`memory` is a writable buffer (``torch.frombuffer`` and
    ``numpy.frombuffer`` take it); :attr:`address` is where it starts in
    the caller, to find which buffer a view lies in."""

    def __init__(self, buffer_id: int, memory: mmap.mmap, nbytes: int) -> None:
        self.id = buffer_id
        self.memory = memory
        self.nbytes = nbytes
        anchor = ctypes.c_char.from_buffer(memory)
        self.address = ctypes.addressof(anchor)
        del anchor  # an export would keep the mapping from ever closing


@dataclass(frozen=True)
class SharedChain:
    """One chain segment's payloads in a shared buffer: unit ``i`` of
    ``keys`` is ``unit_bytes`` at ``offset + i * stride_bytes`` of buffer
    ``buffer_id``."""

    keys: BlockKeys
    buffer_id: int
    offset: int
    stride_bytes: int
    unit_bytes: int


@dataclass(frozen=True)
class Committed:
    """A put the child committed: its (wall, CPU) seconds there, and the
    keys it stored (``PutResult.stored_keys``: not those stored already)."""

    wall_s: float
    cpu_s: float
    stored_keys: list[bytes]
