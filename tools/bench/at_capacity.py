"""Stores at capacity for ``ucm-db bench writer --store full``: the state a
serving store spends its life in (a cache fills, then every save evicts).

A fresh store measures something else: every commit extends the file, and
each new page of the page cache is memory the kernel (and, on a virtual
machine, its host) hands out for the first time. On the 2-core VMs of this
project a first write into such memory ran at 0.33 GB/s against 10.5 GB/s
into pages already cached (2026-12-04), so a fresh store's figure moved
with how much memory the host had taken back, not with the store.

Invariants:
    * A store at capacity is brought there untimed by :data:`TURNOVERS`
      fills of the timed run's own size and shape (other keys): the first
      fills it, the next evicts the first, so the timed saves evict as many
      bytes as they store and LMDB reuses freed pages instead of growing
      the file (one fill left it growing by a fifth of what the timed run
      wrote).
    * The baseline put and the connector's saves are brought to capacity
      the same way, each with a capacity of what its timed run writes
      (:func:`capacity_for`).
    * Imports no vLLM: the connector's fills are the caller's
      (:func:`ucm_db.tools.bench.writer.writer_once`).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import ucm_db
from ucm_db.tools.bench import put as bench_put
from ucm_db.tools.bench.common import BLOCK_BYTES, BenchOptions, chain_keys, put_chain

#: Untimed fills before a timed run: one to fill, one to turn the store over.
TURNOVERS = 2
#: Chain seeds of the baseline's fills (the timed chain is seed 1, as bench core's).
FILL_SEEDS = (7, 8)
#: Capacity a block beyond its payload (the stored record's framing and
#: head): a timed run then fits whole and evicts only what the fills left.
SLACK_BYTES_PER_BLOCK = 4096


def capacity_for(payload_bytes: int, blocks: int) -> int:
    """The capacity of a store at capacity whose timed run stores
    ``blocks`` blocks of ``payload_bytes`` in all (at least the 1 MiB a
    store accepts: a tinier run evicts less than it stores)."""
    return max(payload_bytes + blocks * SLACK_BYTES_PER_BLOCK, 1 << 20)


def put_once(options: BenchOptions, payloads: list[memoryview], codec: str, store: str) -> tuple[float, float]:
    """``bench core``'s durable put (64, quick 32, x 2 MiB, 16 a commit,
    timed to ``flush``) into a fresh store or one at capacity; ``(wall_s,
    process_cpu_s)``."""
    if store == "fresh":
        return bench_put._store_once(options, payloads, options.put_blocks, codec=codec, durability="group")
    n_blocks = options.put_blocks
    path = Path(tempfile.mkdtemp(prefix=f"ucm-bench-put-full-{codec}-", dir=options.scratch_dir))
    try:
        with ucm_db.open(path, codec=codec, durability="group", capacity_bytes=capacity_for(n_blocks * BLOCK_BYTES, n_blocks),
                         encode_threads=2) as target:
            for seed in FILL_SEEDS[:TURNOVERS]:
                put_chain(target, chain_keys(n_blocks, seed=seed), payloads)
            target.flush()
            with bench_put._Clock() as clock:
                put_chain(target, chain_keys(n_blocks, seed=1), payloads)
                target.flush()
            return clock.pair()
    finally:
        shutil.rmtree(path, ignore_errors=True)

