"""The hot path alone: a connector worker's loads and saves against memcpy.

A real :class:`~ucm_db.connector.worker.hooks.UcmDbWorker` (no engine) over a real
LMDB store and a CPU KV cache in vLLM CPU's layout (one bf16 tensor per
layer, ``[blocks, kv_heads, block_size, 2*head_size]``). The connector's
unit (one block's KV of one head, every layer) is what the store reads and
writes; its size is ``layers x block_size x 2*head_size x 2`` bytes, so a
unit size picks the number of layers at a fixed 8 KiB per layer (head 64,
block 32: the slab of the 8-layer bf16 Llama the issue measured, whose unit
is 64 KiB).

Per codec (``none``, ``zstd``) and unit size the figures are:

* ``load``: ``start_load`` of every block (units decoded and placed into
  the KV cache: in place for codec ``none``, staged and scattered for
  ``zstd``, as the worker does), warm page cache and, with ``--cold``, cold
  (the store closed, ``posix_fadvise(DONTNEED)`` on its data file, opened
  again before each timed load);
* ``save``: ``save`` of fresh blocks, ``--save-blocks`` per call as an
  engine's steps save them, then ``drain`` (gathered out of the KV cache,
  encoded and committed by the writer thread);
* ``save_calls``: the caller's share of ``save`` alone, the time spent
  inside the ``save`` calls (the gather out of the KV cache into staging and
  the hand-off to the writer), which in an engine is the model's thread's
  cost of saving; its CPU figure is that thread's CPU time (``thread_time``);
* ``put``: the store's own durable put of the same units (the same bytes,
  the same codec and durability, as many units per transaction as one save
  call, each call a chain segment continuing the last) into a second store
  of the same settings, the saves' baseline: both grow their file by the
  same bytes, so both pay the kernel's cost of new page-cache pages;
* ``memcpy``: ``numpy.copyto`` of the same number of bytes between two
  resident buffers, timed in the same rounds;

each as GB/s of KV bytes by wall time (median of ``--repeats``), GB/s per
CPU second of the process (steadier on a shared host), and the wall ratio
to memcpy. The data is ``randn`` in bf16: its exponent plane compresses,
its mantissa does not (about what real K/V does).

Invariants:
    * Timed rounds interleave the configurations' repetitions with memcpy's,
      so a change of machine load hits them alike; the first round of each
      warm load is discarded (it faults the pages in).
    * Every load is checked against the saved KV (any byte wrong raises):
      a fast wrong load is not a figure.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import numpy as np

import ucm_db

HEAD_SIZE, BLOCK, KV_HEADS = 64, 32, 4
#: Bytes of one layer of one unit (the slab placed per layer).
LAYER_UNIT_BYTES = BLOCK * 2 * HEAD_SIZE * 2


def _shape(layers: int) -> Any:
    from ucm_db.connector.identity import KVShape

    return KVShape(model=f"bench-load-{layers}", kv_dtype="bfloat16", block_size=BLOCK, use_mla=False, layout="bench-load-cpu",
                   tp_size=1, pp_size=1, kv_heads=KV_HEADS, layers=layers)


def _caches(layers: int, num_blocks: int, fill: bool) -> dict[str, Any]:
    import torch

    shape = (num_blocks, KV_HEADS, BLOCK, 2 * HEAD_SIZE)
    make = (lambda: torch.randn(shape).to(torch.bfloat16)) if fill else (lambda: torch.zeros(shape, dtype=torch.bfloat16))
    return {f"model.layers.{i}.self_attn.attn": make() for i in range(layers)}


def _transfer(keys: list[bytes], load: bool) -> Any:
    from ucm_db.connector.metadata import BlockTransfer, UcmDbConnectorMetadata

    meta = UcmDbConnectorMetadata()
    (meta.loads if load else meta.saves).append(BlockTransfer("bench", tuple(keys), tuple(range(len(keys)))))
    return meta


def _worker(path: Path, codec: str, layers: int, caches: dict[str, Any]) -> Any:
    from ucm_db.connector.settings import ConnectorSettings
    from ucm_db.connector.worker.hooks import UcmDbWorker

    settings = ConnectorSettings.from_extra_config({"path": str(path), "codec": codec, "capacity_bytes": 64 << 30,
                                                    "load_policy": "always"})
    worker = UcmDbWorker(settings, _shape(layers), len(next(iter(caches.values()))))
    worker.register_kv_caches(caches, 0, 0)
    return worker


def drop_cache(path: Path) -> None:
    """Asks the kernel to drop the page cache of every file of a store
    (closed: pages mapped by a process are kept)."""
    for file in path.rglob("*"):
        if file.is_file():
            fd = os.open(file, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


class _Timer:
    """Wall and process-CPU seconds of repeated calls."""

    def __init__(self) -> None:
        self.wall_s: list[float] = []
        self.cpu_s: list[float] = []

    def time(self, fn: Callable[[], None]) -> None:
        started, cpu = time.perf_counter(), time.process_time()
        fn()
        self.wall_s.append(time.perf_counter() - started)
        self.cpu_s.append(time.process_time() - cpu)

    def figures(self, nbytes: int, skip: int = 0) -> dict[str, float]:
        wall, cpu = statistics.median(self.wall_s[skip:]), statistics.median(self.cpu_s[skip:])
        return {"s": wall, "GBps": nbytes / wall / 1e9, "cpu_GBps": nbytes / max(cpu, 1e-9) / 1e9}


def measure(codec: str, unit_kib: int, total_mib: int, repeats: int, cold: bool, scratch: Path, save_blocks: int = 16) -> dict[str, Any]:
    """Load (warm, and cold if asked), save and memcpy figures of one codec and unit size."""
    import torch

    from ucm_db.connector.identity import namespace

    layers = max(1, unit_kib * 1024 // LAYER_UNIT_BYTES)
    unit_bytes = layers * LAYER_UNIT_BYTES
    blocks = max(1, (total_mib << 20) // (unit_bytes * KV_HEADS))
    nbytes = blocks * KV_HEADS * unit_bytes
    torch.manual_seed(0)
    source = _caches(layers, blocks, fill=True)
    keys = namespace(_shape(layers)).block_keys(list(range(blocks * BLOCK)))
    path = scratch / f"{codec}-{unit_kib}"
    saver = _worker(path, codec, layers, source)
    units = _unit_payloads(source, unit_bytes)
    put_store = ucm_db.open(scratch / f"{codec}-{unit_kib}-put", codec=codec, capacity_bytes=64 << 30)
    put_ns = ucm_db.Namespace(model=f"bench-load-put-{layers}", kv_dtype="uint8", block_size=1, layout="units")
    save_t, put_t, calls_t = _Timer(), _Timer(), _Timer()
    for r in range(repeats):  # fresh keys each time: a save of stored blocks is skipped
        fresh = namespace(_shape(layers)).block_keys([r + 1 + t for t in range(blocks * BLOCK)])
        save_t.time(lambda: _save_in_steps(saver, fresh, save_blocks, calls_t))
        put_keys = put_ns.block_keys([r * len(units) + t for t in range(len(units))])
        put_t.time(lambda: _put_in_steps(put_store, put_ns, put_keys, units, save_blocks * KV_HEADS))
    put_store.close()
    saver.save(_transfer(keys, load=False))
    saver.drain()
    saver.shutdown()

    target = _caches(layers, blocks, fill=False)
    expected = {name: t.view(torch.int16) for name, t in source.items()}
    meta = _transfer(keys, load=True)
    mem_src, mem_dst = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
    warm_t, cold_t, copy_t = _Timer(), _Timer(), _Timer()

    def load(worker: Any) -> None:
        worker.start_load(meta)
        if worker.take_load_errors():
            raise RuntimeError("a block failed to load: the figure would be meaningless")

    reader = _worker(path, codec, layers, target)
    for r in range(repeats + 1):
        warm_t.time(lambda: load(reader))
        copy_t.time(lambda: np.copyto(mem_dst, mem_src))
    _check(target, expected)
    reader.shutdown()
    if cold:
        for _ in range(repeats):
            drop_cache(path)
            worker = _worker(path, codec, layers, target)
            cold_t.time(lambda: load(worker))
            worker.shutdown()
        _check(target, expected)
    memcpy = copy_t.figures(nbytes, skip=1)
    out: dict[str, Any] = {"codec": codec, "unit_bytes": unit_bytes, "layers": layers, "blocks": blocks, "bytes": nbytes,
                           "memcpy": memcpy, "save": save_t.figures(nbytes), "save_calls": calls_t.figures(nbytes),
                           "put": put_t.figures(nbytes),
                           "load_warm": warm_t.figures(nbytes, skip=1)}
    out["save"]["x_put"] = out["save"]["GBps"] / out["put"]["GBps"]
    if cold:
        out["load_cold"] = cold_t.figures(nbytes)
    for name in ("save", "save_calls", "put", "load_warm", "load_cold"):
        if name in out:
            out[name]["x_memcpy"] = out[name]["GBps"] / memcpy["GBps"]
    return out


def _save_in_steps(worker: Any, keys: list[bytes], step_blocks: int, calls: _Timer | None = None) -> None:
    """Saves ``keys`` (blocks 0..n of the cache) ``step_blocks`` at a time,
    as an engine's steps do (each a chain segment continuing the last), then
    waits until the writer committed them all. ``calls`` gets the summed
    wall and thread CPU seconds spent inside the ``save`` calls."""
    from ucm_db.connector.metadata import BlockTransfer, UcmDbConnectorMetadata

    wall_s = cpu_s = 0.0
    for start in range(0, len(keys), step_blocks):
        stop = min(len(keys), start + step_blocks)
        meta = UcmDbConnectorMetadata()
        parent = keys[start - 1] if start else None
        meta.saves.append(BlockTransfer("bench", tuple(keys[start:stop]), tuple(range(start, stop)), parent=parent))
        started, cpu = time.perf_counter(), time.thread_time()
        worker.save(meta)
        wall_s, cpu_s = wall_s + time.perf_counter() - started, cpu_s + time.thread_time() - cpu
    worker.drain()
    if calls is not None:
        calls.wall_s.append(wall_s)
        calls.cpu_s.append(cpu_s)


def _unit_payloads(source: dict[str, Any], unit_bytes: int) -> list[bytes]:
    """Every unit's bytes of the KV in ``source`` (the put baseline's
    payloads: the bytes the saves store, so the codec sees the same data)."""
    import torch

    flat = torch.cat([t.contiguous().view(torch.uint8).reshape(-1) for t in source.values()]).numpy()
    return [flat[i:i + unit_bytes].tobytes() for i in range(0, len(flat) - unit_bytes + 1, unit_bytes)]


def _put_in_steps(store: Any, namespace: Any, keys: Any, payloads: list[bytes], step_units: int) -> None:
    """``Store.put`` of ``payloads`` under ``keys``, ``step_units`` per call
    (one transaction each, as one save call's units are)."""
    for start in range(0, len(keys), step_units):
        stop = min(len(keys), start + step_units)
        store.put(namespace, keys[start:stop], payloads[start:stop])


def _check(target: dict[str, Any], expected: dict[str, Any]) -> None:
    import torch

    for name, want in expected.items():
        if not torch.equal(target[name].view(torch.int16), want):
            raise RuntimeError(f"layer {name} was loaded wrong: the figure would be meaningless")
        target[name].zero_()


def run(codecs: tuple[str, ...], unit_kibs: tuple[int, ...], total_mib: int, repeats: int, cold: bool,
        scratch_dir: str | None = None, save_blocks: int = 16) -> list[dict[str, Any]]:
    """Every (codec, unit size) figure set (see :func:`measure`)."""
    with tempfile.TemporaryDirectory(prefix="ucm-db-bench-load-", dir=scratch_dir) as tmp:
        return [measure(c, u, total_mib, repeats, cold, Path(tmp), save_blocks) for c in codecs for u in unit_kibs]


def format_rows(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'codec':<5} {'unit':>8} {'path':<10} {'GB/s':>7} {'GB/s/CPU':>9} {'x memcpy':>9}  memcpy GB/s"]
    for row in rows:
        for name in ("load_warm", "load_cold", "save", "save_calls", "put"):
            if name in row:
                f = row[name]
                extra = f"  save/put {f['x_put']:.3f}" if "x_put" in f else ""
                lines.append(f"{row['codec']:<5} {row['unit_bytes'] >> 10:>5} KiB {name:<10} {f['GBps']:7.2f} {f['cpu_GBps']:9.2f}"
                             f" {f['x_memcpy']:9.3f}  {row['memcpy']['GBps']:.2f}{extra}")
    return "\n".join(lines)


@click.command("load", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--codec", "codecs", type=click.Choice(["none", "zstd"]), multiple=True, default=("none", "zstd"), show_default=True,
              help="store codec (repeat the option for several)")
@click.option("--unit-kib", "unit_kibs", type=click.IntRange(min=8), multiple=True, default=(16, 64, 256), show_default=True,
              help="unit size in KiB (a multiple of 8: layers of 8 KiB slabs)")
@click.option("--total-mib", type=click.IntRange(min=1), default=64, show_default=True, help="KV bytes loaded per timed load")
@click.option("--repeats", type=click.IntRange(min=1), default=5, show_default=True, help="timed repetitions (median)")
@click.option("--cold/--no-cold", default=True, show_default=True, help="also time loads with the store's page cache dropped")
@click.option("--save-blocks", type=click.IntRange(min=1), default=16, show_default=True,
              help="blocks per save call (an engine step's new blocks)")
@click.option("--scratch-dir", type=click.Path(file_okay=False), default=None, help="parent of the scratch stores")
@click.option("--json", "as_json", is_flag=True, help="print the figures as JSON")
def command(codecs: tuple[str, ...], unit_kibs: tuple[int, ...], total_mib: int, repeats: int, cold: bool,
            save_blocks: int, scratch_dir: str | None, as_json: bool) -> None:
    """A connector worker's load and save paths (no engine) against memcpy of the same bytes, same run.

    \b
    Example:
        ucm-db bench load --unit-kib 64 --codec none --repeats 5
    """
    rows = run(codecs, unit_kibs, total_mib, repeats, cold, scratch_dir, save_blocks)
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    print(f"KV cache: vLLM CPU layout, bf16, {KV_HEADS} KV heads, block {BLOCK}, head {HEAD_SIZE}; ~{total_mib} MiB per load;"
          f" medians of {repeats}")
    print(format_rows(rows))


if __name__ == "__main__":
    command()
