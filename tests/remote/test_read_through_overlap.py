"""Read-through of ``get`` and ``get_into`` decodes each fetched block as it
arrives, while later ones are still on the link (Store._read_through), on a
bandwidth-limited ``throttled://`` remote (the benchmarks' link: real files,
a token bucket for the bytes)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import ucm_db
from ucm_db import codec

pytestmark = pytest.mark.timeout(120)
BLOCKS = 12
BLOCK_BYTES = 256 << 10


def _payloads() -> list[bytes]:
    import random

    rng = random.Random(3)
    return [rng.randbytes(BLOCK_BYTES // 2) + bytes(BLOCK_BYTES // 2) for _ in range(BLOCKS)]


@pytest.mark.parametrize("method", ["get", "get_into"])
def test_fetched_blocks_are_decoded_while_later_ones_arrive(
    tmp_path: Path, namespace, monkeypatch: pytest.MonkeyPatch, method: str,
) -> None:
    from ucm_db.tools.bench.throttle import register

    register()
    # 12 blocks of ~130 KiB stored at 2 MB/s: the read-through takes ~0.8 s on the link.
    remote = {"remote": "throttled://kv", "remote_options": {"path": str(tmp_path / "remote"), "bandwidth_bytes_per_s": 2e6}}
    keys = namespace.block_keys(list(range(BLOCKS * namespace.block_size)))
    payloads = _payloads()
    with ucm_db.open(tmp_path / "writer", codec="zstd", capacity_bytes=64 << 20, **remote) as writer:
        writer.put(namespace, keys, payloads)
        writer.flush(upload_timeout_s=120)
    decoded_at: list[float] = []
    real_decode, real_decode_into = codec.decode, codec.decode_into

    def decode(*args, **kwargs):
        decoded_at.append(time.monotonic())
        return real_decode(*args, **kwargs)

    def decode_into(*args, **kwargs):
        decoded_at.append(time.monotonic())
        return real_decode_into(*args, **kwargs)

    monkeypatch.setattr(codec, "decode", decode)
    monkeypatch.setattr(codec, "decode_into", decode_into)
    with ucm_db.open(tmp_path / "reader", capacity_bytes=64 << 20, remote_deadline_s=30, **remote) as reader:
        started = time.monotonic()
        if method == "get":
            assert reader.get(namespace, keys) == payloads
        else:
            buffers = [bytearray(BLOCK_BYTES) for _ in keys]
            assert reader.get_into(namespace, keys, buffers) == [True] * BLOCKS
            assert buffers == payloads
        finished = time.monotonic()
        assert reader.lookup(namespace, keys, remote=False) == BLOCKS  # promoted as well
    assert len(decoded_at) == BLOCKS
    # The first block was decoded in the first half of the transfer, not after the last one arrived.
    assert decoded_at[0] - started < 0.5 * (finished - started), (decoded_at[0] - started, finished - started)
