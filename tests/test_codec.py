"""Codec: round trips, and every kind of damage is a CorruptBlockError."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ucm_db import codec
from ucm_db.errors import CorruptBlockError

KEY = bytes(range(32))


def _bf16_like(n_elements: int, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    values = rng.standard_normal(n_elements).astype(np.float32)
    return (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()


@settings(max_examples=80, deadline=None)
@given(
    frames=st.lists(st.binary(max_size=3000), min_size=1, max_size=4),
    name=st.sampled_from(["none", "zstd"]),
    element_bytes=st.sampled_from([1, 2, 4]),
)
def test_round_trip_any_bytes(frames: list[bytes], name: str, element_bytes: int) -> None:
    blob = codec.encode(KEY, frames, codec=name, element_bytes=element_bytes)
    assert bytes(codec.decode(blob, KEY)) == b"".join(frames)
    assert codec.frame_sizes(blob) == [len(f) for f in frames]


def test_zstd_compresses_bf16_like_data_and_round_trips() -> None:
    raw = _bf16_like(1 << 18)
    blob = codec.encode(KEY, raw, codec="zstd", element_bytes=2)
    assert len(blob) < len(raw) / 1.2
    out = bytearray(len(raw))
    assert codec.decode_into(blob, KEY, out) == len(raw)
    assert bytes(out) == raw


def test_decode_into_rejects_small_buffer() -> None:
    blob = codec.encode(KEY, b"x" * 100, codec="none")
    with pytest.raises(ValueError, match="smaller"):
        codec.decode_into(blob, KEY, bytearray(10))


def test_wrong_key_is_corrupt() -> None:
    blob = codec.encode(KEY, b"payload", codec="none")
    with pytest.raises(CorruptBlockError, match="another key"):
        codec.decode(blob, bytes(32))


@pytest.mark.parametrize("name", ["none", "zstd"])
def test_every_bit_flip_of_a_small_block_is_detected(name: str) -> None:
    blob = codec.encode(KEY, _bf16_like(256), codec=name, element_bytes=2)
    for bit in range(len(blob) * 8):
        damaged = bytearray(blob)
        damaged[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(CorruptBlockError):
            codec.decode(bytes(damaged), KEY)


@pytest.mark.parametrize("cut", [0, 1, 10, codec.HEADER_BYTES, codec.HEADER_BYTES + 5, -1])
def test_truncation_is_detected(cut: int) -> None:
    blob = codec.encode(KEY, os.urandom(500), codec="zstd")
    with pytest.raises(CorruptBlockError):
        codec.decode(blob[:cut], KEY)
    with pytest.raises(CorruptBlockError):
        codec.decode(blob + b"\0", KEY)


def test_decompression_bomb_is_rejected_before_allocation() -> None:
    # A header claiming 2**40 raw bytes: refused by the bounds check, no allocation.
    blob = bytearray(codec.encode(KEY, b"tiny", codec="zstd"))
    struct.pack_into("<Q", blob, 12, 1 << 40)
    with pytest.raises(CorruptBlockError):
        codec.decode(bytes(blob), KEY)


def test_element_size_table() -> None:
    assert codec.element_bytes_for("torch.bfloat16") == 2
    assert codec.element_bytes_for("float32") == 4
    assert codec.element_bytes_for("fp8_e4m3") == 1
