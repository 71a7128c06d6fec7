"""Loads and saves between the store and KV caches on an accelerator:
``ucm-db bench device-load``.

    ucm-db bench device-load [--device cuda] [--layers 8,32] [--blocks 256] [--codec none --codec zstd] [--rounds 9] [--json]

A flash-attention KV cache (``[2, blocks, block, heads, head]`` per layer,
bf16, normal values) on ``--device``; its blocks are saved through the
connector's layout (:mod:`ucm_db.connector.layouts`: the strided copies on
the device, one transfer into pinned unit staging) into a scratch store,
then loaded back into other block ids as the worker does
(:mod:`ucm_db.connector.worker.device_loads`: chunks of pinned staging, each
read through :class:`ucm_db.ScatterSlabs`, moved in one transfer and
scattered on the device, the reads split over ``load_threads: "auto"``). Timed, medians of
``--rounds`` (the ways in turns within each round), GB/s of KV bytes:

* ``h2d``: the baseline, one plain copy of the same bytes from pinned
  host memory into a device tensor (``d2h`` the other way);
* ``scatter``: the staged rows into the KV caches (the transfer half of a
  load); ``pageable``: the same from rows that are not pinned;
* ``load``: the whole load, store read included; ``save``: the gather of
  the blocks into pinned staging, waited for;
* a save behind a forward still running on the device
  (:func:`save_behind_forward`): the model thread's time in it, waited
  for or queued on the save stream (:mod:`ucm_db.connector.device_saves`),
  and a step of forward, save and next forward each way;
* where the host's time goes: ``readN``, the store read alone into the
  pinned rows over N threads (:mod:`ucm_db.connector.worker.split_reads`;
  ``load`` reads over ``load_threads: "auto"``'s count), and ``memcpy``,
  one host copy of the same bytes (the host's own limit).

Every load is checked bit for bit against the source blocks (``exact``).

Invariants:
    * ucm-db's public API and the connector's layout module only.
    * The scratch store is removed; device memory is freed with the run.
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import click
import numpy as np
import torch

import ucm_db
from ucm_db.connector.layouts import KVLayout, detect_layout
from ucm_db.connector.worker import device_loads
from ucm_db.connector.worker.device_loads import DeviceLoads
from ucm_db.connector.worker.split_reads import SplitReads, auto_load_threads
from ucm_db.tools.bench.common import int_list

BLOCK_TOKENS, HEADS, HEAD_DIM = 16, 8, 128
READ_THREADS = (1, 2, 4, 8)
WAYS = ("h2d", "d2h", "scatter", "pageable", "load", "save", "memcpy")


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.current_stream(device).synchronize()


def _timed(fn: Callable[[], None], device: torch.device) -> float:
    _sync(device)
    started = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - started


def _put_units(store: ucm_db.Store, ns: ucm_db.Namespace, layout: KVLayout, staging: torch.Tensor) -> list[bytes]:
    """Each head's units as one chain; the unit keys in staging-row order."""
    blocks, heads = int(staging.shape[0]), int(staging.shape[1])
    rows = staging.numpy()
    chains = []
    for head in range(heads):
        chain = ns.block_keys([head << 24 | t for t in range(blocks * ns.block_size)])
        for at in range(0, blocks, 64):
            store.put(ns, chain[at:at + 64], [layout.unit_frames(rows[b, head]) for b in range(at, min(at + 64, blocks))],
                      parent=chain[at - 1] if at else None)
        chains.append(chain)
    store.flush()
    return [chains[h][b] for b in range(blocks) for h in range(heads)]


def _forward(device: torch.device) -> Callable[[], None]:
    """Stand-in for a forward pass: matrix products queued on the device (a few ms on a GPU)."""
    size = 8192 if device.type != "cpu" else 128
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)

    def forward() -> None:
        for _ in range(8):
            torch.mm(a, a)
    return forward


def _negate(caches: dict[str, torch.Tensor], saved: slice) -> None:
    """The next step's write into the saved blocks, queued on the current stream (twice: the blocks as they were)."""
    for cache in caches.values():
        cache[:, saved].neg_()


def save_behind_forward(layout: KVLayout, caches: dict[str, torch.Tensor], saved: slice, staging: torch.Tensor,
                        device: torch.device, rounds: int) -> dict[str, Any]:
    """What a save costs the model's thread with a forward still running on
    the device (vLLM queues it and calls ``wait_for_save`` before it ends):
    medians in ms of the forward alone, the model thread's time in a save
    waited for (``gather_units``: the connector before device_saves.py) and in
    one queued (``gather_units_async``), and a step (forward, save, a write
    into the saved blocks as the next step's may make, the next forward, all
    done) each way; ``save_exact``: every save's rows, zeroed before it,
    equal the blocks as they were before that write."""
    forward = _forward(device)
    block_ids = list(range(saved.start, saved.stop))
    expected = staging.clone()
    layout.gather_units(block_ids, expected)
    times: dict[str, list[float]] = {k: [] for k in ("forward", "wait_save", "queue_save", "wait_step", "queue_step")}
    exact = True
    for round_index in range(rounds + 1):
        times_now = {"forward": _timed(forward, device)}
        for mode in ("wait", "queue"):
            staging.zero_()
            _sync(device)
            step_started = time.perf_counter()
            forward()
            started = time.perf_counter()
            copy = layout.gather_units_async(block_ids, staging) if mode == "queue" else None
            if copy is None:
                layout.gather_units(block_ids, staging)
            times_now[f"{mode}_save"] = time.perf_counter() - started
            _negate(caches, saved)
            forward()
            if copy is not None:
                copy.wait()
            _sync(device)
            times_now[f"{mode}_step"] = time.perf_counter() - step_started
            exact &= torch.equal(staging, expected)
            _negate(caches, saved)
        if round_index:
            for name, value in times_now.items():
                times[name].append(value)
    _sync(device)
    return {**{f"{name}_ms": statistics.median(values) * 1e3 for name, values in times.items()}, "save_exact": exact}


def run_once(device_name: str, layers: int, blocks: int, codec: str, rounds: int) -> dict[str, Any]:
    """One model depth and codec: GB/s of each way, ratios, and ``exact``."""
    device = torch.device(device_name)
    gen = torch.Generator(device=device).manual_seed(layers)
    caches = {f"model.layers.{i}.attn": torch.randn((2, 2 * blocks, BLOCK_TOKENS, HEADS, HEAD_DIM), generator=gen,
                                                     device=device).to(torch.bfloat16) for i in range(layers)}
    layout = detect_layout(caches, 2 * blocks)
    source, target = list(range(blocks)), list(range(blocks, 2 * blocks))
    kv_bytes = blocks * layout.block_bytes
    staging = layout.new_unit_staging(blocks)
    loaded = layout.new_unit_staging(blocks)
    pageable = torch.empty(loaded.shape, dtype=torch.uint8)
    on_device = torch.empty(loaded.shape, dtype=torch.uint8, device=device)
    ns = ucm_db.Namespace(model="bench/device-load", kv_dtype="bfloat16", block_size=BLOCK_TOKENS, layout="flash")
    path = tempfile.mkdtemp(prefix="ucm-db-bench-device-")
    load_threads = auto_load_threads(device.type != "cpu", layout.unit_bytes)
    read_threads = {f"read{n}": SplitReads(n) for n in READ_THREADS}
    loader = SplitReads(load_threads)
    chunked = DeviceLoads(layout)
    seconds: dict[str, list[float]] = {w: [] for w in (*WAYS, *read_threads)}
    rows = memoryview(loaded.numpy().reshape(-1))
    try:
        with ucm_db.open(path, codec=codec, capacity_bytes=3 * kv_bytes + (256 << 20)) as store:
            layout.gather_units(source, staging)
            keys = _put_units(store, ns, layout, staging)

            def read(reads: SplitReads) -> None:
                if not all(reads.get_into(store, ns, keys, rows, layout.unit_bytes)):
                    raise RuntimeError("a unit did not load")

            def load() -> None:  # the worker's: chunks of pinned staging, the reads split over load_threads
                done, failed = chunked.load(lambda part, into: loader.get_into(store, ns, part, into, layout.unit_bytes),
                                            keys, target, layout.mark())
                if failed or len(done) != blocks:
                    raise RuntimeError(f"{len(failed)} blocks did not load")

            ways = {
                "h2d": lambda: on_device.copy_(loaded, non_blocking=True),
                "d2h": lambda: loaded.copy_(on_device),
                "scatter": lambda: layout.scatter_units(target, loaded),
                "pageable": lambda: layout.scatter_units(target, pageable),
                "load": load,
                "save": lambda: layout.gather_units(source, staging),
                **{name: partial(read, reads) for name, reads in read_threads.items()},
                "memcpy": lambda: np.copyto(pageable.numpy(), staging.numpy()),
            }
            exact = True
            for round_index in range(rounds + 1):  # one untimed round: allocators and page cache warm
                for name, way in ways.items():
                    if name == "load":  # the target blocks zeroed (untimed), so every round's check can fail
                        for cache in caches.values():
                            cache[:, blocks:].zero_()
                    elapsed = _timed(way, device)
                    if round_index:
                        seconds[name].append(elapsed)
                    if name == "load":
                        exact &= all(torch.equal(caches[n][:, blocks:], caches[n][:, :blocks]) for n in caches)
            behind = save_behind_forward(layout, caches, slice(0, blocks), staging, device, rounds)
    finally:
        for reads in (loader, *read_threads.values()):
            reads.close()
        shutil.rmtree(path, ignore_errors=True)
    gbps = {name: kv_bytes / statistics.median(times) / 1e9 for name, times in seconds.items()}
    return {"device": str(device), "layers": layers, "blocks": blocks, "unit_kib": layout.unit_bytes >> 10, "codec": codec,
            "pinned": bool(loaded.is_pinned()), "exact": exact, "load_threads": load_threads,
            "chunk_mib": device_loads.CHUNK_BYTES >> 20, **{f"{n}_GBps": v for n, v in gbps.items()},
            "scatter_vs_h2d": gbps["scatter"] / gbps["h2d"], "load_vs_h2d": gbps["load"] / gbps["h2d"],
            "save_vs_d2h": gbps["save"] / gbps["d2h"], **behind}


@click.command("device-load", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--device", default="cuda" if torch.cuda.is_available() else "cpu", show_default="cuda where present",
              help="where the KV caches are (cuda, cpu, ...)")
@click.option("--layers", default="8,32", show_default=True, callback=int_list, help="model depths (unit = 8 KiB a layer)")
@click.option("--blocks", type=click.IntRange(min=1), default=256, show_default=True, help="blocks loaded per round")
@click.option("--codec", "codecs", type=click.Choice(["none", "zstd"]), multiple=True, default=("none", "zstd"),
              show_default=True, help="store codec (repeat the option for several)")
@click.option("--chunk-mib", type=click.IntRange(min=1), default=None,
              help="the chunk of a load's staging (default: the connector's, device_loads.CHUNK_BYTES)")
@click.option("--rounds", type=click.IntRange(min=1), default=9, show_default=True, help="timed rounds (medians)")
@click.option("--json", "as_json", is_flag=True, help="print JSON only")
def command(device: str, layers: list[int], blocks: int, codecs: tuple[str, ...], chunk_mib: int | None, rounds: int,
            as_json: bool) -> None:
    """Loads into (and saves from) KV caches on an accelerator against a plain pinned copy.

    \b
    Example:
        ucm-db bench device-load
        ucm-db bench device-load --device cuda --layers 32 --codec none --rounds 5
    """
    if chunk_mib is not None:
        device_loads.CHUNK_BYTES = chunk_mib << 20
    rows = [run_once(device, depth, blocks, codec, rounds) for depth in layers for codec in codecs]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    for r in rows:
        click.echo(f"{r['device']} {r['layers']:>2} layers ({r['unit_kib']} KiB units) {r['codec']:<4} pinned={r['pinned']} "
                   f"exact={r['exact']}: h2d {r['h2d_GBps']:.2f}, scatter {r['scatter_GBps']:.2f} "
                   f"({r['scatter_vs_h2d']:.2f}x), pageable {r['pageable_GBps']:.2f}, load {r['load_GBps']:.2f} "
                   f"({r['load_vs_h2d']:.2f}x), d2h {r['d2h_GBps']:.2f}, save {r['save_GBps']:.2f} "
                   f"({r['save_vs_d2h']:.2f}x); load threads {r['load_threads']}; host: "
                   + ", ".join(f"read{n} {r[f'read{n}_GBps']:.2f}" for n in READ_THREADS) + f", memcpy {r['memcpy_GBps']:.2f} GB/s; "
                   f"behind a {r['forward_ms']:.1f} ms forward, the model thread's save: waited {r['wait_save_ms']:.2f} ms, "
                   f"queued {r['queue_save_ms']:.2f} ms; step {r['wait_step_ms']:.1f} / {r['queue_step_ms']:.1f} ms "
                   f"(save_exact={r['save_exact']})")


if __name__ == "__main__":
    command()
