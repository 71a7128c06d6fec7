"""Warm reads and the codec on real bf16 K/V.

* Warm get: 16 blocks of 2 MiB already in the page cache, read with
  ``Store.get_into`` into caller-provided buffers, against ``numpy.copyto``
  of 16 different 2 MiB sources into 16 buffers (the memcpy floor; 32 MiB
  of sources, larger than the caches, like the store's map).
* Codec: ``codec.encode``/``codec.decode_into`` on one thread, in GB/s of
  raw bytes per core, and the compression ratio (raw / stored bytes).
"""

from __future__ import annotations

import time

import numpy as np

import ucm_db
from ucm_db.components import codec
from ucm_db.tools.bench.common import (
    BLOCK_BYTES,
    NAMESPACE,
    BenchOptions,
    Figure,
    chain_keys,
    put_chain,
    rate_figure,
    scratch,
)

_GET_BLOCKS = 16
_GIB = 1 << 30


def run_get(options: BenchOptions, payloads: list[memoryview]) -> dict[str, Figure]:
    """Warm get_into (codec none and zstd) and the memcpy baseline."""
    repeat = max(options.repeat * 4, 10)
    outs = [np.empty(BLOCK_BYTES, dtype=np.uint8) for _ in range(_GET_BLOCKS)]
    sources = [np.frombuffer(payloads[i % len(payloads)], dtype=np.uint8).copy() for i in range(_GET_BLOCKS)]
    figures = {"memcpy": _memcpy_figure(sources, outs, repeat)}
    for codec_name in ("none", "zstd"):
        figures[f"store_get_into_{codec_name}"] = _get_figure(options, payloads, outs, repeat, codec_name)
    amount = _GET_BLOCKS * BLOCK_BYTES
    for figure in figures.values():
        figure.note = f"{_GET_BLOCKS} x 2 MiB per run, {amount >> 20} MiB"
    return figures


def _memcpy_figure(sources: list[np.ndarray], outs: list[np.ndarray], repeat: int) -> Figure:
    runs = []
    for _ in range(repeat):
        start = time.perf_counter()
        for src, dst in zip(sources, outs):
            np.copyto(dst, src)
        runs.append(time.perf_counter() - start)
    return rate_figure(runs, _GET_BLOCKS * BLOCK_BYTES, "GB/s")


def _get_figure(options: BenchOptions, payloads: list[memoryview], outs: list[np.ndarray], repeat: int, codec_name: str) -> Figure:
    keys = chain_keys(_GET_BLOCKS, seed=2)
    with scratch(options, f"get-{codec_name}") as path:
        with ucm_db.open(path, codec=codec_name, capacity_bytes=_GIB, encode_threads=2) as store:
            put_chain(store, keys, payloads)
            store.flush()
            ok = store.get_into(NAMESPACE, keys, outs)  # warm the page cache
            if not all(ok) or any(not np.array_equal(o, np.frombuffer(payloads[i % len(payloads)], np.uint8)) for i, o in enumerate(outs)):
                raise RuntimeError("warm get returned wrong bytes: the benchmark is measuring a broken store")
            runs = []
            for _ in range(repeat):
                start = time.perf_counter()
                store.get_into(NAMESPACE, keys, outs)
                runs.append(time.perf_counter() - start)
    return rate_figure(runs, _GET_BLOCKS * BLOCK_BYTES, "GB/s")


def run_codec(options: BenchOptions, payloads: list[memoryview]) -> dict[str, Figure]:
    """zstd ratio and single-thread encode/decode speed on real K/V."""
    blocks = payloads[: options.codec_blocks]
    key = bytes(32)
    raw_bytes = sum(len(b) for b in blocks)
    encoded = [codec.encode(key, b, codec="zstd", element_bytes=2) for b in blocks]
    stored_bytes = sum(len(e) for e in encoded)
    outs = [np.empty(len(b), dtype=np.uint8) for b in blocks]
    for out, blob, block in zip(outs, encoded, blocks):
        codec.decode_into(blob, key, out)
        if not np.array_equal(out, np.frombuffer(block, np.uint8)):
            raise RuntimeError("zstd round trip changed the bytes")
    enc_wall, enc_cpu, dec_wall, dec_cpu = [], [], [], []
    for _ in range(options.repeat):
        wall, cpu = time.perf_counter(), time.thread_time()
        for b in blocks:
            codec.encode(key, b, codec="zstd", element_bytes=2)
        enc_wall.append(time.perf_counter() - wall)
        enc_cpu.append(time.thread_time() - cpu)
        wall, cpu = time.perf_counter(), time.thread_time()
        for blob, out in zip(encoded, outs):
            codec.decode_into(blob, key, out)
        dec_wall.append(time.perf_counter() - wall)
        dec_cpu.append(time.thread_time() - cpu)
    note = f"{len(blocks)} x 2 MiB real bf16 K/V, 1 thread"
    cpu_note = note + "; GB per CPU-second of this thread (per-core speed on a shared machine)"
    ratio = raw_bytes / stored_bytes
    return {
        "zstd_ratio": Figure(ratio, "x", [round(ratio, 4)], note),
        "zstd_encode_wall": rate_figure(enc_wall, raw_bytes, "GB/s", note=note),
        "zstd_encode_cpu": rate_figure(enc_cpu, raw_bytes, "GB/s", note=cpu_note),
        "zstd_decode_wall": rate_figure(dec_wall, raw_bytes, "GB/s", note=note),
        "zstd_decode_cpu": rate_figure(dec_cpu, raw_bytes, "GB/s", note=cpu_note),
    }
