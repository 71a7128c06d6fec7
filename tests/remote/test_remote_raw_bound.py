"""A remote object is refused for the block it declares, not only for its own size.

``remote_max_object_bytes`` bounds what one remote object may cost a
reader. An object's own size is not enough: a correctly sealed object of a
few KiB can declare a block of hundreds of MiB (one zstd frame of zeros),
and once promoted every read of it decoded that much (audit t11: 16.5 KB
on the remote, 1 GiB of a reader's memory). A fetched object whose codec
header declares more raw bytes than ``remote_max_object_bytes`` is now a
miss before promotion, counted in ``too_large`` (not corrupt) and logged;
the same for an encrypted object (its header is read once opened). Real
stores on a ``file://`` remote.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

import ucm_db
from ucm_db import codec

from .conftest import chain, key_file

pytestmark = pytest.mark.timeout(120)
CAP = 256 << 20
#: What the crafted block declares: far past the reader's bound, a few KiB stored.
BOMB_RAW_BYTES = 64 << 20
READER_MAX_OBJECT_BYTES = 1 << 20


def _bomb(key: bytes) -> bytes:
    """A correctly sealed block of BOMB_RAW_BYTES zeros in one zstd frame."""
    blob = codec.encode(key, [bytes(BOMB_RAW_BYTES)], codec="zstd", element_bytes=1)
    assert len(blob) < 16 << 10
    return blob


@pytest.mark.parametrize("sealed", [False, True], ids=["plain", "encrypted"])
def test_an_object_declaring_a_block_over_the_bound_is_a_miss_before_promotion(
    tmp_path: Path, namespace: Any, sealed: bool, caplog: pytest.LogCaptureFixture,
) -> None:
    url = f"file://{tmp_path / 'remote'}"
    extra = {"remote_encryption_key_file": key_file(tmp_path, b"\x11" * 32, name="seal.key")} if sealed else {}
    keys, payloads = chain(namespace, 3, seed=5)
    with ucm_db.open(tmp_path / "writer", capacity_bytes=CAP, remote=url, remote_mode="write_through", **extra) as writer:
        writer.put(namespace, keys[:1], payloads[:1])
        writer.put_encoded(namespace, [(keys[1], keys[0], _bomb(keys[1]))])  # it verifies: header, key, checksum

    caplog.set_level(logging.WARNING, logger="ucm_db")
    with ucm_db.open(tmp_path / "reader", capacity_bytes=CAP, remote=url, remote_deadline_s=10.0,
                     remote_max_object_bytes=READER_MAX_OBJECT_BYTES, **extra) as reader:
        assert reader.lookup(namespace, keys) == 1
        got = reader.get(namespace, keys[:2])
        assert got[0] == payloads[0] and got[1] is None
        warmed = reader.warm(namespace, keys=[keys[:2]])
        assert warmed.fetched == 0
        assert reader.lookup(namespace, keys, remote=False) == 1, "the block past the bound was never promoted"
        stats = reader.stats().remote
        assert stats["too_large"] >= 1 and stats["corrupt"] == 0, stats
    refusals = [r.getMessage() for r in caplog.records if "raw bytes" in r.getMessage()]
    assert refusals and str(BOMB_RAW_BYTES) in refusals[0] and "remote_max_object_bytes" in refusals[0], caplog.text
    assert len(refusals) == 1, "logged once per object, however often it is met"


def test_a_block_within_the_bound_is_still_promoted(tmp_path: Path, namespace: Any) -> None:
    """The bound is the reader's remote_max_object_bytes: a reader that allows
    the block promotes it and serves its bytes."""
    url = f"file://{tmp_path / 'remote'}"
    keys, payloads = chain(namespace, 2, seed=6)
    with ucm_db.open(tmp_path / "writer", capacity_bytes=CAP, remote=url, remote_mode="write_through") as writer:
        writer.put(namespace, keys[:1], payloads[:1])
        writer.put_encoded(namespace, [(keys[1], keys[0], _bomb(keys[1]))])
    with ucm_db.open(tmp_path / "reader", capacity_bytes=CAP, remote=url, remote_deadline_s=10.0,
                     remote_max_object_bytes=BOMB_RAW_BYTES) as reader:
        got = reader.get(namespace, keys)
        assert got[0] == payloads[0] and got[1] is not None and len(got[1]) == BOMB_RAW_BYTES
        assert reader.lookup(namespace, keys, remote=False) == 2
        assert reader.stats().remote["too_large"] == 0
