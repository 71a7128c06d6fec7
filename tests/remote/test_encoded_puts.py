"""Blocks already encoded (``Store.put_encoded``: what an archive import
writes) take put's way to the remote (issue 47 item 2): queued for upload
in their own commit and drained by write-back, uploaded before the call
returns by write-through. Written around the Store (``store._tier.put_blocks``,
as imports were), they were never queued: the remote never got them."""

from __future__ import annotations

from pathlib import Path

import pytest

import ucm_db
from ucm_db import codec
from ucm_db.remote.tier import RemoteRoot

from .conftest import Remote, chain

pytestmark = pytest.mark.timeout(60)
CAP = 64 << 20


def _encoded(namespace, n: int) -> tuple[list[bytes], list[bytes], list[tuple[bytes, bytes | None, bytes]]]:
    keys, payloads = chain(namespace, n)
    return keys, payloads, [(key, keys[i - 1] if i else None, codec.encode(key, payload)) for i, (key, payload) in enumerate(zip(keys, payloads))]


def _remote_keys(remote: Remote, namespace) -> set[bytes]:
    return set(RemoteRoot.from_url(remote.url, remote.options).tier(namespace.digest[:16]).iterate())


def test_write_back_uploads_encoded_blocks(remote: Remote, tmp_path: Path, namespace) -> None:
    keys, payloads, blocks = _encoded(namespace, 8)
    with ucm_db.open(tmp_path / "a", capacity_bytes=CAP, **remote.store_options()) as store:
        assert store.put_encoded(namespace, blocks[:5]).stored == 5
        assert store.put_encoded(namespace, blocks).stored == 3  # those stored already are not queued again
        store.flush(upload_timeout_s=30)
        stats = store.stats()
        assert stats.pending_uploads == 0 and stats.remote["uploaded"] == 8
    assert _remote_keys(remote, namespace) == set(keys)
    with ucm_db.open(tmp_path / "b", capacity_bytes=CAP, **remote.store_options(remote_deadline_s=10)) as other:
        assert other.get(namespace, keys) == payloads  # read through from the remote


def test_write_through_uploads_encoded_blocks_before_returning(remote: Remote, tmp_path: Path, namespace) -> None:
    keys, _, blocks = _encoded(namespace, 6)
    with ucm_db.open(tmp_path / "a", capacity_bytes=CAP, remote_mode="write_through", **remote.store_options()) as store:
        store.put_encoded(namespace, blocks[:4])
        assert _remote_keys(remote, namespace) == set(keys[:4])  # before any flush
