"""Reusable staging buffers for saves.

A save copies its units out of the KV cache into a staging buffer from the
model's thread (``wait_for_save``; beside an accelerator the copy is only
queued there, on a save stream: :mod:`ucm_db.connector.device_saves`); the
background writer commits it.
A fresh buffer per save costs a page fault and a zeroed page per 4 KiB on
the model's thread (about as much as the copy itself on a 2-core host) and
the kernel's page allocation competes with the writer's commit; a pooled
buffer was touched before, so the copy runs at memory speed.

Invariants:
    * A buffer belongs to one :class:`Lease` at a time; it returns to the
      pool only through :meth:`Lease.release`, which the owner calls once
      nothing on the host reads it any more (the writer after its commit or
      failure: the store copies payloads inside ``put``, so no view outlives
      it). A save dropped before its queued device copy is done gives its
      buffer back with that copy still to land: the next lease's copy
      follows it on the same save stream, so it lands first.
    * Buffers hold a power-of-two number of blocks' rows, so saves of
      different sizes reuse them; a lease is a view of its first rows (so
      leased buffers hold at most twice the bytes of their saves); the
      writer's queue bound counts the whole buffers (:attr:`Lease.held_bytes`).
    * At most ``max_free_bytes`` of buffers wait in the pool; a buffer
      released beyond that is freed (a pinned one, beside an accelerator,
      goes back to torch's pinned cache, which keeps its pages locked for a
      later buffer of its power-of-two size: the pinned memory held is the
      most the writer's queue and this pool ever held at once, by size).
    * Thread-safe: leases are taken on the model's thread and released on
      the writer's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass(eq=False)
class Lease:
    """One save's staging rows ``[blocks, heads, unit_bytes]`` (a view of
    a pooled buffer) until :meth:`release`."""

    staging: torch.Tensor
    _buffer: torch.Tensor = field(repr=False)
    _pool: StagingPool | None = field(repr=False)

    @property
    def held_bytes(self) -> int:
        """Bytes of the whole pooled buffer this lease holds (a power of
        two of blocks' rows: up to twice its rows' bytes)."""
        return int(self._buffer.numel() * self._buffer.element_size())

    def release(self) -> None:
        """Gives the buffer back (idempotent); the rows must not be read after."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool._give(self._buffer)


class StagingPool:
    """Unit staging buffers of one KV layout, reused across saves;
    ``new_staging(num_blocks)`` allocates one (the layout's
    ``new_unit_staging``)."""

    def __init__(self, new_staging: Callable[[int], torch.Tensor], max_free_bytes: int) -> None:
        self._new_staging = new_staging
        self._max_free_bytes = max_free_bytes
        self._free: dict[int, list[torch.Tensor]] = {}
        self._free_bytes = 0
        self._lock = threading.Lock()

    @property
    def free_bytes(self) -> int:
        """Bytes of buffers waiting in the pool."""
        return self._free_bytes

    def take(self, num_blocks: int) -> Lease:
        """Staging rows for ``num_blocks`` blocks (contents undefined)."""
        rows = 1 << max(0, num_blocks - 1).bit_length()
        with self._lock:
            free = self._free.get(rows)
            buffer = free.pop() if free else None
            if buffer is not None:
                self._free_bytes -= buffer.numel()
        if buffer is None:
            buffer = self._new_staging(rows)
        return Lease(buffer[:num_blocks], buffer, self)

    def _give(self, buffer: torch.Tensor) -> None:
        with self._lock:
            if self._free_bytes + buffer.numel() > self._max_free_bytes:
                return
            self._free.setdefault(int(buffer.shape[0]), []).append(buffer)
            self._free_bytes += buffer.numel()
