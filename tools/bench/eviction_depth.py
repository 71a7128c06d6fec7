"""``ucm-db bench eviction-depth``: a save continuing a deep chain in a full store.

A serving store is full most of its life, so every save evicts; a request
with a long context continues a chain thousands of blocks deep (a 64K-token
prompt at block 16: 4096 blocks a KV head's unit chain). What one put of
``--put-blocks`` blocks continuing such a chain costs the putting thread,
at each ``--depths`` depth, in one LMDB store (codec none, 16 KiB payloads):

1. other chains fill ``--capacity-blocks`` less the depth, then the chain
   is put to its depth (256 blocks a commit): the store is full;
2. timed: ``--puts`` puts continue the chain, each evicting the other
   chains' tails (thread CPU time per put, median of ``--repeat`` stores).

Before f8cf6bf eviction walked the batch's chain to its root on every put
and rescanned its ancestors at every victim: the cost grew with the depth.

Invariants:
    * Each depth and repetition is a store of its own; the timed puts
      evict (the store is full before them) and the chain is found whole at
      the end (a run that lost an ancestor fails).
    * Reads no engine, no vLLM.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import click

import ucm_db
from ucm_db import Namespace
from ucm_db.tools.bench.common import int_list

NS = Namespace(model="bench-eviction-depth", kv_dtype="bfloat16", block_size=4)
PAYLOAD_BYTES = 16 << 10
FILL_BLOCKS = 256  # blocks a commit while filling


def chain(seed: int, blocks: int) -> ucm_db.BlockKeys:
    """Keys of chain ``seed`` (distinct seeds: disjoint chains)."""
    return NS.block_keys([seed * 100_000 + t for t in range(NS.block_size * blocks)])


def put_ms(scratch: Path, depth: int, capacity_blocks: int, puts: int, put_blocks: int) -> float:
    """Median thread CPU ms of one timed put at ``depth`` (module docstring)."""
    growth = puts * put_blocks
    if depth + growth > capacity_blocks:
        raise click.BadParameter(f"depth {depth} + {growth} timed blocks exceed --capacity-blocks {capacity_blocks}; "
                                 "raise --capacity-blocks")
    payload = bytes(PAYLOAD_BYTES)
    path = Path(tempfile.mkdtemp(prefix="ucm-bench-evict-", dir=scratch))
    with ucm_db.open(path, codec="none", capacity_bytes=capacity_blocks * PAYLOAD_BYTES) as store:
        for seed, at in enumerate(range(0, capacity_blocks - depth, FILL_BLOCKS), start=1000):
            count = min(FILL_BLOCKS, capacity_blocks - depth - at)
            store.put(NS, chain(seed, count), [payload] * count)
        keys = chain(1, depth + growth)  # the newest chain: what fills the store to the brim evicts the others
        for at in range(0, depth, FILL_BLOCKS):
            part = keys[at:min(at + FILL_BLOCKS, depth)]
            store.put(NS, part, [payload] * len(part))
        evictions0, times = store.stats().evictions, []
        for at in range(depth, depth + growth, put_blocks):
            cpu0 = time.thread_time()
            store.put(NS, keys[at:at + put_blocks], [payload] * put_blocks)
            times.append(time.thread_time() - cpu0)
        if store.lookup(NS, keys) != depth + growth or store.stats().evictions - evictions0 < growth:
            raise RuntimeError(f"depth {depth}: the chain lost blocks, or the timed puts did not evict")
    return statistics.median(times) * 1e3


@click.command("eviction-depth", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--depths", default="128,1024,4096", show_default=True, callback=int_list, help="chain depths, blocks")
@click.option("--capacity-blocks", type=click.IntRange(min=512), default=6000, show_default=True)
@click.option("--puts", type=click.IntRange(min=1), default=200, show_default=True, help="timed puts a store")
@click.option("--put-blocks", type=click.IntRange(min=1), default=2, show_default=True, help="blocks a timed put")
@click.option("--repeat", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--dir", "scratch_dir", type=click.Path(file_okay=False), default=None, help="scratch directory")
@click.option("--json", "as_json", is_flag=True)
def command(depths: list[int], capacity_blocks: int, puts: int, put_blocks: int, repeat: int, scratch_dir: str | None,
            as_json: bool) -> None:
    """Thread CPU of a put continuing a deep chain in a full store, by depth.

    \b
    Example:
        ucm-db bench eviction-depth
        ucm-db bench eviction-depth --depths 4096 --repeat 5 --json
    """
    with tempfile.TemporaryDirectory(prefix="ucm-bench-eviction-depth-", dir=scratch_dir) as scratch:
        runs = {d: [put_ms(Path(scratch), d, capacity_blocks, puts, put_blocks) for _ in range(repeat)] for d in depths}
    rows = [{"depth": d, "put_cpu_ms": round(statistics.median(r), 4), "runs": [round(x, 4) for x in r]} for d, r in runs.items()]
    report = {"put_blocks": put_blocks, "payload_bytes": PAYLOAD_BYTES, "capacity_blocks": capacity_blocks, "rows": rows}
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    click.echo(f"a {put_blocks}-block put continuing a chain in a full store ({capacity_blocks} blocks of 16 KiB); "
               f"thread CPU, median of {puts} puts, then of {repeat} stores")
    for row in rows:
        click.echo(f"depth {row['depth']:>6}: {row['put_cpu_ms']:.3f} ms  (runs {row['runs']})")


if __name__ == "__main__":
    command()
