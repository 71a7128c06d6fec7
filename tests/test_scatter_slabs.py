"""``Store.get_into`` into :class:`ucm_db.ScatterSlabs`: the same bytes, the same guarantees, fewer objects.

* Key ``i`` fills slab ``indices[i]`` of each view: the bytes a list of the
  same scatter lists gets, with either codec (``none``: the raw path's one
  native call per block; ``zstd``: the codec's path through ``slabs[i]``).
* A corrupt block is still a miss (flag False, quarantined with its
  descendants), and a block of another namespace is not read.
* Bad slabs are a ``ConfigError`` when made, before any read.
* ``gather_into`` copies the slabs back out as rows: the blocks read into them.
* Raw blocks are copied as the read transaction reads them (the tier's
  ``take``): a batch keeps no views of them, so a large load allocates no
  garbage-collected object per block that lives to the end of the call (the
  collector ran several times per load and, with a big heap, took more CPU
  than the copy: ``ucm-db bench load``).
"""

from __future__ import annotations

import gc
import threading
from pathlib import Path

import numpy as np
import pytest

import ucm_db
from ucm_db import ConfigError, Namespace, ScatterSlabs

NS = Namespace(model="slabs", kv_dtype="bfloat16", block_size=4)
LAYERS, SLAB = 3, 512  # a unit: one 512-byte slab of each of 3 "layers"


def _units(n: int, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, LAYERS * SLAB, dtype=np.uint8).tobytes() for _ in range(n)]


def _layers(slabs: int) -> list[np.ndarray]:
    return [np.zeros(slabs * SLAB, dtype=np.uint8) for _ in range(LAYERS)]


@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_get_into_slabs_fills_each_keys_slabs_like_a_list_of_scatter_lists(tmp_path: Path, codec: str) -> None:
    keys = NS.block_keys(list(range(4 * 6)))
    units = _units(6)
    indices = [5, 0, 3, 7, 1, 2]
    with ucm_db.open(tmp_path / "s", codec=codec) as store:
        store.put(NS, keys, units)
        for _ in range(2):  # the first read learns the frame table; the second takes the raw path
            layers, listed = _layers(8), _layers(8)
            slabs = ScatterSlabs([memoryview(a) for a in layers], [SLAB] * LAYERS, indices)
            assert store.get_into(NS, keys, slabs) == [True] * 6
            as_lists = ScatterSlabs([memoryview(a) for a in listed], [SLAB] * LAYERS, indices)
            assert store.get_into(NS, keys, [as_lists[i] for i in range(6)]) == [True] * 6
            assert all(np.array_equal(a, b) for a, b in zip(layers, listed))
            for i, at in enumerate(indices):
                got = b"".join(layer[at * SLAB : (at + 1) * SLAB].tobytes() for layer in layers)
                assert got == units[i]
            untouched = sorted(set(range(8)) - set(indices))
            assert not any(layer[at * SLAB : (at + 1) * SLAB].any() for layer in layers for at in untouched)


@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_a_corrupt_block_read_into_slabs_is_a_miss_and_quarantined(tmp_path: Path, codec: str) -> None:
    keys = NS.block_keys(list(range(4 * 4)))
    with ucm_db.open(tmp_path / "s", codec=codec) as store:
        store.put(NS, keys, _units(4))
        slabs = ScatterSlabs([memoryview(a) for a in _layers(4)], [SLAB] * LAYERS, range(4))
        assert store.get_into(NS, keys, slabs) == [True] * 4  # the table is known: the raw path from here

        def damage(txn: object) -> None:
            blob = bytearray(txn.get("blocks", keys[1]))  # type: ignore[attr-defined]
            blob[-1] ^= 0x40
            txn.put("blocks", keys[1], bytes(blob))  # type: ignore[attr-defined]

        store._tier.engine.write(damage)
        assert store.get_into(NS, keys, slabs) == [True, False, True, True]
        assert store.stats().quarantined == 1 and store.lookup(NS, keys) == 1
        other = Namespace(model="slabs-other", kv_dtype="bfloat16", block_size=4)
        assert store.get_into(other, keys[:1], ScatterSlabs(slabs.views, slabs.slab_bytes, [0])) == [False]


def test_bad_slabs_are_a_config_error_when_made() -> None:
    views = [memoryview(a) for a in _layers(4)]
    with pytest.raises(ConfigError, match="slab indices"):
        ScatterSlabs(views, [SLAB] * LAYERS, [0, 4])  # past the end
    with pytest.raises(ConfigError, match="slab indices"):
        ScatterSlabs(views, [SLAB] * LAYERS, [-1])
    with pytest.raises(ConfigError, match="slab sizes"):
        ScatterSlabs(views, [SLAB] * (LAYERS - 1), [0])
    with pytest.raises(ConfigError, match="positive"):
        ScatterSlabs(views, [SLAB, 0, SLAB], [0])
    with pytest.raises(ConfigError, match="writable"):
        ScatterSlabs([bytes(4 * SLAB)] * LAYERS, [SLAB] * LAYERS, [0])
    with pytest.raises(ConfigError, match="buffer"):
        ScatterSlabs([object()] * LAYERS, [SLAB] * LAYERS, [0])
    slabs = ScatterSlabs(views, [SLAB] * LAYERS, [2, 1])
    assert len(slabs) == 2 and [len(piece) for piece in slabs[0]] == [SLAB] * LAYERS and len(slabs[0:2]) == 2


@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_gather_into_gives_back_the_blocks_read_into_the_slabs(tmp_path: Path, codec: str) -> None:
    keys, units = NS.block_keys(list(range(4 * 3))), _units(3, seed=2)
    layers = _layers(6)
    slabs = ScatterSlabs([memoryview(a) for a in layers], [SLAB] * LAYERS, [5, 0, 3])
    with ucm_db.open(tmp_path, codec=codec) as store:
        store.put(NS, keys, units)
        assert store.get_into(NS, keys, slabs) == [True] * 3
    out = bytearray(3 * LAYERS * SLAB + 1)
    assert slabs.row_bytes == LAYERS * SLAB and slabs.gather_into(out) == 3 * LAYERS * SLAB
    assert bytes(out) == b"".join(units) + b"\x00"  # what a save of these slabs would store: the same units
    with pytest.raises(ConfigError, match="at least 4608 bytes"):
        slabs.gather_into(bytearray(2 * LAYERS * SLAB))  # too small: nothing written
    with pytest.raises(ConfigError, match="writable"):
        slabs.gather_into(bytes(len(out)))
    with pytest.raises(ConfigError, match="overlaps"):
        slabs.gather_into(memoryview(layers[0]))


def test_a_store_with_too_small_slabs_reads_misses_and_keeps_its_blocks(tmp_path: Path) -> None:
    keys = NS.block_keys(list(range(4 * 2)))
    with ucm_db.open(tmp_path / "s", codec="none") as store:
        store.put(NS, keys, _units(2))
        slabs = ScatterSlabs([memoryview(a) for a in _layers(2)], [SLAB] * LAYERS, [0, 1])
        assert store.get_into(NS, keys, slabs) == [True, True]
        small = ScatterSlabs([memoryview(np.zeros(2 * 100, np.uint8)) for _ in range(LAYERS)], [100] * LAYERS, [0, 1])
        assert store.get_into(NS, keys, small) == [False, False]  # blocks of another size: misses
        assert store.lookup(NS, keys) == 2


def test_raw_blocks_are_taken_as_they_are_read_and_leave_no_collector_work(tmp_path: Path) -> None:
    blocks = 4000
    keys = NS.block_keys(list(range(4 * blocks)))
    with ucm_db.open(tmp_path / "s", codec="none", capacity_bytes=64 << 20) as store:
        for start in range(0, blocks, 500):
            store.put(NS, keys[start : start + 500], _units(500, seed=start), parent=keys[start - 1] if start else None)
        layers = _layers(blocks)
        slabs = ScatterSlabs([memoryview(a) for a in layers], [SLAB] * LAYERS, range(blocks))
        assert store.get_into(NS, keys, slabs) == [True] * blocks  # learns the table
        seen: list[tuple[bytes, memoryview, memoryview] | None] = []
        assert store._tier.with_blocks(keys[:3], lambda got: seen.extend(got), take=lambda i, h, b: i != 1) is None
        assert seen[0] is None and seen[1] is not None and seen[2] is None  # taken blocks are not handed to fn
        collections = []
        loader = threading.get_ident()

        def count(phase: str, info: dict[str, int]) -> None:
            # Only collections the loading thread sets off (the store's other
            # threads allocate beside a slow load). Under full CPU this was
            # 5-20 while a cancelled helper's queued job kept its chunk's
            # views alive (CodecPool.beside drops them now): 1-2.
            if phase == "start" and threading.get_ident() == loader:
                collections.append(info["generation"])

        gc.collect()
        gc.callbacks.append(count)
        try:
            assert store.get_into(NS, keys, slabs) == [True] * blocks
        finally:
            gc.callbacks.remove(count)
        # Kept views of 4000 blocks (a tuple and two memoryviews each) ran
        # the collector about 28 times here; taken blocks keep none (the
        # margin is for the load's other allocations).
        assert len(collections) <= 6, collections


@pytest.mark.parametrize("codec", ["none", "zstd"])
@pytest.mark.parametrize("stored_bytes", [LAYERS * SLAB - 2, LAYERS * SLAB + 2])
def test_a_block_of_another_size_than_its_slabs_is_a_miss_never_a_partial_fill(
        tmp_path: Path, codec: str, stored_bytes: int, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """A unit shorter than its slabs would leave their tails as they were
    (another request's KV): it is a miss, as a longer one is, on every path
    (native batch, raw take, codec), logged, kept (not corrupt)."""
    from ucm_db.store import reads

    monkeypatch.setattr(reads._SlabFit, "_told", set())  # logged once a process: this test's first
    keys = NS.block_keys(list(range(4 * 3)))
    rng = np.random.default_rng(3)
    with ucm_db.open(tmp_path / "s", codec=codec) as store:
        store.put(NS, keys, [rng.integers(0, 256, stored_bytes, dtype=np.uint8).tobytes() for _ in range(3)])
        room = [bytearray(LAYERS * SLAB + 2) for _ in range(3)]
        for _ in range(2):  # a plain list with room reads them (and learns the frame table: the native path next)
            assert store.get_into(NS, keys, room) == [True] * 3
        layers = [np.full(3 * SLAB, 7, np.uint8) for _ in range(LAYERS)]
        slabs = ScatterSlabs([memoryview(a) for a in layers], [SLAB] * LAYERS, [0, 1, 2])
        for _ in range(2):
            assert store.get_into(NS, keys, slabs) == [False] * 3
        assert all((layer == 7).all() for layer in layers)  # not a byte written
        assert store.lookup(NS, keys) == 3 and store.stats().quarantined == 0  # sound blocks: kept
        assert f"{stored_bytes} raw bytes was read into slabs of {LAYERS * SLAB}" in caplog.text


@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_a_damaged_raw_length_is_a_corrupt_miss(tmp_path: Path, codec: str) -> None:
    """The raw length is read before the header is verified: a flipped bit
    there makes a corrupt block (quarantined), not a size error."""
    keys = NS.block_keys(list(range(4 * 3)))
    with ucm_db.open(tmp_path / "s", codec=codec) as store:
        store.put(NS, keys, _units(3))
        slabs = ScatterSlabs([memoryview(a) for a in _layers(3)], [SLAB] * LAYERS, [0, 1, 2])
        assert store.get_into(NS, keys, slabs) == [True] * 3

        def damage(txn: object) -> None:
            head = bytearray(txn.get("heads", keys[1]))  # type: ignore[attr-defined]
            head[13] ^= 0x10
            txn.put("heads", keys[1], bytes(head))  # type: ignore[attr-defined]

        store._tier.engine.write(damage)
        assert store.get_into(NS, keys, slabs) == [True, False, True]
        assert store.stats().quarantined == 1
