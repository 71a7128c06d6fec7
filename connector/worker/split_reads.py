"""Staged loads read over several threads (``load_threads``).

Where a load's units are staged (KV caches on an accelerator: pinned host
rows, then one transfer, :mod:`ucm_db.connector.layouts`), the store's read
into the rows is the load's bottleneck: on a 16-core H200 host the transfer
and the strided copies ran at 45-48 GB/s, one ``get_into`` at 4.6-5.9 GB/s
(64-512 KiB units, codec none; ``ucm-db bench device-load``, BENCHMARKS.md).
The native read lets go of the GIL for the bulk of a unit's work (its check
and copy or decode), so a batch split into contiguous chunks, each read by
its own thread, scales with the unit size.

Invariants:
    * :meth:`SplitReads.get_into` returns one flag per key in key order,
      exactly as one ``Store.get_into`` over the same rows would; unit ``i``
      lands in row ``i`` whichever thread reads it.
    * Chunks are contiguous, of equal size but the last, and no more than
      one per :data:`MIN_UNITS_PER_THREAD` units. The caller's thread reads
      the first (a batch of one chunk: all of it, without the pool), the
      pool the others.
    * A chunk that raises does not cut the others short: every chunk is
      waited for, then the first error is raised (the rows are the caller's
      until the call returns).
    * ``threads == 1`` never starts a thread.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import ucm_db

#: Fewest units a thread reads: below it, a thread's start-up outweighs its share.
MIN_UNITS_PER_THREAD = 16
#: Most threads ``"auto"`` picks, and the smallest unit it gives them to.
#: Measured on a 16-core H200 host (``ucm-db bench device-load``, 256 blocks
#: of 8 KV heads), one thread's read against 2, 4 and 8, codec none / zstd:
#: 64 KiB units 1.42x, 0.73x, 0.56x / 1.57x, 2.42x, 1.12x; 128 KiB 1.50x,
#: 1.64x, 0.79x / 1.90x, 2.77x, 1.57x; 256 KiB 1.62x, 2.39x, 1.20x / 1.78x,
#: 2.58x, 3.12x. Past 4 the threads contend for the GIL (the per-unit work
#: that holds it), below 64 KiB that work is most of a unit's.
MAX_AUTO_THREADS = 4
MIN_AUTO_UNIT_BYTES = 128 << 10
#: Units from this size to :data:`MIN_AUTO_UNIT_BYTES` get 2 threads.
MIN_PAIR_UNIT_BYTES = 64 << 10


def auto_load_threads(on_accelerator: bool, unit_bytes: int, cpus: int | None = None, workers: int = 1) -> int:
    """``load_threads: "auto"``: 1 where the KV caches are in host memory
    (a vLLM-CPU host's cores run the model) or units are under 64 KiB; 2
    for units under 128 KiB; else 4; never more than a quarter of the CPUs
    this process may run on (``cpus``, default :func:`usable_cpus`) shared
    by the engine's ``workers`` on the node (:func:`local_workers`)."""
    if not on_accelerator or unit_bytes < MIN_PAIR_UNIT_BYTES:
        return 1
    wanted = MAX_AUTO_THREADS if unit_bytes >= MIN_AUTO_UNIT_BYTES else 2
    return max(1, min(wanted, (cpus if cpus is not None else usable_cpus()) // (4 * max(1, workers))))


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity, where the OS says)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity call here (not Linux)
        return os.cpu_count() or 1


def local_workers(ranks: int) -> int:
    """How many of an engine's ``ranks`` (TP x PP) share this node: one per
    accelerator it sees, at most (1 where it sees none)."""
    import torch

    devices = torch.accelerator.device_count() if torch.accelerator.is_available() else 0
    return max(1, min(ranks, devices)) if devices else 1


class SplitReads:
    """Reads a batch of units into staging rows over ``threads`` threads
    (module invariants)."""

    def __init__(self, threads: int) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.threads = threads
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="ucm-db-read") if threads > 1 else None

    def get_into(self, store: ucm_db.Store, namespace: ucm_db.Namespace, keys: Sequence[bytes], rows: memoryview,
                 unit_bytes: int, *, touch: bool = True) -> list[bool]:
        """Reads unit ``keys[i]`` into ``rows[i * unit_bytes : (i + 1) * unit_bytes]``
        (it must fill it exactly, :class:`ucm_db.ScatterSlabs`)."""
        count = len(keys)
        chunks = max(1, min(self.threads, count // MIN_UNITS_PER_THREAD))
        if self._pool is None or chunks == 1:
            return store.get_into(namespace, keys, ucm_db.ScatterSlabs([rows], [unit_bytes], range(count)), touch=touch)
        step = -(-count // chunks)

        def read(lo: int) -> list[bool]:
            hi = min(count, lo + step)
            return store.get_into(namespace, keys[lo:hi], ucm_db.ScatterSlabs([rows], [unit_bytes], range(lo, hi)), touch=touch)

        futures: list[Future[list[bool]]] = [self._pool.submit(read, lo) for lo in range(step, count, step)]
        flags: list[bool] = []
        first_error: BaseException | None = None
        try:
            flags = read(0)
        except BaseException as exc:  # noqa: BLE001 - an interrupt too: the others are waited for first (invariants)
            first_error = exc
        for future in futures:
            try:
                flags += future.result()
            except BaseException as exc:  # noqa: BLE001 - same
                first_error = first_error or exc
        if first_error is not None:
            raise first_error
        return flags

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
