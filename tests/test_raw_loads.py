"""The batch raw read path (ucm_db.raw_loads) takes only what the codec's raw branch takes.

* A codec-``none`` block of a known all-raw table is copied and verified
  without the codec's chain, into one buffer or a scatter list, with the
  bytes ``codec.decode`` gives.
* A head that fails any check (another key, another codec, a body length
  other than the header's, a table not seen yet) is left for the codec
  (None, block untouched); a flipped body byte is corrupt (False, reason
  recorded), as it is for ``codec.decode_into``.
"""

from __future__ import annotations

import os
import struct

import pytest

from ucm_db import codec, raw_loads
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
