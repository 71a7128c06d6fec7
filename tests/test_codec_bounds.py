"""What a block's size may cost, at both ends of the codec.

* A put of a block larger than the codec's largest raw block
  (:data:`~ucm_db.codec.MAX_RAW_BYTES`, 4 GiB) is a ``ConfigError`` that
  names the limit and stores nothing: it was accepted and reported stored,
  then every read took it for a corrupt block (audit t15). The payloads here
  are untouched ``numpy.zeros`` pages, so the refused put costs no memory
  (the refusal comes before any byte is read).
* A zstd frame decompresses straight into its output: decoding a block
  costs its raw size once, not the raw size twice (decompressed, then
  copied; audit t11), and a scatter list too small for a block is refused
  before any scratch buffer of the block's size is allocated.
"""

from __future__ import annotations

import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ucm_db
from ucm_db import codec
from ucm_db.codec import MAX_RAW_BYTES
from ucm_db.errors import ConfigError

NAMESPACE = ucm_db.Namespace(model="codec-bounds", kv_dtype="int8", block_size=4)
KEY = bytes(range(32))
#: Raw size of the blocks the memory tests decode (far above any buffer a
#: thread keeps between calls, so every allocation shows).
RAW_BYTES = 48 << 20


@pytest.fixture(scope="module")
def over_max() -> Iterator[np.ndarray]:
    """A zero buffer just past the largest block: calloc'd pages, never touched."""
    yield np.zeros(MAX_RAW_BYTES + 16, np.uint8)


def test_a_put_over_the_largest_raw_block_is_refused_and_stores_nothing(tmp_path: Path, over_max: np.ndarray) -> None:
    keys = NAMESPACE.block_keys([1, 2, 3, 4])
    with ucm_db.open(tmp_path / "s", codec="zstd", capacity_bytes=1 << 30) as store:
        started = time.monotonic()
        with pytest.raises(ConfigError, match=f"{MAX_RAW_BYTES}") as refused:
            store.put(NAMESPACE, keys, [over_max])
        assert time.monotonic() - started < 5.0, "refused before the payload was compressed"
        assert "block_size" in (refused.value.hint or "")
        assert store.lookup(NAMESPACE, keys) == 0
        assert store.stats().blocks == 0 and store.stats().stored_bytes == 0


@pytest.mark.parametrize("shape", ["one buffer", "frames", "framed"])
@pytest.mark.parametrize("codec_name", ["none", "zstd"])
def test_encode_refuses_a_block_over_the_largest_raw_block(over_max: np.ndarray, shape: str, codec_name: str) -> None:
    half = memoryview(over_max)[: MAX_RAW_BYTES // 2 + 8]
    payload: Any = {
        "one buffer": memoryview(over_max),
        "frames": [half, half],  # each frame fits; together they do not
        "framed": codec.Framed(over_max, (MAX_RAW_BYTES // 2 + 8,) * 2),
    }[shape]
    with pytest.raises(ConfigError, match=f"larger than the {MAX_RAW_BYTES}"):
        codec.encode_parts(KEY, payload, codec=codec_name, element_bytes=1)


def test_a_block_at_the_largest_raw_size_is_not_refused_for_its_size() -> None:
    """The bound is on the raw size: one byte under it encodes (codec none copies nothing)."""
    at_max = np.zeros(MAX_RAW_BYTES, np.uint8)
    block = codec.encode_parts(KEY, [at_max], codec="none")
    assert block.raw_len == MAX_RAW_BYTES


def _peak_bytes(call: Callable[[], object]) -> int:
    """The most bytes Python's allocators held at once during ``call``."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        call()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


@pytest.fixture(scope="module")
def zstd_blob() -> bytes:
    """A whole zstd frame (element size 1: no shuffle) of RAW_BYTES zeros: a few KiB stored."""
    blob = codec.encode(KEY, [bytes(RAW_BYTES)], codec="zstd", element_bytes=1)
    assert len(blob) < RAW_BYTES // 100
    return blob


def test_decode_costs_the_raw_size_once(zstd_blob: bytes) -> None:
    decoded: list[bytearray] = []
    peak = _peak_bytes(lambda: decoded.append(codec.decode(zstd_blob, KEY)))
    assert decoded[0] == bytes(RAW_BYTES)
    assert peak < RAW_BYTES * 1.25, f"decode held {peak / RAW_BYTES:.2f}x the raw size"


def test_decode_into_a_buffer_decompresses_straight_into_it(zstd_blob: bytes) -> None:
    out = bytearray(b"\1") * RAW_BYTES
    peak = _peak_bytes(lambda: codec.decode_into(zstd_blob, KEY, out))
    assert out == bytes(RAW_BYTES)
    assert peak < RAW_BYTES // 4, f"decode_into held {peak / RAW_BYTES:.2f}x the raw size beside the output"


def test_a_scatter_list_too_small_is_refused_before_any_scratch(zstd_blob: bytes) -> None:
    outs = [bytearray(4096), bytearray(4096)]

    def decode() -> None:
        with pytest.raises(ConfigError, match="smaller than the block"):
            codec.decode_into(zstd_blob, KEY, outs)

    peak = _peak_bytes(decode)
    assert peak < RAW_BYTES // 4, f"a refused decode held {peak / RAW_BYTES:.2f}x the raw size"
