"""The batch raw read path (ucm_db.codec.raw_loads) takes only what the codec's raw branch takes.

* A codec-``none`` block of a known all-raw table is copied and verified
  without the codec's chain, into one buffer or a scatter list, with the
  bytes ``codec.decode`` gives.
* A head that fails any check (another key, another codec, a body length
  other than the header's, a table not seen yet) is left for the codec
  (None, block untouched); a flipped body byte is corrupt (False, reason
  recorded), as it is for ``codec.decode_into``.
* Asked to, it also takes a zstd block of shuffled frames, into one buffer,
  a scatter list or ``ScatterSlabs``, with the bytes ``codec.decode`` gives;
  a block of another frame mode, or of frames for the codec threads, or
  buffers cut inside an element, are left for the codec; a flipped body
  byte is corrupt.
"""

from __future__ import annotations

import os
import struct

import pytest

import numpy as np

from ucm_db import codec
from ucm_db.codec import raw_loads
from ucm_db.codec.slabs import ScatterSlabs
from ucm_db.errors import CorruptBlockError

KEY, OTHER = bytes(range(32)), bytes(32)


def _block(key: bytes = KEY, kind: str = "none") -> tuple[bytes, bytes, bytes]:
    frames = [os.urandom(4096) for _ in range(4)]
    head, body = codec.split(codec.encode(key, frames, codec=kind))
    codec.decode(bytes(head) + bytes(body), key)  # the codec's own path: remembers the table
    return bytes(head), bytes(body), b"".join(frames)


def test_raw_block_is_copied_verified_into_buffers_and_scatter_lists() -> None:
    head, body, raw = _block()
    whole, parts = bytearray(len(raw)), [bytearray(4096) for _ in range(4)]
    blocks = [(memoryview(head), memoryview(body)), None, (memoryview(head), memoryview(body))]
    corrupt: list[tuple[bytes, str]] = []
    assert raw_loads.copy_raw_blocks(blocks, [KEY, OTHER, KEY], [whole, None, parts], corrupt) == [True, None, True]
    assert bytes(whole) == raw and b"".join(parts) == raw and blocks == [None, None, None] and not corrupt


def test_heads_the_raw_branch_refuses_are_left_for_the_codec() -> None:
    head, body, _ = _block()
    assert raw_loads.raw_checksum(memoryview(head), len(body), KEY) is not None
    assert raw_loads.raw_checksum(memoryview(head), len(body), OTHER) is None  # another key's block
    assert raw_loads.raw_checksum(memoryview(head), len(body) - 1, KEY) is None  # body cut short
    zhead, zbody, _ = _block(kind="zstd")
    assert raw_loads.raw_checksum(memoryview(zhead), len(zbody), KEY) is None  # compressed
    odd = bytearray(head)
    odd[codec.HEADER_BYTES + 16] = codec.MODE_SHUFFLE  # a frame's mode: a table never seen raw
    assert raw_loads.raw_checksum(memoryview(odd), len(body), KEY) is None
    for at in (0, 4):  # magic, version
        bad = bytearray(head)
        bad[at] ^= 1
        assert raw_loads.raw_checksum(memoryview(bad), len(body), KEY) is None
    blocks = [(memoryview(head), memoryview(body))]
    assert raw_loads.copy_raw_blocks(blocks, [OTHER], [bytearray(len(body))], []) == [None] and blocks[0] is not None


def test_flipped_body_byte_is_corrupt_as_on_the_codec_path() -> None:
    head, body, _ = _block()
    bad = bytearray(body)
    bad[100] ^= 0x40
    corrupt: list[tuple[bytes, str]] = []
    assert raw_loads.copy_raw_blocks([(memoryview(head), memoryview(bad))], [KEY], [bytearray(len(bad))], corrupt) == [False]
    assert [k for k, _ in corrupt] == [KEY] and corrupt[0][1].startswith("checksum mismatch")
    with pytest.raises(CorruptBlockError, match="checksum"):
        codec.decode_into(head + bytes(bad), KEY, bytearray(len(bad)))
    assert struct.unpack_from("<Q", head, codec.HEADER_BYTES - 8)[0] == raw_loads.raw_checksum(memoryview(head), len(body), KEY)


def _shuffled_block(frame_bytes: int = 8192, frames: int = 8) -> tuple[bytes, bytes, bytes]:
    values = np.random.default_rng(frame_bytes).standard_normal(frame_bytes * frames // 2).astype(np.float32)
    raw = (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()  # bf16-like: the top plane shrinks
    head, body = codec.split(codec.encode(KEY, [raw[i * frame_bytes : (i + 1) * frame_bytes] for i in range(frames)],
                                          codec="zstd", element_bytes=2))
    return bytes(head), bytes(body), raw


def _take(head: bytes, body: bytes, buffers: list, **options) -> tuple[list, list]:
    corrupt: list[tuple[bytes, str]] = []
    take, results = raw_loads.raw_taker([KEY] * len(buffers), buffers, corrupt, **options)
    taken = [take(i, memoryview(head), memoryview(body)) for i in range(len(buffers))]
    return [r if t else None for r, t in zip(results, taken)], corrupt


def test_a_shuffled_zstd_block_is_merged_verified_into_buffers_lists_and_slabs() -> None:
    head, body, raw = _shuffled_block()
    whole, parts = bytearray(len(raw)), [bytearray(8192) for _ in range(8)]
    assert _take(head, body, [whole, parts], shuffled=True) == ([True, True], [])
    assert bytes(whole) == raw and b"".join(parts) == raw
    layers = [np.zeros((3, 8192), np.uint8) for _ in range(8)]
    slabs = ScatterSlabs(layers, [8192] * 8, [2])
    assert _take(head, body, slabs, shuffled=True) == ([True], [])
    assert b"".join(layer[2].tobytes() for layer in layers) == raw and not any(layer[:2].any() for layer in layers)
    assert _take(head, body, [bytearray(len(raw))]) == ([None], [])  # not asked: left for the codec


def test_zstd_blocks_the_fast_path_refuses_are_left_for_the_codec() -> None:
    head, body, raw = _shuffled_block()
    assert _take(head, body, [[bytearray(3), bytearray(len(raw) - 3)]], shuffled=True) == ([None], [])  # cut inside an element
    assert _take(head, body, [bytearray(len(raw) - 2)], shuffled=True) == ([None], [])  # too small: the codec names it
    assert _take(head, body, [bytearray(len(raw))], shuffled=True, below_frame_bytes=len(raw)) == ([None], [])  # for the codec threads
    assert _take(head, body, [bytearray(len(raw))], shuffled=True, below_frame_bytes=len(raw) + 1) == ([True], [])
    zhead, zbody = codec.split(codec.encode(KEY, [bytes(4096)] * 2, codec="zstd", element_bytes=1))  # zstd frames, unshuffled
    assert _take(bytes(zhead), bytes(zbody), [bytearray(8192)], shuffled=True) == ([None], [])
    other = bytearray(head)
    other[codec.HEADER_BYTES - 40 : codec.HEADER_BYTES - 8] = OTHER  # the owning key
    assert _take(bytes(other), body, [bytearray(len(raw))], shuffled=True) == ([None], [])


def test_a_flipped_byte_of_a_shuffled_zstd_block_is_corrupt() -> None:
    head, body, raw = _shuffled_block()
    bad = bytearray(body)
    bad[len(bad) // 2] ^= 0x10
    results, corrupt = _take(head, bytes(bad), [bytearray(len(raw))], shuffled=True)
    assert results == [False] and [k for k, _ in corrupt] == [KEY] and corrupt[0][1].startswith("checksum mismatch")
    with pytest.raises(CorruptBlockError, match="checksum"):
        codec.decode_into(head + bytes(bad), KEY, bytearray(len(raw)))
