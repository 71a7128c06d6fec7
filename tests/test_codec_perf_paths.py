"""The fast paths added for the benchmark targets still mean the same thing.

* keys: the copied-hasher chain loop equals the documented derivation
  ``key[i] = blake2b-256(key[i-1] || uint32-LE tokens of block i)``.
* codec: the one-pass shuffle and two-pass unshuffle invert each other for
  2- and 4-byte elements, also on unaligned input; plane frames made with the
  tuned level-1 parameters are ordinary zstd frames; the top (sign/exponent)
  plane is compressed without a probe, the mantissa plane stays raw when it
  does not shrink.
* codec pool: only blocks of large frames go to its threads.
* codec ``none``: a block of raw frames is decoded with one copy of its
  body; any table the one copy would not honour (a frame not raw, a stored
  length other than the raw one) goes through the frame-by-frame decode,
  which refuses it.
* codec ``zstd``: a block of shuffled frames decodes straight into a
  scatter list cut at elements (no scratch buffer), and into one cut inside
  an element through the scratch buffer: the same bytes either way.
"""

from __future__ import annotations

import hashlib
import struct
import threading
import time
from array import array

import numpy as np
import pytest
import zstandard

from ucm_db import codec
from ucm_db.codec import decoding as codec_decode, encoding as codec_encode, header as codec_format, pool as codec_pool
from ucm_db.codec.pool import CodecPool
from ucm_db.keys import Namespace

KEY = bytes(range(32))
NS = Namespace(model="perf-paths", kv_dtype="bfloat16", block_size=16)


def _reference_keys(namespace: Namespace, tokens: list[int]) -> list[bytes]:
    prev = namespace.root_key()
    out = []
    size = namespace.block_size
    for start in range(0, len(tokens) // size * size, size):
        chunk = struct.pack(f"<{size}I", *tokens[start : start + size])
        prev = hashlib.blake2b(prev + chunk, digest_size=32).digest()
        out.append(prev)
    return out


@pytest.mark.parametrize("kind", ["list", "tuple", "numpy32", "numpy64", "array_I", "array_l"])
def test_block_keys_match_the_documented_derivation(kind: str) -> None:
    tokens = [(i * 7919 + 13) % 50_000 for i in range(16 * 37 + 5)]  # 37 full blocks and a partial one
    converted = {
        "list": tokens, "tuple": tuple(tokens),
        "numpy32": np.array(tokens, dtype=np.int32), "numpy64": np.array(tokens, dtype=np.int64),
        "array_I": array("I", tokens), "array_l": array("l", tokens),
    }[kind]
    assert NS.block_keys(converted) == _reference_keys(NS, tokens)


def _bf16_like(n_elements: int, seed: int = 0) -> np.ndarray:
    values = np.random.default_rng(seed).standard_normal(n_elements).astype(np.float32)
    return (values.view(np.uint32) >> 16).astype(np.uint16)


@pytest.mark.parametrize("element_bytes", [2, 4])
@pytest.mark.parametrize("offset", [0, 1])
def test_shuffle_then_unshuffle_is_identity_even_unaligned(element_bytes: int, offset: int) -> None:
    data = np.random.default_rng(element_bytes + offset).integers(0, 256, 4096 * element_bytes, dtype=np.uint8)
    backing = bytearray(offset) + bytearray(data.tobytes())
    view = memoryview(backing)[offset:]
    planes = codec_encode._shuffle(view, element_bytes)
    assert len(planes) == element_bytes
    words = data.view("<u2" if element_bytes == 2 else "<u4")
    for i, plane in enumerate(planes):  # plane i holds byte i of every element
        assert bytes(plane) == ((words >> (8 * i)) & 0xFF).astype(np.uint8).tobytes()
    out = bytearray(len(data) + offset)
    codec_decode._unshuffle(planes, memoryview(out)[offset:], element_bytes)
    assert bytes(out[offset:]) == data.tobytes()


def test_plane_frames_are_plain_zstd_and_only_the_top_plane_shrinks() -> None:
    raw = _bf16_like(1 << 16).tobytes()
    blob = codec.encode(KEY, raw, codec="zstd", element_bytes=2, level=1)
    table_at = codec.HEADER_BYTES
    _raw_len, stored_len, mode, elem, mask = struct.unpack_from("<QQBBB5x", blob, table_at)
    assert (mode, elem, mask) == (codec.MODE_SHUFFLE, 2, 0b10)  # mantissa raw, sign/exponent compressed
    body = memoryview(blob)[table_at + 24 : table_at + 24 + stored_len]
    low_len, high_len = struct.unpack_from("<2I", body, 0)
    high = body[8 + low_len : 8 + low_len + high_len]
    plain = zstandard.ZstdDecompressor().decompress(high)
    assert plain == raw[1::2]  # little-endian: byte 1 of each element
    assert bytes(codec.decode(blob, KEY)) == raw


def test_a_frame_no_plane_of_which_compresses_is_stored_raw_and_round_trips() -> None:
    # Stored raw, not as raw planes: a read is one copy, no plane merge.
    raw = np.random.default_rng(3).integers(0, 256, 1 << 17, dtype=np.uint8).tobytes()
    blob = codec.encode(KEY, raw, codec="zstd", element_bytes=2)
    _raw_len, _stored, mode, _elem, mask = struct.unpack_from("<QQBBB5x", blob, codec.HEADER_BYTES)
    assert mode == codec.MODE_RAW and mask == 0
    assert bytes(codec.decode(blob, KEY)) == raw
    # Blocks written before that hold the frame as raw planes: still read.
    planes = [bytes(p) for p in codec_encode._shuffle(memoryview(raw), 2)]
    table = [struct.pack("<QQBBB5x", len(raw), 8 + len(raw), codec.MODE_SHUFFLE, 2, 0)]
    parts = [struct.pack("<2I", *(len(p) for p in planes)), *planes]
    older = codec_encode._sealed(KEY, "zstd", table, parts, len(raw), 8 + len(raw)).blob()
    assert bytes(codec.decode(older, KEY)) == raw


@pytest.mark.parametrize("level", [1, 3, -1])
def test_other_levels_round_trip_with_their_own_compressor(level: int) -> None:
    raw = _bf16_like(1 << 14, seed=level + 10).tobytes()
    blob = codec.encode(KEY, raw, codec="zstd", element_bytes=2, level=level)
    assert bytes(codec.decode(blob, KEY)) == raw
    tuned = codec_encode._compressor(level, planes=True)
    assert (tuned is codec_encode._compressor(1, planes=True)) == (level == 1)


@pytest.mark.parametrize(("frame_bytes", "on_pool"), [(8 << 10, False), (codec_pool.POOL_MIN_FRAME_BYTES, True)])
def test_codec_pool_takes_only_blocks_of_large_frames(frame_bytes: int, on_pool: bool) -> None:
    """Small frames stay on the caller's thread (per-frame Python holds the
    GIL: 2 threads decoded 8 KiB frames at 0.45x); large ones go to the pool."""
    pool = CodecPool(2)
    try:
        frames = (frame_bytes,) * 2
        payload = np.random.default_rng(1).standard_normal(frame_bytes).astype(np.float16).view(np.uint8)
        items = [(bytes([i]) * 32, codec.Framed(payload, frames)) for i in range(3)]
        encoded = pool.encode_many(items, codec_name="zstd", element_bytes=2, level=1)
        threads: list[str] = []

        def decode(i: int, head: memoryview, body: memoryview) -> bytearray:
            threads.append(threading.current_thread().name)
            return codec.decode_parts(head, body, items[i][0])

        blocks = [(memoryview(block.head), memoryview(bytes(block.body_buffer()))) for block in encoded]
        decoded = pool.decode_blocks(blocks, decode)
        assert all(bytes(d) == payload.tobytes() for d in decoded)  # type: ignore[union-attr]
        assert all(name.startswith("ucm-db-codec") == on_pool for name in threads), threads
    finally:
        pool.shutdown()


def test_a_failing_pool_decode_raises_only_once_every_decode_ended() -> None:
    """The blocks are views of the caller's read transaction: no decode may
    still run once decode_blocks has raised (and the read has ended)."""
    pool = CodecPool(2)
    try:
        frames = (codec_pool.POOL_MIN_FRAME_BYTES,) * 2
        payload = np.random.default_rng(2).standard_normal(frames[0]).astype(np.float16).view(np.uint8)
        items = [(bytes([i]) * 32, codec.Framed(payload, frames)) for i in range(3)]
        encoded = pool.encode_many(items, codec_name="zstd", element_bytes=2, level=1)
        ended: list[int] = []

        def decode(i: int, head: memoryview, body: memoryview) -> bytearray:
            if i == 0:
                raise ValueError("the first block fails at once")
            time.sleep(0.2)
            ended.append(i)
            return codec.decode_parts(head, body, items[i][0])

        blocks = [(memoryview(block.head), memoryview(bytes(block.body_buffer()))) for block in encoded]
        with pytest.raises(ValueError, match="fails at once"):
            pool.decode_blocks(blocks, decode)
        assert sorted(ended) == [1, 2]
    finally:
        pool.shutdown()


def _resealed(blob: bytes, table: list[tuple[int, int, int, int, int]]) -> bytes:
    """``blob`` with its frame table replaced (same frame count) and the
    checksum recomputed: a table only a buggy or hostile writer makes."""
    from undecodable import resealed_head

    head_bytes = codec.head_bytes(blob)
    head = bytearray(blob[:head_bytes])
    for i, entry in enumerate(table):
        codec_format.FRAME_STRUCT.pack_into(head, codec.HEADER_BYTES + i * codec_format.FRAME_STRUCT.size, *entry)
    return resealed_head(head, blob[head_bytes:]) + blob[head_bytes:]


def test_codec_none_frames_decode_with_one_copy_and_odd_tables_are_refused() -> None:
    frames = [bytes([i]) * 8192 for i in range(8)]
    blob = codec.encode(KEY, frames, codec="none")
    out = bytearray(8 * 8192)
    assert codec.decode_into(blob, KEY, out) == len(out) and bytes(out) == b"".join(frames)
    # Other frame boundaries over the same raw bytes: still the same bytes.
    regrouped = _resealed(blob, [(4096, 4096, codec.MODE_RAW, 0, 0), (12288, 12288, codec.MODE_RAW, 0, 0)] + [(8192, 8192, codec.MODE_RAW, 0, 0)] * 6)
    assert codec.decode(regrouped, KEY) == b"".join(frames)
    # A frame that claims zstd, or a raw frame longer than it is stored: refused, not copied.
    zstd_claim = _resealed(blob, [(8192, 8192, codec.MODE_ZSTD, 0, 0)] + [(8192, 8192, codec.MODE_RAW, 0, 0)] * 7)
    with pytest.raises(codec.CorruptBlockError):
        codec.decode(zstd_claim, KEY)
    uneven = _resealed(blob, [(12288, 4096, codec.MODE_RAW, 0, 0), (4096, 12288, codec.MODE_RAW, 0, 0)] + [(8192, 8192, codec.MODE_RAW, 0, 0)] * 6)
    with pytest.raises(codec.CorruptBlockError):
        codec.decode_into(uneven, KEY, bytearray(8 * 8192))


@pytest.mark.parametrize("frame_kib", [8, 200])  # one frame of eight grouped 8 KiB layers; three frames of their own
def test_zstd_shuffled_frames_merge_straight_into_a_scatter_list(frame_kib: int, monkeypatch: pytest.MonkeyPatch) -> None:
    frame_bytes = frame_kib << 10
    n_frames = 8 if frame_kib == 8 else 3
    raw = _bf16_like(n_frames * frame_bytes // 2, seed=frame_kib).tobytes()
    blob = codec.encode(KEY, [raw[i * frame_bytes : (i + 1) * frame_bytes] for i in range(n_frames)], codec="zstd", element_bytes=2)
    head, _ = codec_format.split(blob)
    modes = {mode for _, _, mode, _, _ in codec_format.FRAME_STRUCT.iter_unpack(bytes(head[codec_format.HEADER_BYTES :]))}
    assert modes == {codec_format.MODE_SHUFFLE}
    scratch_calls: list[int] = []
    scratch = codec_decode._scratch
    monkeypatch.setattr(codec_decode, "_scratch", lambda size: scratch_calls.append(size) or scratch(size))

    slabs = [bytearray(frame_bytes) for _ in range(n_frames)]  # cut at elements: straight in
    assert codec.decode_into(blob, KEY, slabs) == len(raw)
    assert b"".join(slabs) == raw and scratch_calls == []

    odd = [bytearray(3), bytearray(len(raw) - 3)]  # cut inside an element: through the scratch buffer
    assert codec.decode_into(blob, KEY, odd) == len(raw)
    assert b"".join(odd) == raw and scratch_calls == [len(raw)]

    with pytest.raises(codec.ConfigError, match="smaller than the block"):
        codec.decode_into(blob, KEY, [bytearray(len(raw) - 2)])
