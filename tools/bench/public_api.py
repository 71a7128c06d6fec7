"""The public API's hot loop, for comparing two checkouts: ``Store.put`` of
256 blocks of 256 KiB (16 per put, ``parent=``, flushed), ``Store.get`` of
all of them and ``Store.lookup`` of the 256-block chain, codecs none and
zstd, medians of ``--runs`` fresh stores. It imports only ``ucm_db``'s
public API, so the same file runs against another checkout
(``PYTHONPATH=/path/to/other/checkout``; copy the compiled
``ucm_db/_native*.so`` there) for interleaved A/B runs.
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import time
from typing import Any

import click
import numpy as np

import ucm_db

BLOCK_BYTES = 256 << 10
BLOCKS = 256
PER_PUT = 16
LOOKUPS = 200


def run(runs: int) -> dict[str, Any]:
    ns = ucm_db.Namespace(model="bench/public-api", kv_dtype="bfloat16", block_size=16)
    rng = np.random.default_rng(0)
    payload = rng.standard_normal(BLOCK_BYTES // 2, dtype=np.float32).astype(np.float16).view(np.uint8).tobytes()
    out: dict[str, Any] = {}
    for codec in ("none", "zstd"):
        puts, gets, looks = [], [], []
        for _ in range(runs):
            path = tempfile.mkdtemp(prefix="ucm-db-public-api-")
            try:
                with ucm_db.open(path, codec=codec, capacity_bytes=4 << 30, encode_threads=0) as store:
                    keys = ns.block_keys(list(range(BLOCKS * ns.block_size)))
                    started = time.perf_counter()
                    for i in range(0, BLOCKS, PER_PUT):
                        store.put(ns, keys[i:i + PER_PUT], [payload] * PER_PUT, parent=keys[i - 1] if i else None)
                    store.flush()
                    puts.append(BLOCKS * BLOCK_BYTES / (time.perf_counter() - started) / 1e9)
                    # Memory of the blocks' size touched first: this VM backs fresh memory lazily
                    # (a first touch runs at about 0.5 GB/s), which would time the allocator, not the store.
                    warm = [bytearray(BLOCK_BYTES) for _ in range(BLOCKS)]
                    started = time.perf_counter()
                    store.get(ns, keys)
                    gets.append(BLOCKS * BLOCK_BYTES / (time.perf_counter() - started) / 1e9)
                    started = time.perf_counter()
                    for _ in range(LOOKUPS):
                        store.lookup(ns, keys)
                    looks.append((time.perf_counter() - started) / LOOKUPS * 1e3)
                    del warm
            finally:
                shutil.rmtree(path, ignore_errors=True)
        out[codec] = {"put_GBps": statistics.median(puts), "get_GBps": statistics.median(gets),
                      "lookup_ms": statistics.median(looks)}
    return out


@click.command("public-api", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--runs", type=click.IntRange(min=1), default=3, show_default=True, help="fresh stores per codec; medians")
@click.option("--json", "as_json", is_flag=True, help="print JSON only")
def command(runs: int, as_json: bool) -> None:
    """The public API's put, get and lookup, for A/B runs of two checkouts.

    \b
    Example:
        ucm-db bench public-api --runs 3
        PYTHONPATH=/tmp/other python -m ucm_db.tools.bench.public_api --runs 3
    """
    figures = run(runs)
    if as_json:
        click.echo(json.dumps(figures, indent=2))
        return
    click.echo(" ".join(f"{codec}: put {f['put_GBps']:.3f} GB/s get {f['get_GBps']:.3f} GB/s lookup {f['lookup_ms']:.4f} ms"
                        for codec, f in figures.items()))


if __name__ == "__main__":
    command()
