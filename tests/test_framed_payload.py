"""``ucm_db.Framed``: one contiguous buffer cut into frames encodes to the
same bytes as the list of its frames, and with codec ``none`` is stored
without being joined (the connector's staged KV units)."""

from __future__ import annotations

import numpy as np
import pytest

import ucm_db
from ucm_db import ConfigError, Framed, Namespace
from ucm_db import codec

KEY = bytes(range(32))
NS = Namespace(model="framed-test", kv_dtype="bfloat16", block_size=4)


def _row(nbytes: int = 3 * 4096) -> np.ndarray:
    rng = np.random.default_rng(5)
    values = rng.standard_normal(nbytes // 2).astype(np.float32)
    return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)


@pytest.mark.parametrize("codec_name", ["none", "zstd"])
def test_framed_encodes_like_the_list_of_its_frames(codec_name: str) -> None:
    row = _row()
    sizes = (4096, 8192, 0)
    framed = Framed(memoryview(row), sizes)
    as_list = [row[:4096], row[4096:12288], row[12288:]]
    blob = codec.encode(KEY, framed, codec=codec_name)
    assert blob == codec.encode(KEY, as_list, codec=codec_name)
    assert bytes(codec.decode(blob, KEY)) == row.tobytes()


def test_framed_none_keeps_the_buffer_as_its_body() -> None:
    row = _row()
    encoded = codec.encode_parts(KEY, Framed(memoryview(row), (4096, 8192)), codec="none")
    body = encoded.body_buffer()
    assert isinstance(body, memoryview) and np.shares_memory(np.frombuffer(body, np.uint8), row)


@pytest.mark.parametrize(("sizes", "match"), [((4096,), "sum to 4096"), ((-1, 12289), "non-negative"), ((1.5,), "non-negative")])
def test_inconsistent_frames_are_refused(sizes, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        Framed(memoryview(_row()), sizes)


def test_a_strided_buffer_is_refused() -> None:
    with pytest.raises(ConfigError, match="C-contiguous"):
        Framed(memoryview(_row())[::2], (6144,))


@pytest.mark.parametrize("codec_name", ["none", "zstd"])
def test_framed_payloads_round_trip_through_the_store(tmp_path, codec_name: str) -> None:
    rows = [_row() for _ in range(3)]
    keys = NS.block_keys(list(range(12)))
    with ucm_db.open(tmp_path, codec=codec_name, capacity_bytes=16 << 20) as store:
        store.put(NS, keys, [Framed(memoryview(r), (4096, 8192)) for r in rows])
        assert [bytes(b) for b in store.get(NS, list(keys))] == [r.tobytes() for r in rows]
        buffers = [bytearray(len(r)) for r in rows]
        assert store.get_into(NS, list(keys), buffers) == [True] * 3
