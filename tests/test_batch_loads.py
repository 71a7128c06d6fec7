"""Reads into a KV cache's slabs through one native call per thread (ucm_db.codec.batch_loads).

* The C functions it binds agree with xxhash and zstandard, and the C side's
  copy of the block layout is the codec's; XXH3's update is the library's
  runtime-dispatched one (AVX2 here) where it exports it.
* ``Store.get_into`` into ``ScatterSlabs`` loads through it exactly the
  bytes the Python path loads, for codec ``none`` and for zstd of shuffled
  frames, with the caller and a codec thread sharing the units.
* A corrupt unit is still a miss and quarantined (with its descendants),
  and a unit the native path declines (a table not seen yet, zstd frames
  that are not shuffled) still loads by the Python path.
* ``CodecPool.beside`` cancels a helper that has not started, so a caller
  never waits for a busy pool, and drops what the helper held at once.
* ``UCM_DB_BATCH_LOADS=0`` turns the native path off.
* ``load_units`` rejects batches of the wrong shape, and the claimed-units
  counter makes every unit one thread's.
"""

from __future__ import annotations

import gc
import os
import platform
import subprocess
import sys
import threading
import weakref
from pathlib import Path

import numpy as np
import pytest
import xxhash

import ucm_db
from ucm_db.codec import batch_loads, native
from ucm_db import codec
from ucm_db.codec.header import CHECKSUM_OFFSET, FRAME_STRUCT, HEADER_BYTES, MODE_SHUFFLE
from ucm_db.codec.pool import CodecPool
from ucm_db.codec.slabs import ScatterSlabs

LAYERS, SLAB_BYTES, UNITS = 8, 4096, 40


def _units(seed: int) -> list[bytes]:
    """bf16-like units (their top byte plane compresses, the other does not)."""
    values = np.random.default_rng(seed).standard_normal(UNITS * LAYERS * SLAB_BYTES // 2).astype(np.float32)
    raw = (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()
    unit_bytes = LAYERS * SLAB_BYTES
    return [raw[i * unit_bytes : (i + 1) * unit_bytes] for i in range(UNITS)]


def _namespace() -> ucm_db.Namespace:
    return ucm_db.Namespace(model="batch-loads", kv_dtype="bfloat16", block_size=1, layout="units")


def _store(path: Path, codec_name: str) -> tuple[ucm_db.Store, list[bytes], list[bytes]]:
    store = ucm_db.open(path, codec=codec_name, capacity_bytes=1 << 30)
    keys = _namespace().block_keys(list(range(UNITS)))
    payloads = _units(len(codec_name))
    store.put(_namespace(), keys, [ucm_db.Framed(p, (SLAB_BYTES,) * LAYERS) for p in payloads])
    return store, keys, payloads


def _slabs() -> tuple[list[np.ndarray], ScatterSlabs]:
    layers = [np.zeros((UNITS + 3, SLAB_BYTES), np.uint8) for _ in range(LAYERS)]
    order = list(range(UNITS + 2, 2, -1))  # units land in reverse, off the first slabs
    return layers, ScatterSlabs(layers, [SLAB_BYTES] * LAYERS, order)


def _unit(layers: list[np.ndarray], slabs: ScatterSlabs, i: int) -> bytes:
    return b"".join(layer[slabs.indices[i]].tobytes() for layer in layers)


def test_the_bound_functions_agree_with_xxhash_and_zstandard_and_the_layout_matches() -> None:
    assert batch_loads.AVAILABLE, "the native load path should bind on this platform (the xxhash wheel exports XXH3)"
    ext = native.extension()
    data = os.urandom(200_000)
    for cut in (0, 1, 67, 4096, 199_999):
        assert ext.xxh3_parts((data[:cut], data[cut:])) == xxhash.xxh3_64(data).intdigest()
    import zstandard
    frame = zstandard.ZstdCompressor(level=1).compress(data[:5000] * 7)
    assert ext.zstd_decompress(frame, 35_000) == data[:5000] * 7
    assert ext.zstd_decompress(frame, 34_999) is None and ext.zstd_decompress(b"not zstd", 10) is None
    # _native_loads.c's constants
    assert (HEADER_BYTES, CHECKSUM_OFFSET, FRAME_STRUCT.size, MODE_SHUFFLE) == (68, 60, 24, 2)


def test_xxh3_is_bound_to_the_dispatched_update_which_digests_alike() -> None:
    """The baseline update is SSE2 only; the dispatched one picks AVX2 where
    the CPU has it (twice the hash rate): bound whenever the library exports
    it, and bit-identical across stripe and block boundaries."""
    import ctypes

    assert batch_loads.AVAILABLE
    ext = native.extension()
    library = ctypes.CDLL(batch_loads._library_candidates()[0][0])
    exported = hasattr(library, "XXH3_64bits_update_dispatch")
    if platform.machine() in ("x86_64", "AMD64"):
        assert exported, "the xxhash wheel exports its dispatched functions on x86-64 (xxh_x86dispatch.c)"
    assert ext.xxh3_update_name() == ("XXH3_64bits_update_dispatch" if exported else "XXH3_64bits_update")
    data = os.urandom(3 << 20)
    for size in (0, 1, 16, 63, 64, 65, 239, 240, 241, 1023, 1024, 1025, 65_536, 65_537, 3 << 20):
        for cut in {0, size // 3, size}:
            assert ext.xxh3_parts((data[:cut], data[cut:size])) == xxhash.xxh3_64(data[:size]).intdigest(), (size, cut)


@pytest.mark.parametrize("codec_name", ["none", "zstd"])
def test_get_into_slabs_loads_what_the_python_path_loads(tmp_path: Path, codec_name: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    store, keys, payloads = _store(tmp_path / "s", codec_name)
    with store:
        layers, slabs = _slabs()
        store.get_into(_namespace(), keys, slabs)  # first read: the codec path learns the raw tables
        calls: list[int] = []
        load_units = native.extension().load_units
        counting = _Counting(load_units, calls, meet=True)
        monkeypatch.setattr(batch_loads.native, "extension", lambda: counting)
        for layer in layers:
            layer[:] = 0
        assert store.get_into(_namespace(), keys, slabs) == [True] * UNITS
        assert [_unit(layers, slabs, i) for i in range(UNITS)] == payloads
        assert not any(layer[:3].any() for layer in layers)  # nothing outside the units' slabs
        assert len(calls) == 2 and sum(calls) == UNITS  # the caller and a codec thread shared the units
        monkeypatch.setattr(batch_loads, "AVAILABLE", False)  # the Python path, for comparison
        python_layers, python_slabs = _slabs()
        assert store.get_into(_namespace(), keys, python_slabs) == [True] * UNITS
        assert all(np.array_equal(a, b) for a, b in zip(layers, python_layers))


_PLAN_UNITS = native.extension().plan_units if native.extension() is not None else None


class _Counting:
    """The extension with ``load_units`` counting the units each call claimed.

    With ``meet``, the first call waits (up to 10 s) until a second one has
    begun: on a busy host the caller could otherwise claim every unit before
    the codec thread starts, and the helper, cancelled unstarted, would
    never call (the sharing is then untested, not wrong)."""

    def __init__(self, load_units, calls: list[int], meet: bool = False) -> None:
        self._load_units, self._calls = load_units, calls
        self.plan_units = _PLAN_UNITS
        self._entered = threading.Semaphore(0) if meet else None
        self._lock = threading.Lock()
        self._calls_begun = 0

    def load_units(self, *args):
        if self._entered is not None:
            with self._lock:
                self._calls_begun += 1
                first = self._calls_begun == 1
            if first:
                assert self._entered.acquire(timeout=10), "no second load_units call began: no helper ran beside the caller"
            else:
                self._entered.release()
        claimed = self._load_units(*args)
        self._calls.append(claimed)
        return claimed


@pytest.mark.parametrize("codec_name", ["none", "zstd"])
def test_a_corrupt_unit_is_a_quarantined_miss_and_the_others_load(tmp_path: Path, codec_name: str) -> None:
    store, keys, payloads = _store(tmp_path / "s", codec_name)
    with store:
        layers, slabs = _slabs()
        store.get_into(_namespace(), keys, slabs)

        def flip(txn) -> None:
            body = bytearray(txn.get("blocks", keys[7]))
            body[len(body) // 2] ^= 0x20
            txn.put("blocks", keys[7], bytes(body))

        store._tier.engine.write(flip)
        got = store.get_into(_namespace(), keys, slabs)
        assert got == [i != 7 for i in range(UNITS)]
        assert [_unit(layers, slabs, i) for i in range(UNITS) if i != 7] == payloads[:7] + payloads[8:]
        assert store.stats().quarantined >= 1 and store.lookup(_namespace(), keys) == 7  # with its descendants
        assert store.get(_namespace(), [keys[7]]) == [None]


def test_units_the_native_path_declines_load_by_the_python_path(tmp_path: Path) -> None:
    ns = ucm_db.Namespace(model="batch-loads", kv_dtype="uint8", block_size=1, layout="units")  # zstd, unshuffled
    with ucm_db.open(tmp_path / "s", codec="zstd", capacity_bytes=1 << 30) as store:
        keys = ns.block_keys(list(range(UNITS)))
        payloads = _units(3)
        store.put(ns, keys, [ucm_db.Framed(p, (SLAB_BYTES,) * LAYERS) for p in payloads])
        layers, slabs = _slabs()
        assert store.get_into(ns, keys, slabs) == [True] * UNITS
        assert [_unit(layers, slabs, i) for i in range(UNITS)] == payloads


def test_the_environment_switch_turns_the_native_path_off() -> None:
    code = "from ucm_db.codec import batch_loads; print(batch_loads.AVAILABLE)"
    for value, expected in (("0", "False"), ("1", "True")):
        env = {**os.environ, "UCM_DB_BATCH_LOADS": value}
        assert subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout.strip() == expected


def test_batch_checksum_reads_the_head_once_and_refuses_what_the_fast_path_refuses() -> None:
    from ucm_db.codec import raw_loads
    key, other = bytes(range(32)), bytes(32)
    raw = os.urandom(2 * SLAB_BYTES)
    head, body = (bytes(p) for p in codec.split(codec.encode(key, [raw[:SLAB_BYTES], raw[SLAB_BYTES:]], codec="none")))
    codec.decode(head + body, key)  # the codec's path learns the table
    stored = int.from_bytes(head[CHECKSUM_OFFSET:HEADER_BYTES], "little")
    assert raw_loads.batch_checksum(head, len(body), key, None) == (False, stored)
    assert raw_loads.batch_checksum(head, len(body), other, None) is None  # another key's block
    assert raw_loads.batch_checksum(head, len(body) - 1, key, None) is None  # body cut short
    zhead, zbody = (bytes(p) for p in codec.split(codec.encode(key, [raw], codec="zstd", element_bytes=2)))
    zstored = int.from_bytes(zhead[CHECKSUM_OFFSET:HEADER_BYTES], "little")
    assert raw_loads.batch_checksum(zhead, len(zbody), key, len(raw) + 1) == (True, zstored)
    assert raw_loads.batch_checksum(zhead, len(zbody), key, len(raw)) is None  # frames for the codec threads


class _Held:
    """An object a weak reference can watch."""


def test_beside_cancels_a_helper_that_has_not_started() -> None:
    pool = CodecPool(1)
    release = threading.Event()
    try:
        busy = pool.beside(release.wait)  # the pool's one thread is now taken
        ran: list[int] = []
        chunk = _Held()  # stands for a chunk's views of a read transaction

        def helper(held: _Held = chunk) -> None:
            ran.append(1)

        join = pool.beside(helper)
        assert join is not None and busy is not None
        alive = weakref.ref(chunk)
        del chunk, helper
        join()  # returns at once: cancelled, never waits for the busy thread
        gc.collect()
        # The cancelled job still waits in the pool's queue, but holds nothing
        # (under load, views held that way ran the collector during loads).
        assert alive() is None
        release.set()
        busy()
        assert ran == []
    finally:
        release.set()
        pool.shutdown()
    assert CodecPool(0).beside(lambda: None) is None


def test_load_units_rejects_bad_batches_and_claims_each_unit_once() -> None:
    ext = native.extension()
    key = bytes(range(32))
    payload = os.urandom(2 * SLAB_BYTES)
    head, body = codec.split(codec.encode(key, [payload[:SLAB_BYTES], payload[SLAB_BYTES:]], codec="none"))
    checksum = int.from_bytes(bytes(head)[CHECKSUM_OFFSET:HEADER_BYTES], "little")
    layers = [bytearray(3 * SLAB_BYTES) for _ in range(2)]
    args = [[memoryview(head)] * 3, [memoryview(body)] * 3, bytes([1, 1, 0]), checksum.to_bytes(8, "little") * 3,
            tuple(memoryview(layer) for layer in layers), (SLAB_BYTES, SLAB_BYTES), [0, 1, 2], bytearray(11), 2, 1 << 16]
    assert ext.load_units(*args) == 3
    assert list(args[7][8:]) == [1, 1, 3]  # kind 0 is declined, never loaded
    assert ext.load_units(*args) == 0  # every unit claimed already
    assert bytes(layers[0][:SLAB_BYTES]) + bytes(layers[1][:SLAB_BYTES]) == payload
    bad = list(args)
    bad[3] = bad[3][:8]
    with pytest.raises(ValueError, match="checksums 8n"):
        ext.load_units(*bad)
    bad = list(args)
    bad[6] = [0, 1]
    with pytest.raises(ValueError, match="one entry per unit"):
        ext.load_units(*bad)
    args[7], args[3] = bytearray(11), (checksum ^ 1).to_bytes(8, "little") * 3  # a wrong checksum: declined
    ext.load_units(*args)
    assert list(args[7][8:]) == [3, 3, 3]
