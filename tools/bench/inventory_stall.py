"""Whether a router's inventory replay holds up the store's writers:
the longest ``Store.put`` while ``Store.event_inventory()`` walks a store of
evented blocks, against the same puts with nothing else running.

A writer thread puts one evented block about every millisecond, first
alone (the baseline), then while the main thread reads the inventory.
Reported per engine: the walk's time and the puts' median, p99 and longest
latency, alone and during the walk. A put that waits for the walk shows as
a longest put close to the walk's own time. Run:
``ucm-db bench inventory-stall [--blocks 50000] [--engine lmdb --engine rocksdb] [--json]``.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import click

import ucm_db
from ucm_db import BlockEventFields, BlockKeys, Namespace

BLOCK_SIZE = 4
CHAIN_BLOCKS = 500
PAYLOAD = b"x" * 64
NS = Namespace(model="bench/inventory-stall", kv_dtype="bfloat16", block_size=BLOCK_SIZE)


def _evented_chain(tokens: list[int], tag: bytes) -> tuple[BlockKeys, dict[bytes, BlockEventFields]]:
    keys = NS.block_keys(tokens)
    fields: dict[bytes, BlockEventFields] = {}
    parent = None
    for i, key in enumerate(keys):
        block_hash = tag + key[:15]
        fields[key] = BlockEventFields(block_hash, parent, tuple(tokens[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]),
                                       BLOCK_SIZE, None, None, 0)
        parent = block_hash
    return keys, fields


def _put_latencies_s(store: ucm_db.Store, first: int, stop: threading.Event, out: list[float]) -> None:
    i = first
    while not stop.is_set():
        keys, fields = _evented_chain([i, 1, 2, 3], b"p")
        started = time.perf_counter()
        store.put(NS, keys, [PAYLOAD], event_fields=fields)
        out.append(time.perf_counter() - started)
        i += 1
        time.sleep(0.001)


def _summary_ms(latencies_s: list[float]) -> dict[str, float]:
    ordered = sorted(latencies_s)
    return {"puts": len(ordered), "median_ms": round(statistics.median(ordered) * 1e3, 3),
            "p99_ms": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e3, 3),
            "max_ms": round(ordered[-1] * 1e3, 3)}


def run_engine(engine: str, blocks: int, scratch: Path) -> dict[str, Any]:
    """One engine's figures (module docstring)."""
    with ucm_db.open(scratch / engine, engine=engine, capacity_bytes=8 << 30, durability="group",
                     encode_threads=0) as store:
        for chain in range(max(1, blocks // CHAIN_BLOCKS)):
            keys, fields = _evented_chain([10**9 + chain] + list(range(CHAIN_BLOCKS * BLOCK_SIZE - 1)), b"v")
            store.put(NS, keys, [PAYLOAD] * len(keys), event_fields=fields)
        stop, alone = threading.Event(), []
        writer = threading.Thread(target=_put_latencies_s, args=(store, 0, stop, alone))
        writer.start()
        time.sleep(1.0)
        stop.set()
        writer.join()
        stop, during = threading.Event(), []
        writer = threading.Thread(target=_put_latencies_s, args=(store, 10**6, stop, during))
        writer.start()
        time.sleep(0.2)
        started = time.perf_counter()
        inventory = store.event_inventory()
        walk_s = time.perf_counter() - started
        stop.set()
        writer.join()
    return {"engine": engine, "records": len(inventory.records), "walk_ms": round(walk_s * 1e3, 1),
            "alone": _summary_ms(alone), "during": _summary_ms(during)}


@click.command("inventory-stall", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--blocks", type=click.IntRange(min=CHAIN_BLOCKS), default=50_000, show_default=True,
              help="evented blocks in the store")
@click.option("--engine", "engines", type=click.Choice(["lmdb", "rocksdb"]), multiple=True,
              help="engines to measure (default: both)")
@click.option("--json", "as_json", is_flag=True, help="print JSON only")
def command(blocks: int, engines: tuple[str, ...], as_json: bool) -> None:
    """Longest put while event_inventory() walks the store, against puts alone.

    \b
    Example:
        ucm-db bench inventory-stall --blocks 50000
    """
    with tempfile.TemporaryDirectory() as scratch:
        figures = [run_engine(engine, blocks, Path(scratch)) for engine in engines or ("lmdb", "rocksdb")]
    if as_json:
        click.echo(json.dumps(figures, indent=2, sort_keys=True))
        return
    for f in figures:
        alone, during = f["alone"], f["during"]
        click.echo(f"{f['engine']}: inventory of {f['records']} records took {f['walk_ms']} ms; puts alone: median "
                   f"{alone['median_ms']} ms, longest {alone['max_ms']} ms; during the walk ({during['puts']} puts): "
                   f"median {during['median_ms']} ms, p99 {during['p99_ms']} ms, longest {during['max_ms']} ms")


if __name__ == "__main__":
    command()
