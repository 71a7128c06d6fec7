"""Index costs: prefix lookup, key derivation, and flatness as the store grows.

* Lookup: ``Store.lookup`` of an 8192-key chain that is fully stored, half
  stored (first 4096 blocks) and not stored at all.
* ``Namespace.block_keys`` for 128K tokens (block size 16, 8192 keys), from
  a Python list (what vLLM hands over) and from a numpy array.
* Scale: stores pre-filled with ``scale_blocks`` small (4 KiB) blocks; in each,
  durable put of 2 MiB blocks, commit latency of 16 small blocks, and lookup
  of a stored 8192-block chain. The large store's figures should be within
  1.5x of the small one's.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import numpy as np

import ucm_db
from ucm_db.tools.bench.common import (
    BLOCK_BYTES,
    BLOCKS_PER_COMMIT,
    NAMESPACE,
    BenchOptions,
    Figure,
    chain_keys,
    put_chain,
    rate_figure,
    scratch,
    time_figure,
)

CHAIN_BLOCKS = 8192
TOKENS_128K = 128 * 1024
_SMALL_BYTES = 4096
_PREFILL_CHAIN = 512
_SCALE_BIG_BLOCKS = 32
_SCALE_COMMITS = 20
_SCALE_LOOKUPS = 200
_GIB = 1 << 30


def run_lookup(options: BenchOptions) -> dict[str, Figure]:
    """Lookup of an 8192-key chain: all, half and none present."""
    full, half, absent = (chain_keys(CHAIN_BLOCKS, seed=s) for s in (3, 4, 5))
    tiny = [memoryview(bytes(64))]
    with scratch(options, "lookup") as path, ucm_db.open(path, codec="none", capacity_bytes=_GIB) as store:
        put_chain(store, full, tiny, batch=1024)
        put_chain(store, half[: CHAIN_BLOCKS // 2], tiny, batch=1024)
        store.flush()
        figures = {}
        for name, keys, expected in (("all", full, CHAIN_BLOCKS), ("half", half, CHAIN_BLOCKS // 2), ("none", absent, 0)):
            figures[f"lookup_8192_{name}"] = _lookup_figure(options, store, keys, expected)
    return figures


def _lookup_figure(options: BenchOptions, store: Any, keys: list[bytes], expected: int, calls: int = 200) -> Figure:
    found = store.lookup(NAMESPACE, keys)
    if found != expected:
        raise RuntimeError(f"lookup found {found} blocks, expected {expected}")
    runs = []
    for _ in range(options.repeat):
        start = time.perf_counter()
        for _ in range(calls):
            store.lookup(NAMESPACE, keys)
        runs.append(time.perf_counter() - start)
    return time_figure(runs, calls, "ms", note=f"{len(keys)}-key chain, mean of {calls} calls per run")


def run_block_keys(options: BenchOptions) -> dict[str, Figure]:
    """``block_keys`` for 128K tokens from a list and from a numpy array."""
    rng = np.random.default_rng(7)  # token ids only; their values do not change the cost
    as_array = rng.integers(0, 32_000, TOKENS_128K, dtype=np.int32)
    as_list = as_array.tolist()
    figures = {}
    note = f"{TOKENS_128K} tokens, block_size 16"
    for name, tokens in (("list", as_list), ("numpy", as_array)):
        wall_runs, cpu_runs = [], []
        for _ in range(max(options.repeat * 4, 11)):
            wall, cpu = time.perf_counter(), time.thread_time()
            keys = NAMESPACE.block_keys(tokens)
            cpu_runs.append(time.thread_time() - cpu)
            wall_runs.append(time.perf_counter() - wall)
        if len(keys) != TOKENS_128K // NAMESPACE.block_size:
            raise RuntimeError("block_keys returned the wrong number of keys")
        figures[f"block_keys_128k_{name}_wall"] = time_figure(wall_runs, 1, "ms", note=note)
        figures[f"block_keys_128k_{name}_cpu"] = time_figure(cpu_runs, 1, "ms", note=note + "; CPU time of this thread")
    return figures


def run_scale(options: BenchOptions, payloads: list[memoryview]) -> dict[str, Figure]:
    """Put and lookup figures in stores pre-filled with few and many blocks.

    Both stores are filled first and then measured in turns within each
    repetition, so load on the shared machine hits both alike.
    """
    with contextlib.ExitStack() as stack:
        stores = {}
        for prefill in options.scale_blocks:
            path = stack.enter_context(scratch(options, f"scale{prefill}"))
            store = stack.enter_context(ucm_db.open(path, codec="none", capacity_bytes=8 * _GIB))
            stores[prefill] = (store, _prefill(store, prefill))
        runs: dict[int, dict[str, list[float]]] = {p: {"put": [], "commit": [], "lookup": []} for p in stores}
        for rep in range(options.repeat):
            for prefill, (store, chain) in stores.items():
                for name, value in _scale_once(store, payloads, chain, rep).items():
                    runs[prefill][name].append(value)
        return {name: fig for prefill, r in runs.items() for name, fig in _scale_figures(prefill, r).items()}


def _prefill(store: Any, n_blocks: int) -> list[bytes]:
    """Fills ``n_blocks`` 4 KiB blocks; returns a stored 8192-block chain."""
    small = [memoryview(np.full(_SMALL_BYTES, i, dtype=np.uint8)) for i in range(16)]
    lookup_chain = chain_keys(CHAIN_BLOCKS, seed=6)
    put_chain(store, lookup_chain, [memoryview(bytes(64))], batch=1024)
    seed = 100
    remaining = n_blocks
    while remaining > 0:
        count = min(_PREFILL_CHAIN, remaining)
        put_chain(store, chain_keys(count, seed=seed), small, batch=count)
        remaining -= count
        seed += 1
    store.flush()
    if store.lookup(NAMESPACE, lookup_chain) != CHAIN_BLOCKS:
        raise RuntimeError("pre-filled store lost its lookup chain")
    return lookup_chain


def _scale_once(store: Any, payloads: list[memoryview], lookup_chain: list[bytes], rep: int) -> dict[str, float]:
    """One repetition: durable 2 MiB put, small commits, lookups (seconds)."""
    small = [memoryview(np.full(_SMALL_BYTES, 7, dtype=np.uint8))]
    start = time.perf_counter()
    put_chain(store, chain_keys(_SCALE_BIG_BLOCKS, seed=1000 + rep), payloads)
    store.flush()
    put_s = time.perf_counter() - start
    small_keys = chain_keys(BLOCKS_PER_COMMIT * _SCALE_COMMITS, seed=2000 + rep)
    start = time.perf_counter()
    put_chain(store, small_keys, small)
    commit_s = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(_SCALE_LOOKUPS):
        store.lookup(NAMESPACE, lookup_chain)
    return {"put": put_s, "commit": commit_s, "lookup": time.perf_counter() - start}


def _scale_figures(prefill: int, runs: dict[str, list[float]]) -> dict[str, Figure]:
    label = f"{prefill // 1000}k" if prefill >= 1000 else str(prefill)
    note = f"store pre-filled with {prefill} x 4 KiB blocks"
    return {
        f"scale_{label}_put_2mib": rate_figure(runs["put"], _SCALE_BIG_BLOCKS * BLOCK_BYTES, "GB/s",
                                               note=note + f"; {_SCALE_BIG_BLOCKS} x 2 MiB to durable"),
        f"scale_{label}_commit_16x4k": time_figure(runs["commit"], _SCALE_COMMITS, "ms",
                                                   note=note + "; one commit of 16 x 4 KiB (no fsync)"),
        f"scale_{label}_lookup_8192": time_figure(runs["lookup"], _SCALE_LOOKUPS, "ms",
                                                  note=note + f"; 8192-key chain, mean of {_SCALE_LOOKUPS} calls"),
    }
