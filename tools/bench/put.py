"""Durable put of 2 MiB blocks: the store against the baselines.

Each repetition writes ``options.put_blocks`` blocks of real bf16 K/V, 16 per
commit, into a fresh directory, and the clock stops when everything is
durable: at the end of ``Store.flush()`` for the store, after the last
``fsync`` for the baselines. Opening and removing the directory are untimed.

Baselines (same bytes, same run):
    * file-per-block: temp file, write, ``fsync``, ``rename`` per block, and
      an ``fsync`` of the directory per 16 blocks (what a POSIX block store
      such as UCM's does to be crash-safe);
    * raw py-lmdb: one write transaction of 16 ``put`` calls per commit,
      ``sync=True`` (the floor for ``durability="sync"``).
"""

from __future__ import annotations

import os
import resource
import shutil
import tempfile
import time
from pathlib import Path

import lmdb

import ucm_db
from ucm_db.tools.bench.common import (
    BLOCK_BYTES,
    BLOCKS_PER_COMMIT,
    BenchOptions,
    Figure,
    chain_keys,
    put_chain,
    rate_figure,
    time_figure,
)

_GIB = 1 << 30


def run_put(options: BenchOptions, payloads: list[memoryview]) -> dict[str, Figure]:
    """All durable-put figures, in GB/s of raw payload bytes.

    The configurations take turns within each repetition, so a slow spell of
    the shared disk hits all of them alike rather than one.
    """
    n_blocks = options.put_blocks
    raw_bytes = n_blocks * BLOCK_BYTES
    cases = {
        "file_per_block_fsync": lambda: _files_once(options, payloads, n_blocks),
        "store_group_none": lambda: _store_once(options, payloads, n_blocks, codec="none", durability="group"),
        "raw_lmdb_sync": lambda: _raw_lmdb_once(options, payloads, n_blocks),
        "store_sync_none": lambda: _store_once(options, payloads, n_blocks, codec="none", durability="sync"),
        "store_group_zstd": lambda: _store_once(options, payloads, n_blocks, codec="zstd", durability="group"),
    }
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
    for _ in range(options.repeat):
        for name, once in cases.items():
            runs[name].append(once())
    note = f"{n_blocks} x 2 MiB, {BLOCKS_PER_COMMIT}/commit, timed to durable; {raw_bytes >> 20} MiB/run"
    figures = {}
    for name, pairs in runs.items():
        figures[name] = rate_figure([wall for wall, _ in pairs], raw_bytes, "GB/s", note=note)
    for name, pairs in runs.items():
        figures[f"{name}_cpu_per_block"] = time_figure(
            [cpu for _, cpu in pairs], n_blocks, "ms", note="CPU time of the whole process (all threads) per 2 MiB block",
        )
    return figures


class _Clock:
    """Wall and whole-process CPU time of one timed region."""

    def __enter__(self) -> _Clock:
        self.wall, self.cpu = time.perf_counter(), _cpu_s()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall, self.cpu = time.perf_counter() - self.wall, _cpu_s() - self.cpu

    def pair(self) -> tuple[float, float]:
        return self.wall, self.cpu


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _fresh_dir(options: BenchOptions, name: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=f"ucm-bench-{name}-", dir=options.scratch_dir))


def _store_once(options: BenchOptions, payloads: list[memoryview], n_blocks: int, *, codec: str, durability: str) -> tuple[float, float]:
    keys = chain_keys(n_blocks, seed=1)
    path = _fresh_dir(options, f"put-{codec}-{durability}")
    store = ucm_db.open(path, codec=codec, durability=durability, capacity_bytes=4 * _GIB, encode_threads=2)
    try:
        with _Clock() as clock:
            put_chain(store, keys, payloads)
            store.flush()
        return clock.pair()
    finally:
        store.close()
        shutil.rmtree(path, ignore_errors=True)


def _files_once(options: BenchOptions, payloads: list[memoryview], n_blocks: int) -> tuple[float, float]:
    path = _fresh_dir(options, "files")
    dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with _Clock() as clock:
            for i in range(n_blocks):
                _write_file_durably(path, f"{i:08x}", payloads[i % len(payloads)])
                if (i + 1) % BLOCKS_PER_COMMIT == 0 or i == n_blocks - 1:
                    os.fsync(dir_fd)  # make the renames themselves durable
        return clock.pair()
    finally:
        os.close(dir_fd)
        shutil.rmtree(path, ignore_errors=True)


def _write_file_durably(directory: Path, name: str, payload: memoryview) -> None:
    tmp = directory / f".{name}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        view = memoryview(payload)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, directory / name)


def _raw_lmdb_once(options: BenchOptions, payloads: list[memoryview], n_blocks: int) -> tuple[float, float]:
    keys = chain_keys(n_blocks, seed=1)
    path = _fresh_dir(options, "rawlmdb")
    env = lmdb.open(str(path), map_size=4 * _GIB, sync=True, metasync=True, writemap=False, readahead=True)
    try:
        with _Clock() as clock:
            for at in range(0, n_blocks, BLOCKS_PER_COMMIT):
                with env.begin(write=True) as txn:
                    for i in range(at, min(at + BLOCKS_PER_COMMIT, n_blocks)):
                        txn.put(keys[i], payloads[i % len(payloads)])
            env.sync(True)
        return clock.pair()
    finally:
        env.close()
        shutil.rmtree(path, ignore_errors=True)
