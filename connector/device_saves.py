"""Saves out of KV caches on an accelerator, on a stream of their own.

A save copies the units of newly computed blocks out of the paged KV caches
into host staging rows. On an accelerator the strided copies run there,
into two device chunks of at most :data:`GATHER_CHUNK_BYTES` used in turn,
each coming back to page-locked rows in one transfer. All of it is queued
on a stream of the save's own (one per KV layout), and the writer's thread,
not the model's, waits for the transfers (:meth:`SaveCopy.wait`). Measured
on an H200 (``ucm-db bench device-load``, a 512 MiB save behind an 11 ms
forward still running): the model thread's time in the save fell from 23 ms
to 9-14 ms, a step of forward, save and next forward from 35.0 to 32.3 ms.
What the model thread still spends there was not broken down (queueing
two kernels per layer, segment and chunk, 512 for that save, is one part),
so a save that costs it nothing is not promised.

Invariants:
    * The save stream first waits for an event at the end of what the
      model's stream holds when the save is queued: the gathers read the
      blocks only once the forward that wrote them is done.
    * The model's stream then waits (on the device; its thread does not)
      for an event after the last gather: nothing queued later there (the
      next step's forward writing a block freed and handed to another
      request, block zeroing, a load's scatter handed over behind the
      model's :meth:`~ucm_db.connector.layouts.KVLayout.mark`) lands on a
      block before it is read. The gathers of a save of more than two
      chunks wait for the transfers two chunks back, so that event may
      follow most of the save's transfers, never its last two.
    * The staging rows hold the units once :meth:`SaveCopy.wait` returns
      (the writer's thread calls it before it reads them, polling the
      event: a wait on it would spin a core); a copy that failed on the
      device raises there (``RuntimeError``) and that save is lost (on CUDA
      such a fault is sticky: later device work fails too).
    * Each save stream keeps its two device chunks (at most
      :data:`GATHER_CHUNK_BYTES` each, made at its first save): neither the
      chunks nor vLLM's stream's memory move between the streams' pools. A
      chunk is refilled only once the transfer out of it is done, and a
      staging row given back before its copy is done (a dropped save) is
      refilled by a later save's transfer only: both follow on the one save
      stream, in order. Torch's pinned allocator keeps a row freed with a
      transfer still queued for after it.
    * A row that is not page-locked (``save_process``'s shared staging, or
      no pinned memory on the host) is copied as before, on the model's
      stream, and waited for at once: a transfer into pageable memory
      waits for the stream whatever asks it not to.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol

import torch

#: Most bytes of device staging one save's gather holds (two of them in turn).
GATHER_CHUNK_BYTES = 128 << 20
#: How often a writer waiting for a copy looks at its event.
POLL_S = 0.0005


class Gathers(Protocol):
    """What a save stream uses of a KV layout (:class:`~ucm_db.connector.layouts.KVLayout`)."""

    def index_on_device(self, block_ids: Sequence[int]) -> torch.Tensor: ...

    def gather_on_device(self, ids: torch.Tensor, rows: torch.Tensor) -> None: ...


class SaveCopy:
    """One save's copy out of the KV caches; :meth:`wait` returns once
    its staging rows hold the units (at once where it was synchronous)."""

    def __init__(self, event: torch.Event | None = None) -> None:
        self._event = event

    def wait(self) -> None:
        """Blocks until the copy is done.

        Raises:
            RuntimeError: the copy failed on the device.
        """
        event, self._event = self._event, None
        while event is not None and not event.query():
            time.sleep(POLL_S)


def done() -> SaveCopy:
    """A copy that was done when it was made."""
    return SaveCopy()


class SaveStream:
    """The save stream of one KV layout's device (module invariants)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream: torch.Stream | None = None
        self._chunks_kept: list[torch.Tensor] = []

    def gather(self, layout: Gathers, block_ids: Sequence[int], rows: torch.Tensor) -> SaveCopy:
        """Queues the copy of blocks ``block_ids``' units into host ``rows``
        (page-locked: see the module invariants for others) through device
        chunks, each filled by ``layout.gather_on_device`` on the current
        stream. Returns the copy to wait for."""
        step = max(1, GATHER_CHUNK_BYTES // max(1, rows[0].numel()))
        shape = (min(step, len(block_ids)), *rows.shape[1:])
        pinned = rows.is_pinned()
        model = torch.accelerator.current_stream(self.device)
        if not pinned:
            self._chunks(layout, layout.index_on_device(block_ids), rows, step, shape, None)
            model.synchronize()
            return done()
        forward_done = torch.Event(device=self.device)
        forward_done.record(model)
        gathered: list[torch.Event] = []
        with self._on_save_stream() as stream:
            try:
                ids = layout.index_on_device(block_ids)  # through pinned memory, queued here: nothing waits
                stream.wait_event(forward_done)
                self._chunks(layout, ids, rows, step, shape, gathered, self._kept(step, shape))
            finally:
                if not gathered:  # failed part-way: the model's stream waits for all that was queued
                    gathered.append(torch.Event(device=self.device))
                    gathered[0].record(stream)
                model.wait_event(gathered[0])
            copied = torch.Event(device=self.device)
            copied.record(stream)
        return SaveCopy(copied)

    def _kept(self, step: int, shape: tuple[int, ...]) -> list[torch.Tensor]:
        """The save stream's two chunks (made on it, once), as views of ``shape``."""
        if not self._chunks_kept or tuple(self._chunks_kept[0].shape) != (step, *shape[1:]):
            self._chunks_kept = [torch.empty((step, *shape[1:]), dtype=torch.uint8, device=self.device) for _ in range(2)]
        return [chunk[: shape[0]] for chunk in self._chunks_kept]

    def _chunks(self, layout: Gathers, ids: torch.Tensor, rows: torch.Tensor, step: int, shape: tuple[int, ...],
                gathered: list[torch.Event] | None, chunks: list[torch.Tensor] | None = None) -> None:
        """The chunks' gathers and transfers, on the current stream, through
        ``chunks`` (default: two made for this save); with ``gathered``
        (page-locked rows), transfers are not waited for and an event after
        the last gather is appended to it."""
        stream = torch.accelerator.current_stream(self.device)
        if chunks is None:
            chunks = [torch.empty(shape, dtype=torch.uint8, device=self.device) for _ in range(min(2, -(-len(ids) // step)))]
        for n, at in enumerate(range(0, len(ids), step)):
            part = chunks[n % 2][: min(step, len(ids) - at)]
            layout.gather_on_device(ids[at : at + len(part)], part)
            if gathered is not None and at + step >= len(ids):
                gathered.append(torch.Event(device=self.device))
                gathered[0].record(stream)
            rows[at : at + len(part)].copy_(part, non_blocking=gathered is not None)

    @contextmanager
    def _on_save_stream(self) -> Iterator[torch.Stream]:
        if self._stream is None:
            self._stream = torch.Stream(device=self.device)
        previous = torch.accelerator.current_stream(self.device)
        torch.accelerator.set_stream(self._stream)
        try:
            yield self._stream
        finally:
            torch.accelerator.set_stream(previous)

