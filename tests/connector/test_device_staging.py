"""Units staged for KV caches on an accelerator (``layouts.py``): pinned
host rows, one transfer each way, the strided copies on the device.

Every case runs on the CPU; where CUDA is present (a GPU host: CI has none)
the same cases run with the KV caches on it as well. The bytes are compared
bit for bit with the source blocks after a round trip through a real store.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import ucm_db
from ucm_db.connector.layouts import KVLayout, detect_layout
from ucm_db.keys import Namespace

NUM_BLOCKS, BLOCK, HEADS, HEAD, LAYERS = 6, 16, 2, 64, 3
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _flash(device: str) -> torch.Tensor:
    return torch.randn(2, NUM_BLOCKS, BLOCK, HEADS, HEAD, device=device).to(torch.bfloat16)


def _hnd(device: str) -> torch.Tensor:  # a flash cache strided head-major: not contiguous per block
    return torch.randn(2, NUM_BLOCKS, HEADS, BLOCK, HEAD, device=device).to(torch.bfloat16).transpose(2, 3)


def _mla(device: str) -> torch.Tensor:
    return torch.randn(NUM_BLOCKS, BLOCK, 576, device=device).to(torch.bfloat16)


def _kv_tuple(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.randn(NUM_BLOCKS, BLOCK, HEADS, HEAD, device=device).half(),
            torch.randn(NUM_BLOCKS, BLOCK, HEADS, HEAD, device=device).half())


def _cpu_kind(device: str) -> torch.Tensor:  # vLLM-CPU's layout; on a GPU it is staged like the others
    return torch.randn(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD, device=device).to(torch.bfloat16)


MAKERS: dict[str, Callable[[str], object]] = {"flash": _flash, "hnd": _hnd, "mla": _mla, "kv_tuple": _kv_tuple, "cpu": _cpu_kind}


def _blocks(entry: object, block: int) -> torch.Tensor:
    """Block ``block`` of every segment as raw int16 on the host (bit-exact)."""
    parts = list(entry) if isinstance(entry, tuple) else [entry[0], entry[1]] if entry.dim() == 5 else [entry]  # type: ignore[attr-defined]
    return torch.cat([p[block].reshape(-1).view(torch.int16).cpu() for p in parts])


def _zeros(entry: object) -> object:
    return tuple(torch.zeros_like(t) for t in entry) if isinstance(entry, tuple) else torch.zeros_like(entry)  # type: ignore[arg-type]


def _store_units(tmp_path: Path, layout: KVLayout, staging: torch.Tensor, codec: str) -> tuple[ucm_db.Store, Namespace, list[bytes]]:
    """Puts each staged unit under its own chain; returns the store, the
    namespace and the unit keys in staging-row order (block-major)."""
    ns = Namespace(model="m", kv_dtype="bfloat16", block_size=BLOCK, layout=layout.kind)
    blocks, heads = staging.shape[0], staging.shape[1]
    chains = [ns.block_keys([h * 1000 + t for t in range(blocks * BLOCK)]) for h in range(heads)]
    rows = staging.numpy()
    store = ucm_db.open(tmp_path / "store", codec=codec)
    for h in range(heads):
        store.put(ns, chains[h], [layout.unit_frames(rows[b, h]) for b in range(blocks)])
    return store, ns, [chains[h][b] for b in range(blocks) for h in range(heads)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", list(MAKERS))
@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_units_round_trip_through_pinned_staging_bit_exact(tmp_path: Path, device: str, kind: str, codec: str) -> None:
    torch.manual_seed(2)
    source = {f"l{i}": MAKERS[kind](device) for i in range(LAYERS)}
    layout = detect_layout(source, NUM_BLOCKS)  # type: ignore[arg-type]
    staging = layout.new_unit_staging(2)
    assert staging.device.type == "cpu" and staging.is_pinned() == (device != "cpu")
    layout.gather_units([4, 1], staging)
    store, ns, keys = _store_units(tmp_path, layout, staging, codec)
    with store:
        target = {name: _zeros(entry) for name, entry in source.items()}
        target_layout = detect_layout(target, NUM_BLOCKS)  # type: ignore[arg-type]
        rows = target_layout.new_unit_staging(2)
        flat = rows.numpy().reshape(-1)
        slabs = ucm_db.ScatterSlabs([memoryview(flat)], [rows.shape[2]], range(2 * rows.shape[1]))
        assert store.get_into(ns, keys, slabs) == [True] * len(keys)
    on_device = target_layout.staging_on_device(rows)
    assert on_device.device == target_layout.device
    assert (on_device is rows) == (device == "cpu")  # no copy where the caches are on the host
    for layer in range(LAYERS):  # layer by layer, as load_mode "layer" does, from one transfer
        target_layout.scatter_units([0, 5], on_device, layer=layer)
        target_layout.settle()
    for name in source:
        assert torch.equal(_blocks(target[name], 0), _blocks(source[name], 4))
        assert torch.equal(_blocks(target[name], 5), _blocks(source[name], 1))
        assert not any(_blocks(target[name], b).any() for b in (1, 2, 3, 4))


@pytest.mark.parametrize("device", DEVICES)
def test_a_layers_scatter_from_device_rows_touches_only_that_layer(device: str) -> None:
    source = {f"l{i}": _flash(device) for i in range(LAYERS)}
    staging = detect_layout(source, NUM_BLOCKS).new_unit_staging(1)
    detect_layout(source, NUM_BLOCKS).gather_units([2], staging)
    target = {name: torch.zeros_like(t) for name, t in source.items()}
    layout = detect_layout(target, NUM_BLOCKS)
    layout.scatter_units([3], layout.staging_on_device(staging), layer=1)
    layout.settle()
    assert torch.equal(target["l1"][:, 3], source["l1"][:, 2])
    assert not target["l1"][:, :3].any() and not target["l1"][:, 4:].any()
    assert not target["l0"].any() and not target["l2"].any()


@pytest.mark.parametrize("device", DEVICES)
def test_pageable_rows_load_the_same_bits_as_pinned_rows(device: str) -> None:
    """Staging that lost its pinning (a platform without it, or rows
    selected after a failed block) still loads, through a blocking copy."""
    source = {f"l{i}": _flash(device) for i in range(LAYERS)}
    layout = detect_layout(source, NUM_BLOCKS)
    pinned = layout.new_unit_staging(2)
    layout.gather_units([0, 3], pinned)
    pageable = pinned.clone()  # never pinned
    assert not pageable.is_pinned()
    for rows in (pinned, pageable):
        target = {name: torch.zeros_like(t) for name, t in source.items()}
        detect_layout(target, NUM_BLOCKS).scatter_units([1, 2], rows)
        detect_layout(target, NUM_BLOCKS).settle()
        for name in source:
            assert torch.equal(target[name][:, 1:3], source[name][:, [0, 3]])


@pytest.mark.parametrize("device", DEVICES)
def test_a_save_gathers_through_the_device_in_bounded_chunks(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """On an accelerator a save's units cross through device chunks of at
    most GATHER_CHUNK_BYTES (here 2 blocks' units): the rows equal one
    whole-save gather's (on the host, the rows are written directly)."""
    from ucm_db.connector import device_saves

    torch.manual_seed(4)
    source = {f"l{i}": _flash(device) for i in range(LAYERS)}
    layout = detect_layout(source, NUM_BLOCKS)
    whole = layout.new_unit_staging(5)
    layout.gather_units([5, 0, 2, 4, 1], whole)
    monkeypatch.setattr(device_saves, "GATHER_CHUNK_BYTES", 2 * HEADS * layout.unit_bytes)
    chunked = layout.new_unit_staging(5)
    layout.gather_units([5, 0, 2, 4, 1], chunked)
    assert torch.equal(chunked, whole)
    for row, block in enumerate([5, 0, 2, 4, 1]):
        target = {name: torch.zeros_like(t) for name, t in source.items()}
        detect_layout(target, NUM_BLOCKS).scatter_units([block], chunked[row : row + 1])
        assert all(torch.equal(target[n][:, block], source[n][:, block]) for n in source)


def _a_save_holds_the_blocks_as_the_forward_left_them_not_as_the_next_write() -> None:
    """On CUDA: a save queued (on its own stream) behind ~0.5 s of the
    model stream's work holds the blocks as that work left them (its last
    write included), not as the write the model stream queues right after
    the save (the next step's, into the same blocks). The save stream's
    gathers are held back a further ~0.25 s, so that write would land
    first if the model's stream did not wait for them. Whether the model's
    thread returned before that work ended is reported, not asserted
    (device_saves.py)."""
    import time

    torch.manual_seed(7)
    source = {f"l{i}": _flash("cuda") for i in range(LAYERS)}
    layout = detect_layout(source, NUM_BLOCKS)
    staging = layout.new_unit_staging(3)
    assert staging.is_pinned()
    saved = torch.tensor([1, 4, 0], device="cuda")  # on the device before the queued work: no copy that waits for it
    gather = layout.gather_on_device

    def late_gather(ids: torch.Tensor, rows: torch.Tensor) -> None:
        torch.cuda._sleep(500_000_000)  # on the save stream, before its first gather
        gather(ids, rows)

    layout.gather_on_device = late_gather  # type: ignore[method-assign]
    model_stream = torch.cuda.Stream()
    with torch.cuda.stream(model_stream):
        torch.cuda._sleep(1_000_000_000)  # about 0.5 s of the forward still queued
        for cache in source.values():
            cache[:, 1].add_(1)  # the forward's last write into a saved block
        expected = {name: cache.index_select(1, saved) for name, cache in source.items()}
        started = time.perf_counter()
        copy = layout.gather_units_async([1, 4, 0], staging)
        queued_s = time.perf_counter() - started
        for cache in source.values():
            cache.index_fill_(1, saved, 0)  # the next step's write into the same blocks
        print(f"save queued in {queued_s:.3f} s; the model stream still running after it: {not model_stream.query()}")
    copy.wait()
    target = {name: torch.zeros_like(t) for name, t in source.items()}
    detect_layout(target, NUM_BLOCKS).scatter_units([0, 1, 2], staging)
    torch.cuda.synchronize()
    assert all(torch.equal(target[name][:, :3], expected[name]) for name in source)
    assert all(not cache.index_select(1, saved).any() for cache in source.values())


if torch.cuda.is_available():  # collected on a GPU host only (streams); CI has none
    test_a_save_holds_the_blocks_as_the_forward_left_them_not_as_the_next_write = (
        _a_save_holds_the_blocks_as_the_forward_left_them_not_as_the_next_write)
