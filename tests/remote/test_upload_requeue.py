"""The uploader never drops the queue row of a block put again during its
batch (audit F7). It listed key K; K left the local tier (evicted or
deleted: its row went with it) and was put again (a new row) before the
batch ended. Removing the batch's rows by key then removed the new row: K
stayed stored locally, ``flush`` reported success, and K never reached the
remote (its uploaded descendants unreachable there: the prefix broken).

Now a row leaves only while it is still the row of the block the batch
read (its ``created_ns``, checked in the transaction that removes it).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import pytest

import ucm_db
from ucm_db.engines.memory import MemoryEngine
from ucm_db.index.local import BlockEntry, LocalTier

from .conftest import Remote, chain

CAP = 64 << 20


@pytest.mark.parametrize("remote", ["memory", "file"], indirect=True)
def test_a_block_put_again_while_its_batch_runs_reaches_the_remote(
    remote: Remote, tmp_path: Path, namespace, monkeypatch: pytest.MonkeyPatch,
) -> None:
    keys, payloads = chain(namespace, 8)
    last = keys[-1]
    raced = threading.Event()
    with ucm_db.open(tmp_path / "a", capacity_bytes=CAP, **remote.store_options()) as store:
        tier = store._tier
        real_read_blobs = tier.read_blobs

        def read_blobs_racing_a_reput(batch: Sequence[bytes]) -> list[bytes | None]:
            """The uploader's read of its batch: the tail leaves just before (the batch finds it
            gone) and is put again just after (a new row), before the batch removes its rows."""
            if last not in batch or raced.is_set():
                return real_read_blobs(batch)
            raced.set()
            assert store.delete(namespace, [last]) == 1
            blobs = real_read_blobs(batch)
            store.put(namespace, keys[-1:], payloads[-1:])  # recomputed: stored and queued anew
            return blobs

        monkeypatch.setattr(tier, "read_blobs", read_blobs_racing_a_reput)
        store.put(namespace, keys, payloads)
        store.flush(upload_timeout_s=30)
        assert raced.is_set(), "the race was staged"
        assert store.stats().pending_uploads == 0
        assert store.lookup(namespace, keys, remote=False) == 8
    # Another node finds the whole chain on the remote, the re-put tail included.
    with ucm_db.open(tmp_path / "b", capacity_bytes=CAP, **remote.store_options(remote_deadline_s=10)) as other:
        assert other.lookup(namespace, keys) == 8
        assert [None if p is None else bytes(p) for p in other.get(namespace, keys)] == payloads


NS_ID = b"n" * 16


def _entry(key: bytes, parent: bytes | None) -> BlockEntry:
    return BlockEntry(key, parent, b"", b"x" * 64, 128, NS_ID)


def test_mark_uploaded_removes_only_the_rows_of_the_blocks_read() -> None:
    """The queue's rule, one case per row (the key's block then and now)."""
    tier = LocalTier(MemoryEngine(), capacity_bytes=1 << 30)
    a, b, c, d, stale = (bytes([i]) * 32 for i in range(1, 6))
    tier.put_blocks([_entry(a, None), _entry(b, a), _entry(c, b), _entry(d, c)], enqueue_upload=True)
    read = {key: meta.created_ns for key, meta in zip((a, b, c, d), tier.metas([a, b, c, d])) if meta is not None}
    assert tier.delete([d]) == 1  # d left (its row with it) ...
    tier.put_blocks([_entry(d, c)], enqueue_upload=True)  # ... and was put again: a new row
    d_now = tier.metas([d])[0]
    assert d_now is not None and d_now.created_ns != read[d]
    tier.engine.write(lambda txn: txn.put("uploads", stale, NS_ID))  # a row naming no block
    tier.mark_uploaded({
        a: read[a],  # the block read: removed
        b: None,  # read as not stored, stored now: kept
        d: read[d],  # put again since: its new row kept
        stale: None,  # no block then or now: removed
    })
    assert tier.pending_uploads() == sorted([b, c, d])
    tier.mark_uploaded({b: read[b], c: read[c], d: d_now.created_ns})
    assert tier.pending_uploads() == []
    assert tier.check() == []
