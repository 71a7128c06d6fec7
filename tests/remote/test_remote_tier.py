"""RemoteTier and its object format on memory://, a shared directory and
real S3 (moto): round trips, verification on read, atomic writes, listing,
and the parallel prefix search's round-trip bound."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ucm_db import codec
from ucm_db.errors import CorruptBlockError
from ucm_db.remote.search import search_prefix
from ucm_db.remote.tier import (
    ENVELOPE_BYTES, TEMP_PREFIX, RemoteRoot, pack_object, parse_envelope, unpack_object, write_whole,
)

from .conftest import Remote, chain

pytestmark = pytest.mark.timeout(60)
NS_ID = bytes(range(16))


def _blob(key: bytes, size: int = 3000) -> bytes:
    return codec.encode(key, os.urandom(size // 3) + bytes(size - size // 3), codec="zstd")


def test_object_round_trip_carries_parent_and_namespace() -> None:
    key, parent = os.urandom(32), os.urandom(32)
    blob = _blob(key)
    obj = unpack_object(pack_object(key, parent, NS_ID, blob), key)
    assert (obj.parent, obj.namespace_id, obj.blob) == (parent, NS_ID, blob)
    assert obj.raw_bytes == codec.read_header(blob).raw_len
    root = unpack_object(pack_object(key, None, NS_ID, blob), key)
    assert root.parent is None


def test_every_single_bit_flip_is_detected() -> None:
    key, parent = os.urandom(32), os.urandom(32)
    data = pack_object(key, parent, NS_ID, codec.encode(key, os.urandom(300), codec="none"))
    for bit in range(len(data) * 8):
        flipped = bytearray(data)
        flipped[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(CorruptBlockError):
            unpack_object(bytes(flipped), key)


def test_truncation_and_wrong_key_are_detected() -> None:
    key = os.urandom(32)
    data = pack_object(key, None, NS_ID, _blob(key))
    for cut in (0, 10, ENVELOPE_BYTES, ENVELOPE_BYTES + 5, len(data) - 1):
        with pytest.raises(CorruptBlockError):
            unpack_object(data[:cut], key)
    with pytest.raises(CorruptBlockError):
        parse_envelope(data, os.urandom(32))  # object served under another key's path


def test_tier_round_trip(remote: Remote, namespace) -> None:
    root = RemoteRoot.from_url(remote.url, remote.options)
    tier = root.tier(namespace.digest[:16])
    keys, payloads = chain(namespace, 6)
    blobs = [codec.encode(k, p) for k, p in zip(keys, payloads)]
    for i, (key, blob) in enumerate(zip(keys, blobs)):
        tier.store(key, keys[i - 1] if i else None, blob)
    missing = os.urandom(32)
    assert tier.get_batch([*keys, missing]) == [*blobs, None]
    assert tier.exists([keys[0], missing, keys[-1]]) == [True, False, True]
    assert sorted(tier.iterate()) == sorted(keys)
    fetched = tier.fetch(keys[3])
    assert fetched is not None and fetched.parent == keys[2]
    probe = tier.probe(keys[0])
    assert probe is not None and probe.parent is None
    assert tier.delete([keys[5], missing]) == 1
    assert tier.exists([keys[5]]) == [False]
    root.ensure_manifest(namespace.digest[:16], namespace.to_dict())
    manifest = root.read_manifest(namespace.digest[:16])
    assert manifest is not None and manifest["namespace"]["model"] == namespace.model
    assert namespace.short_id in root.namespaces()


def test_corrupt_object_reads_as_miss(remote: Remote, namespace) -> None:
    root = RemoteRoot.from_url(remote.url, remote.options)
    tier = root.tier(namespace.digest[:16])
    key = os.urandom(32)
    tier.store(key, None, _blob(key))
    data = bytearray(root.fs.cat_file(tier.path(key)))
    data[-7] ^= 0x10
    root.fs.pipe_file(tier.path(key), bytes(data))
    assert tier.fetch(key) is None
    assert root.stats.corrupt == 1


def test_object_of_another_namespace_is_a_miss(remote: Remote, namespace) -> None:
    root = RemoteRoot.from_url(remote.url, remote.options)
    key = os.urandom(32)
    ours, other = root.tier(namespace.digest[:16]), root.tier(bytes(16))
    other.store(key, None, _blob(key))
    write_whole(root.fs, ours.path(key), root.fs.cat_file(other.path(key)))
    assert ours.fetch(key) is None and ours.probe(key) is None


def test_local_write_is_temp_fsync_rename(tmp_path: Path) -> None:
    import fsspec

    fs = fsspec.filesystem("file")
    target = tmp_path / "d" / "obj"
    write_whole(fs, str(target), b"x" * 1000)
    write_whole(fs, str(target), b"y" * 10)  # replace: readers see old or new, whole
    assert target.read_bytes() == b"y" * 10
    assert [p.name for p in target.parent.iterdir()] == ["obj"]
    assert not any(p.name.startswith(TEMP_PREFIX) for p in target.parent.iterdir())


@given(n=st.integers(0, 9000), present=st.integers(0, 9000), fanout=st.integers(1, 16))
@settings(max_examples=300, deadline=None)
def test_prefix_search_is_exact_on_monotone_presence(n: int, present: int, fanout: int) -> None:
    present = min(present, n)
    result = search_prefix(lambda idx: [i < present for i in idx], n, fanout=fanout)
    assert result.count == present and result.complete


@given(n=st.integers(1, 500), holes=st.sets(st.integers(0, 499)))
@settings(max_examples=200, deadline=None)
def test_prefix_search_never_underestimates_with_holes(n: int, holes: set[int]) -> None:
    first_hole = min([h for h in holes if h < n], default=n)
    result = search_prefix(lambda idx: [i not in holes for i in idx], n)
    assert result.count >= first_hole


@pytest.mark.parametrize("present", [0, 1, 4095, 8191, 8192])
def test_prefix_search_of_8192_blocks_needs_few_round_trips(present: int) -> None:
    result = search_prefix(lambda idx: [i < present for i in idx], 8192)
    assert result.count == present
    assert result.rounds <= 6, result  # target: <= 16 round trips
    if present == 8192:
        assert result.rounds == 1  # the last key is probed first
