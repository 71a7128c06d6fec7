"""A zstd plane or frame is exactly one zstd frame, on every read path.

A block's checksum covers its body, but the body is whatever its writer
sealed: a crafted block can hold, where a compressed plane belongs, two
frames whose output adds up to the plane, a whole frame followed by an
empty one, or a skippable frame after it. Both decoders must then agree
that the block is corrupt: the native batch load (``_native.load_units``,
``get_into`` a ``ScatterSlabs``) once decoded every concatenated frame and
loaded such a block that the Python path called a miss, and the Python path
read the first frame and ignored what followed it (audit t06). Now each
plane must be one frame whose compressed size is the whole plane and whose
content size is the expected one, else the block is a miss (quarantined),
never loaded. Real stores; the crafted blocks go in through
``put_encoded``, which verifies only header, key and checksum.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any
from pathlib import Path

import numpy as np
import pytest
import xxhash
import zstandard

import ucm_db
from ucm_db.codec import batch_loads, split
from ucm_db.codec.header import CHECKSUM_OFFSET, FRAME_STRUCT, HEADER_BYTES, HEADER_STRUCT, MAGIC, MODE_SHUFFLE, MODE_ZSTD

RAW_BYTES = 2048
NAMESPACE = ucm_db.Namespace(model="zstd-frames", kv_dtype="bfloat16", block_size=1, layout="units")
RAW = bytes(range(256)) * (RAW_BYTES // 256)
LOW, HIGH = RAW[0::2], RAW[1::2]
NO_SIZE = zstandard.ZstdCompressor(write_content_size=False)
SIZED = zstandard.ZstdCompressor(write_content_size=True)
SKIPPABLE = struct.pack("<II", 0x184D2A50, 4) + b"junk"

#: Planes that hold the high byte plane's bytes but are not one frame of it.
BAD_PLANES = {
    "two halves, no content size": NO_SIZE.compress(HIGH[:512]) + NO_SIZE.compress(HIGH[512:]),
    "two halves, sized": SIZED.compress(HIGH[:512]) + SIZED.compress(HIGH[512:]),
    "whole frame + empty frame": SIZED.compress(HIGH) + SIZED.compress(b""),
    "whole frame + skippable frame": SIZED.compress(HIGH) + SKIPPABLE,
    "skippable frame + whole frame": SKIPPABLE + SIZED.compress(HIGH),
    "whole frame + one stray byte": SIZED.compress(HIGH) + b"\0",
    "frame claiming more": SIZED.compress(HIGH + b"\0"),
}
GOOD_PLANES = {"one sized frame": SIZED.compress(HIGH), "one frame, no content size": NO_SIZE.compress(HIGH)}


def seal(key: bytes, frames: list[tuple[int, int, int, int, int]], body: bytes) -> bytes:
    """A zstd block of ``frames`` (table rows) and ``body``, its checksum right."""
    raw_len = sum(frame[0] for frame in frames)
    table = b"".join(FRAME_STRUCT.pack(*frame) for frame in frames)
    head = bytearray(HEADER_STRUCT.pack(MAGIC, 1, 1, 0, len(frames), raw_len, len(body), key, 0) + table)
    hasher = xxhash.xxh3_64(bytes(head[:CHECKSUM_OFFSET]))
    hasher.update(bytes(8))
    hasher.update(bytes(head[HEADER_BYTES:]))
    hasher.update(body)
    struct.pack_into("<Q", head, CHECKSUM_OFFSET, hasher.intdigest())
    return bytes(head) + body


def shuffled_block(key: bytes, high_plane: bytes) -> bytes:
    """One shuffled bf16 frame: the low plane raw, the high one ``high_plane``."""
    stored = struct.pack("<2I", len(LOW), len(high_plane)) + LOW + high_plane
    return seal(key, [(RAW_BYTES, len(stored), MODE_SHUFFLE, 2, 0b10)], stored)


def zstd_block(key: bytes, frame: bytes, raw_len: int) -> bytes:
    """One whole-frame zstd frame (mode ZSTD, no shuffle) of ``raw_len`` raw bytes."""
    return seal(key, [(raw_len, len(frame), MODE_ZSTD, 1, 0)], frame)


def _read(tmp_path: Path, blob_of: Callable[[bytes], bytes], raw_bytes: int = RAW_BYTES) -> dict[str, object]:
    """Each read path on its own chain (a quarantine of one does not hide
    another): what it returned. The native path takes a read of two units
    or more (``batch_loads.batch_for``): its chain is two of the same block."""
    native_keys = NAMESPACE.block_keys([1, 2])
    [get_key], [into_key] = NAMESPACE.block_keys([3]), NAMESPACE.block_keys([4])
    blocks = [(native_keys[0], None), (native_keys[1], native_keys[0]), (get_key, None), (into_key, None)]
    with ucm_db.open(tmp_path / "s", codec="zstd", capacity_bytes=64 << 20) as store:
        try:
            store.put_encoded(NAMESPACE, [(key, parent, blob_of(key)) for key, parent in blocks])
        except ucm_db.CorruptBlockError:  # put_encoded checks each frame's claim: the bad blocks go in by hand
            _put_by_hand(store, blocks, blob_of)
        layer = np.zeros((2, raw_bytes), np.uint8)
        native = store.get_into(NAMESPACE, native_keys, ucm_db.ScatterSlabs([layer], [raw_bytes], [0, 1]))
        [got] = store.get(NAMESPACE, [get_key])
        out = bytearray(raw_bytes)
        [into] = store.get_into(NAMESPACE, [into_key], [[memoryview(out)[:1000], memoryview(out)[1000:]]])
        return {"native": all(native) and [layer[0].tobytes(), layer[1].tobytes()] or native, "get": got and bytes(got),
                "get_into": into and bytes(out), "quarantined": store.stats().quarantined}


def _put_by_hand(store: ucm_db.Store, blocks: list[tuple[bytes, bytes | None]], blob_of: Callable[[bytes], bytes]) -> None:
    """Stores sound blocks of these keys, then puts each one's ``blob_of``
    in place of its head and body (the engine's tables, as damage would):
    the read paths must still miss what put_encoded now refuses."""
    store.put_encoded(NAMESPACE, [(key, parent, shuffled_block(key, GOOD_PLANES["one sized frame"])) for key, parent in blocks])

    def replace(txn: Any) -> None:
        for key, _ in blocks:
            head, body = split(blob_of(key))
            txn.put("heads", key, bytes(head))
            txn.put("blocks", key, bytes(body))
    store._engine.write(replace)


def test_the_native_load_path_is_in_use() -> None:
    assert batch_loads.AVAILABLE, "this platform binds the native load path: the test below would not reach it"


@pytest.mark.parametrize("case", sorted(BAD_PLANES))
def test_a_plane_that_is_not_exactly_one_frame_is_a_miss_on_every_path(tmp_path: Path, case: str) -> None:
    result = _read(tmp_path, lambda key: shuffled_block(key, BAD_PLANES[case]))
    assert {path: result[path] for path in ("native", "get", "get_into")} == {"native": [False, False], "get": None, "get_into": False}
    assert result["quarantined"] >= 3


@pytest.mark.parametrize("case", sorted(GOOD_PLANES))
def test_a_plane_of_one_frame_loads_on_every_path(tmp_path: Path, case: str) -> None:
    result = _read(tmp_path, lambda key: shuffled_block(key, GOOD_PLANES[case]))
    assert result == {"native": [RAW, RAW], "get": RAW, "get_into": RAW, "quarantined": 0}


@pytest.mark.parametrize("raw_bytes", [RAW_BYTES, 256 << 10], ids=["small frame", "large frame"])
@pytest.mark.parametrize("case", ["two frames", "trailing empty frame", "trailing skippable frame", "stray byte",
                                  "no content size, runs past the table", "one frame", "one frame, no content size"])
def test_a_whole_zstd_frame_is_exactly_one_frame(tmp_path: Path, case: str, raw_bytes: int) -> None:
    """Mode ZSTD (no shuffle: the Python path only) keeps the same rule,
    whether a frame is copied into place (small) or decompressed straight
    into it (large: ``decoding._zstd_into``)."""
    raw = (RAW * (raw_bytes // RAW_BYTES + 1))[:raw_bytes]
    half = raw_bytes // 2
    frame = {
        "two frames": NO_SIZE.compress(raw[:half]) + NO_SIZE.compress(raw[half:]),
        "trailing empty frame": SIZED.compress(raw) + SIZED.compress(b""),
        "trailing skippable frame": SIZED.compress(raw) + SKIPPABLE,
        "stray byte": SIZED.compress(raw) + b"\0",
        "no content size, runs past the table": NO_SIZE.compress(raw + b"\1"),
        "one frame": SIZED.compress(raw),
        "one frame, no content size": NO_SIZE.compress(raw),
    }[case]
    result = _read(tmp_path, lambda key: zstd_block(key, frame, raw_bytes), raw_bytes)
    if case.startswith("one frame"):
        assert result == {"native": [raw, raw], "get": raw, "get_into": raw, "quarantined": 0}
    else:
        assert {path: result[path] for path in ("native", "get", "get_into")} == {"native": [False, False], "get": None, "get_into": False}


def _frames_to_walk() -> list[bytes]:
    """Frames of every block type (raw, RLE, compressed; one block and many),
    with and without a checksum and a content size, and cut or padded ones."""
    rng = np.random.default_rng(7)
    payloads = [b"", b"x", bytes(300_000), rng.integers(0, 256, 300_000, np.uint8).tobytes(),
                rng.integers(0, 4, 700_000, np.uint8).tobytes(), RAW]
    frames = []
    for payload in payloads:
        for options in ({}, {"write_checksum": True}, {"write_content_size": False}):
            frame = zstandard.ZstdCompressor(level=3, **options).compress(payload)
            frames += [frame, frame[:-1], frame + b"\0", frame + SIZED.compress(b"")]
    return frames + [SKIPPABLE, b"", b"\x28\xb5\x2f\xfd"]


def test_the_python_frame_walk_measures_frames_as_libzstd_does() -> None:
    """``decoding.zstd_frame_bytes`` (the Python path's one-frame check for
    frames decompressed into place) against ``ZSTD_findFrameCompressedSize``
    of the system's libzstd, which the native path binds."""
    import ctypes
    import ctypes.util

    from ucm_db.codec.decoding import zstd_frame_bytes

    name = ctypes.util.find_library("zstd")
    if name is None:
        pytest.skip("no system libzstd to compare with")
    lib = ctypes.CDLL(name)
    lib.ZSTD_findFrameCompressedSize.restype = ctypes.c_size_t
    lib.ZSTD_findFrameCompressedSize.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    lib.ZSTD_isError.argtypes = [ctypes.c_size_t]
    for frame in _frames_to_walk():
        found = lib.ZSTD_findFrameCompressedSize(frame, len(frame))
        expected = -1 if lib.ZSTD_isError(found) or frame[:4] != b"\x28\xb5\x2f\xfd" else found
        assert zstd_frame_bytes(memoryview(frame)) == expected, (len(frame), frame[:8].hex())
