"""Loads into KV caches on an accelerator, in bounded chunks of pinned staging.

A staged load reads units from the store into page-locked host rows, moves
them to the device in one transfer a chunk, and scatters them there
(:meth:`~ucm_db.connector.layouts.KVLayout.scatter_units`). Done in chunks,
the read of a chunk overlaps the transfer of the one before, and neither
memory grows with the load: torch's pinned allocator rounds each request up
to a power of two and never gives pages back, and vLLM's memory profile
budgets no device staging.

Invariants:
    * A load holds one :class:`_Slots` pair of buffers: two page-locked host
      buffers and two device buffers of :attr:`DeviceLoads.chunk_blocks`
      blocks (at most :data:`CHUNK_BYTES`, at least one block). Pairs are
      made once and reused; there is one for each thread loading at the
      same time (the model's, the layer loader's, the async loader's).
    * A host buffer is refilled only once the transfer out of it is done
      (its event), and a device buffer only once the scatter out of it is:
      both queue on this thread's stream, in order.
    * The load's writes into the KV caches queue after ``after`` (an event
      the model's thread recorded when it handed the load over,
      :meth:`~ucm_db.connector.layouts.KVLayout.mark`), so nothing vLLM
      queued before it (block zeroing, copy-on-write, a preempted request's
      last forward) lands on top of them; :meth:`DeviceLoads.load` returns
      once they are done.
    * Only blocks with every unit read are written to the KV caches. A load
      that raises waits for what it queued before it lets go of its slots.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ucm_db.connector.layouts import KVLayout

#: Most bytes of units one chunk stages (host and device alike).
CHUNK_BYTES = 128 << 20
#: Reads ``keys`` into ``rows`` (unit ``i`` at ``i * unit_bytes``); a flag per key.
ReadFn = Callable[[Sequence[bytes], memoryview], list[bool]]


@dataclass(eq=False)
class _Slots:
    """Two chunks of staging, host and device, and each host chunk's last transfer."""

    host: tuple[torch.Tensor, torch.Tensor]
    device: tuple[torch.Tensor, torch.Tensor]
    sent: list[torch.Event | None] = field(default_factory=lambda: [None, None])


class DeviceLoads:
    """The chunked loads of one KV layout on an accelerator (module invariants)."""

    def __init__(self, layout: KVLayout) -> None:
        self._layout = layout
        self.chunk_blocks = max(1, CHUNK_BYTES // (layout.heads * layout.unit_bytes))
        self._free: list[_Slots] = []
        self._lock = threading.Lock()

    def load(self, read: ReadFn, unit_keys: Sequence[bytes], block_ids: Sequence[int],
             after: torch.Event | None) -> tuple[list[int], set[int]]:
        """Reads the units of ``block_ids`` (``unit_keys``: block-major, the
        layout's heads each) into the KV caches: (blocks loaded, blocks failed)."""
        layout, heads = self._layout, self._layout.heads
        slots = self._take()
        try:
            layout.after(after)
            loaded: list[int] = []
            failed: set[int] = set()
            for chunk, at in enumerate(range(0, len(block_ids), self.chunk_blocks)):
                ids = list(block_ids[at:at + self.chunk_blocks])
                slot = chunk % 2
                sent = slots.sent[slot]
                if sent is not None:
                    sent.synchronize()  # the host rows' last transfer is out
                host = slots.host[slot][:len(ids)]
                ok = read(unit_keys[at * heads:(at + len(ids)) * heads], memoryview(host.numpy().reshape(-1)))
                good = [i for i in range(len(ids)) if all(ok[i * heads:(i + 1) * heads])]
                failed.update(set(ids) - {ids[i] for i in good})
                rows = slots.device[slot][:len(ids)]
                rows.copy_(host, non_blocking=host.is_pinned())
                if good:
                    if len(good) != len(ids):
                        rows = rows.index_select(0, layout.index_on_device(good))
                    layout.scatter_units([ids[i] for i in good], rows)
                    loaded += [ids[i] for i in good]
                slots.sent[slot] = layout.mark()
            layout.settle()
            return loaded, failed
        except BaseException:
            _settle_quietly(layout)  # no transfer out of the slots, nor write into the KV caches, outlives the call
            raise
        finally:
            self._give(slots)

    def _take(self) -> _Slots:
        with self._lock:
            if self._free:
                return self._free.pop()
        layout = self._layout
        host = (layout.new_unit_staging(self.chunk_blocks), layout.new_unit_staging(self.chunk_blocks))
        shape = (self.chunk_blocks, layout.heads, layout.unit_bytes)
        device = (torch.empty(shape, dtype=torch.uint8, device=layout.device),
                  torch.empty(shape, dtype=torch.uint8, device=layout.device))
        return _Slots(host, device)

    def _give(self, slots: _Slots) -> None:
        with self._lock:
            self._free.append(slots)


def _settle_quietly(layout: KVLayout) -> None:
    """:meth:`KVLayout.settle` on a failed load's way out (its own error, if
    any, is the device's: the load's error is the one reported)."""
    try:
        layout.settle()
    except Exception:  # noqa: BLE001 - see the docstring
        pass
