"""The store's codec threads against the caller's thread, by frame size.

For each mean frame size: ``Store.get_into`` (decode) and ``Store.put``
(encode) of 16 MiB of bf16-like blocks in zstd, with ``encode_threads=2``
against ``encode_threads=0``, in raw MB/s (median of ``--runs``). Since the
pool takes only blocks whose frames average ``POOL_MIN_FRAME_BYTES`` or
more, the two columns agree below that size; set ``--force-pool`` to see
what the pool would do there.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from typing import Any

import click
import numpy as np

import ucm_db
from ucm_db.components import codec_pool
from ucm_db.keys import Namespace

TOTAL_BYTES = 16 << 20
_NS = Namespace(model="bench-codec-pool", kv_dtype="bfloat16", block_size=32)


def bf16_like(num_blocks: int, block_bytes: int) -> np.ndarray:
    """Normal values as bf16 bit patterns (sign/exponent plane compressible, mantissa not)."""
    values = np.random.default_rng(0).standard_normal((num_blocks, block_bytes // 2)).astype(np.float32)
    return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)


def measure(frame_bytes: int, block_bytes: int, threads: int, runs: int, *, codec_name: str = "zstd",
            data: np.ndarray | None = None) -> dict[str, float]:
    """Median decode and encode MB/s of one configuration, over ``data``
    (``[blocks, block_bytes]`` uint8, 16 MiB; bf16-like when None)."""
    num_blocks = TOTAL_BYTES // block_bytes
    data = bf16_like(num_blocks, block_bytes) if data is None else data
    if data.shape != (num_blocks, block_bytes):
        raise ValueError(f"want {num_blocks} blocks of {block_bytes} bytes, got an array of shape {data.shape}")
    frames = (frame_bytes,) * (block_bytes // frame_bytes)
    encode_s, decode_s = [], []
    with tempfile.TemporaryDirectory(prefix="ucm-bench-pool-") as tmp:
        with ucm_db.open(tmp, codec=codec_name, capacity_bytes=8 << 30, encode_threads=threads, durability="group") as store:
            out = np.empty_like(data)
            buffers = [out[i] for i in range(num_blocks)]
            for run in range(runs):
                keys = _NS.block_keys(list(range(32 * num_blocks)), {"run": str(run)})
                started = time.perf_counter()
                store.put(_NS, keys, [ucm_db.Framed(data[i], frames) for i in range(num_blocks)])
                encode_s.append(time.perf_counter() - started)
                started = time.perf_counter()
                ok = store.get_into(_NS, keys, buffers)
                decode_s.append(time.perf_counter() - started)
                assert all(ok) and np.array_equal(out, data)
    return {"decode_MBps": round(TOTAL_BYTES / 1e6 / statistics.median(decode_s), 1),
            "encode_MBps": round(TOTAL_BYTES / 1e6 / statistics.median(encode_s), 1)}


def run(frame_sizes: list[int], runs: int, force_pool: bool) -> list[dict[str, Any]]:
    rows = []
    saved = codec_pool.POOL_MIN_FRAME_BYTES
    try:
        if force_pool:
            codec_pool.POOL_MIN_FRAME_BYTES = 0
        for frame_bytes in frame_sizes:
            block_bytes = max(frame_bytes * 8, 64 << 10) if frame_bytes < (256 << 10) else max(frame_bytes, 2 << 20)
            alone = measure(frame_bytes, block_bytes, 0, runs)
            pooled = measure(frame_bytes, block_bytes, 2, runs)
            rows.append({"frame_bytes": frame_bytes, "block_bytes": block_bytes, "caller_thread": alone, "pool_2_threads": pooled,
                         "decode_pool_over_caller": round(pooled["decode_MBps"] / alone["decode_MBps"], 2),
                         "encode_pool_over_caller": round(pooled["encode_MBps"] / alone["encode_MBps"], 2)})
    finally:
        codec_pool.POOL_MIN_FRAME_BYTES = saved
    return rows


@click.command("codec-pool", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--frame-kib", default="8,64,256,1024,2048", show_default=True, help="comma list of frame sizes (KiB)")
@click.option("--runs", type=click.IntRange(min=1), default=21, show_default=True, help="repetitions (medians reported)")
@click.option("--force-pool", is_flag=True, help="send every block to the pool (what the pool does below its threshold)")
@click.option("--json", "as_json", is_flag=True, help="print JSON only")
def command(frame_kib: str, runs: int, force_pool: bool, as_json: bool) -> None:
    """The codec threads (encode_threads=2) against the caller's thread, by frame size.

    \b
    Example:
        ucm-db bench codec-pool --force-pool
        ucm-db bench codec-pool --frame-kib 8,1024 --runs 3
    """
    sizes = [int(kib) << 10 for kib in frame_kib.split(",") if kib.strip()]
    rows = run(sizes, runs, force_pool)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    click.echo(f"zstd, 16 MiB of bf16-like blocks, median of {runs}; pool threshold "
               f"{'forced to 0' if force_pool else f'{codec_pool.POOL_MIN_FRAME_BYTES >> 10} KiB'}")
    click.echo(f"{'frame':>9} {'block':>9} {'decode alone':>13} {'decode pool':>12} {'ratio':>6} {'encode alone':>13} {'encode pool':>12} {'ratio':>6}")
    for r in rows:
        a, p = r["caller_thread"], r["pool_2_threads"]
        click.echo(f"{r['frame_bytes'] >> 10:>7}Ki {r['block_bytes'] >> 10:>7}Ki {a['decode_MBps']:>13} {p['decode_MBps']:>12} "
                   f"{r['decode_pool_over_caller']:>6} {a['encode_MBps']:>13} {p['encode_MBps']:>12} {r['encode_pool_over_caller']:>6}")
