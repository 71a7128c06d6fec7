"""Codec: round trips, and every kind of damage is a CorruptBlockError."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ucm_db import codec
from ucm_db.errors import ConfigError, CorruptBlockError

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
    sizes = codec.frame_sizes(blob)
    if name == "none":
        assert sizes == [len(f) for f in frames]
    else:  # runs of adjacent frames: the stored boundaries are some of the caller's
        assert sum(sizes) == sum(len(f) for f in frames)
        assert set(_boundaries(sizes)) <= set(_boundaries([len(f) for f in frames]))


def _boundaries(sizes: list[int]) -> list[int]:
    return [sum(sizes[:i]) for i in range(1, len(sizes))]


@settings(max_examples=60, deadline=None)
@given(frame_kib=st.lists(st.sampled_from([0, 1, 8, 64, 200, 256, 300]), min_size=1, max_size=12), odd=st.booleans())
def test_zstd_groups_small_adjacent_frames_and_framed_gives_the_same_bytes(frame_kib: list[int], odd: bool) -> None:
    sizes = [n << 10 for n in frame_kib]
    if odd:  # a frame that is not whole elements stands alone
        sizes[len(sizes) // 2] += 1
    raw = _bf16_like((sum(sizes) + 1) // 2)[: sum(sizes)]
    frames, at = [], 0
    for n in sizes:
        frames.append(raw[at : at + n])
        at += n
    listed = codec.encode(KEY, frames, codec="zstd", element_bytes=2)
    framed = codec.encode_parts(KEY, codec.Framed(raw, tuple(sizes)), codec="zstd", element_bytes=2).blob()
    assert listed == framed
    assert bytes(codec.decode(listed, KEY)) == raw
    stored = codec.frame_sizes(listed)
    caller_bounds = set(_boundaries(sizes))
    assert set(_boundaries(stored)) <= caller_bounds
    # A stored frame holds several caller frames only while they are whole
    # elements and the run is under the group size before its last frame.
    at = 0
    for size in stored:
        inner = [b - at for b in caller_bounds if at < b < at + size]
        if inner:
            assert max(inner) < codec.ZSTD_GROUP_BYTES
            assert all(b % 2 == 0 for b in inner)
        at += size
    # A caller frame of the group size or more is stored alone.
    stored_bounds = {0, sum(sizes)} | set(_boundaries(stored))
    at = 0
    for n in sizes:
        if n >= codec.ZSTD_GROUP_BYTES:
            assert at in stored_bounds and at + n in stored_bounds
        at += n


def test_zstd_groups_vllm_cpu_layer_frames_into_one() -> None:
    """Eight 8 KiB layer frames (a vLLM-CPU head unit) become one zstd frame,
    and it decodes to the same bytes."""
    raw = _bf16_like(32 << 10)
    frames = [raw[i : i + (8 << 10)] for i in range(0, len(raw), 8 << 10)]
    blob = codec.encode(KEY, frames, codec="zstd", element_bytes=2)
    assert codec.frame_sizes(blob) == [len(raw)]
    assert bytes(codec.decode(blob, KEY)) == raw
    assert codec.frame_sizes(codec.encode(KEY, frames, codec="none")) == [8 << 10] * 8


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


@pytest.mark.parametrize("name", ["none", "zstd"])
@pytest.mark.parametrize("scattered", [False, True])
def test_every_bit_flip_is_detected_by_decode_into(name: str, scattered: bool) -> None:
    # A raw body is verified while it is copied (ucm_db.codec.checked_copy): the
    # flip is still found, and the block still reads whole when undamaged.
    raw = _bf16_like(64)  # 128 bytes
    blob = codec.encode(KEY, [raw[:96], raw[96:]], codec=name, element_bytes=2)
    for bit in range(len(blob) * 8):
        damaged = bytearray(blob)
        damaged[bit // 8] ^= 1 << (bit % 8)
        out: list[bytearray] | bytearray = [bytearray(100), bytearray(28)] if scattered else bytearray(128)
        with pytest.raises(CorruptBlockError):
            codec.decode_into(bytes(damaged), KEY, out)
    out = [bytearray(100), bytearray(40)] if scattered else bytearray(130)
    assert codec.decode_into(blob, KEY, out) == 128
    assert (b"".join(out) if scattered else bytes(out))[:128] == raw
    with pytest.raises(CorruptBlockError):
        codec.decode_into(blob, bytes(32), out)  # another key's block
    with pytest.raises(ConfigError, match="smaller than the block"):
        codec.decode_into(blob, KEY, [bytearray(100)] if scattered else bytearray(127))


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


@pytest.mark.parametrize("name", ["none", "zstd"])
def test_more_frames_than_the_table_holds_is_a_config_error_for_lists_and_framed(name: str) -> None:
    too_many = codec.MAX_FRAMES + 1
    with pytest.raises(ConfigError, match="at most"):
        codec.encode(KEY, [b"ab"] * too_many, codec=name, element_bytes=2)
    with pytest.raises(ConfigError, match="at most"):
        codec.encode_parts(KEY, codec.Framed(b"ab" * too_many, (2,) * too_many), codec=name, element_bytes=2)
