"""Chunked loads into KV caches on an accelerator (``connector/worker/device_loads.py``)
with a real store: every block lands at its id bit for bit across chunk and
slot boundaries, a failed block is left out, and (CUDA, where present) a
load run on another thread waits for what the model's stream queued before
it handed the load over. The CPU cases run the same code with host KV
caches (no pinning, no stream)."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

import ucm_db
from ucm_db.connector.layouts import detect_layout
from ucm_db.connector.worker import device_loads
from ucm_db.connector.worker.device_loads import DeviceLoads
from ucm_db.keys import Namespace

NUM_BLOCKS, BLOCK, HEADS, HEAD, LAYERS = 24, 16, 2, 64, 3
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _caches(device: str, fill: float | None = None) -> dict[str, torch.Tensor]:
    make = (lambda: torch.full((2, NUM_BLOCKS, BLOCK, HEADS, HEAD), fill, device=device)) if fill is not None else (
        lambda: torch.randn(2, NUM_BLOCKS, BLOCK, HEADS, HEAD, device=device))
    return {f"l{i}": make().to(torch.bfloat16) for i in range(LAYERS)}


def _saved(tmp_path: Path, source: dict[str, torch.Tensor], blocks: list[int]) -> tuple[ucm_db.Store, Namespace, list[bytes]]:
    """``blocks`` of ``source`` stored unit by unit (each head its own
    chain); the unit keys, block-major, as a worker reads them."""
    layout = detect_layout(source, NUM_BLOCKS)
    staging = layout.new_unit_staging(len(blocks))
    layout.gather_units(blocks, staging)
    ns = Namespace(model="device-loads", kv_dtype="bfloat16", block_size=BLOCK, layout="flash")
    chains = [ns.block_keys([h * 100000 + t for t in range(len(blocks) * BLOCK)]) for h in range(HEADS)]
    store = ucm_db.open(tmp_path / "store", codec="none")
    rows = staging.numpy()
    for h in range(HEADS):
        store.put(ns, chains[h], [layout.unit_frames(rows[b, h]) for b in range(len(blocks))])
    return store, ns, [chains[h][b] for b in range(len(blocks)) for h in range(HEADS)]


def _reader(store: ucm_db.Store, ns: Namespace, unit_bytes: int):  # type: ignore[no-untyped-def]
    def read(keys, rows):  # type: ignore[no-untyped-def]
        return store.get_into(ns, list(keys), ucm_db.ScatterSlabs([rows], [unit_bytes], range(len(keys))))
    return read


@pytest.mark.parametrize("device", DEVICES)
def test_a_load_of_several_chunks_lands_every_block_and_leaves_out_a_failed_one(
        tmp_path: Path, device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    source = _caches(device)
    saved = list(range(7))
    store, ns, keys = _saved(tmp_path, source, saved)
    target = _caches(device, fill=0.0)
    layout = detect_layout(target, NUM_BLOCKS)
    monkeypatch.setattr(device_loads, "CHUNK_BYTES", 2 * HEADS * layout.unit_bytes)  # chunks of 2 blocks: 4 chunks, both slots twice
    loads = DeviceLoads(layout)
    assert loads.chunk_blocks == 2
    keys[3 * HEADS + 1] = ns.block_keys(list(range(5, 5 + BLOCK)))[0]  # block 3's second unit: never stored
    with store:
        for _ in range(2):  # the pair of slots reused
            loaded, failed = loads.load(_reader(store, ns, layout.unit_bytes), keys, [10 + b for b in saved], layout.mark())
            assert loaded == [10, 11, 12, 14, 15, 16] and failed == {13}
    for name in source:
        for b in (0, 1, 2, 4, 5, 6):
            assert torch.equal(target[name][:, 10 + b].view(torch.int16), source[name][:, b].view(torch.int16))
        assert not target[name][:, 13].any() and not target[name][:, :10].any() and not target[name][:, 17:].any()


@pytest.mark.parametrize("device", DEVICES)
def test_an_empty_load_and_a_one_block_chunk(tmp_path: Path, device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    source = _caches(device)
    store, ns, keys = _saved(tmp_path, source, [4, 9])
    target = _caches(device, fill=0.0)
    layout = detect_layout(target, NUM_BLOCKS)
    monkeypatch.setattr(device_loads, "CHUNK_BYTES", 1)  # below one block: a block a chunk
    loads = DeviceLoads(layout)
    with store:
        assert loads.load(_reader(store, ns, layout.unit_bytes), [], [], None) == ([], set())
        assert loads.load(_reader(store, ns, layout.unit_bytes), keys, [0, 1], None) == ([0, 1], set())
    for name in source:
        assert torch.equal(target[name][:, :2], source[name][:, [4, 9]])


def _a_load_on_another_thread_waits_for_the_model_streams_earlier_writes(tmp_path: Path) -> None:
    """vLLM queues its work on a stream of its own; a write to the load's
    blocks queued there before the hand-over (block zeroing, a preempted
    request's last forward) must not land on the loaded bytes."""
    source = _caches("cuda")
    store, ns, keys = _saved(tmp_path, source, [0, 1, 2, 3])
    target = _caches("cuda", fill=0.0)
    layout = detect_layout(target, NUM_BLOCKS)
    loads = DeviceLoads(layout)
    model_stream = torch.cuda.Stream()
    with store, torch.cuda.stream(model_stream):
        for _ in range(3):
            torch.cuda._sleep(200_000_000)  # ~0.1 s of queued work ahead
            for t in target.values():
                t[:, 8:12].fill_(7.0)  # the model's earlier write to the blocks the load fills
            handed_over = layout.mark()
            result: list[object] = []
            thread = threading.Thread(target=lambda: result.append(
                loads.load(_reader(store, ns, layout.unit_bytes), keys, [8, 9, 10, 11], handed_over)))
            thread.start()
            thread.join()
            assert result == [([8, 9, 10, 11], set())]
            model_stream.synchronize()
            for name in source:
                assert torch.equal(target[name][:, 8:12], source[name][:, 0:4])


@pytest.mark.parametrize("device", DEVICES)
def test_a_read_that_raises_mid_load_raises_and_the_slots_stay_usable(
        tmp_path: Path, device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The store's read failing on the second chunk (a stand-in raises: a
    real store raises only on I/O faults): the error reaches the caller
    (the worker reports every block failed), and the next load lands."""
    source = _caches(device)
    store, ns, keys = _saved(tmp_path, source, [0, 1, 2, 3])
    target = _caches(device, fill=0.0)
    layout = detect_layout(target, NUM_BLOCKS)
    monkeypatch.setattr(device_loads, "CHUNK_BYTES", 2 * HEADS * layout.unit_bytes)
    loads, calls = DeviceLoads(layout), []
    read = _reader(store, ns, layout.unit_bytes)

    def failing(part, rows):  # type: ignore[no-untyped-def]
        calls.append(len(part))
        if len(calls) == 2:
            raise OSError("EIO reading the store")
        return read(part, rows)

    with store:
        with pytest.raises(OSError, match="EIO"):
            loads.load(failing, keys, [4, 5, 6, 7], None)
        assert loads.load(read, keys, [4, 5, 6, 7], None) == ([4, 5, 6, 7], set())
    for name in source:
        assert torch.equal(target[name][:, 4:8], source[name][:, 0:4])


def test_the_chunk_bound_holds_for_large_blocks() -> None:
    big = {"l0": torch.zeros(2, 4, 16, 8, 128, dtype=torch.bfloat16)}  # 64 KiB blocks, units of 8 KiB
    layout = detect_layout(big, 4)
    assert DeviceLoads(layout).chunk_blocks == device_loads.CHUNK_BYTES // layout.block_bytes
    assert np.prod((DeviceLoads(layout).chunk_blocks, layout.heads, layout.unit_bytes)) <= device_loads.CHUNK_BYTES


if torch.cuda.is_available():  # collected on a GPU host only (streams); CI has none
    test_a_load_on_another_thread_waits_for_the_model_streams_earlier_writes = (
        _a_load_on_another_thread_waits_for_the_model_streams_earlier_writes)
