"""Review of 2ba0032 (the ``blocks`` table read without RocksDB's checksums):
a damaged payload queued for write-back is uploaded as it is.

Before the audit RocksDB's own blob CRC failed the read of the upload (the
row stayed queued); now the bytes come back unchecked, and the uploader
(``read_items`` -> ``ObjectSender.send``) never checks them against the
head's checksum, so the damaged block is written to the shared remote
(signed, where auth keys are set). Readers verify on fetch (a miss, not
wrong KV), but the object stays there as a miss for every node."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import ucm_db
from ucm_db import Namespace
from ucm_db.remote.uploader import Uploader

from test_audit_rocksdb_damage import flip_in_files, payload

NS = Namespace(model="review-rocksdb-upload", kv_dtype="bfloat16", block_size=4)
BLOCKS = 4


@pytest.mark.parametrize(("engine", "remote_codec"), [("rocksdb", "same"), ("lmdb", "same"), ("lmdb", "zstd")])
def test_a_damaged_payload_is_not_uploaded_to_the_remote(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         engine: str, remote_codec: str) -> None:
    path, remote_dir = tmp_path / "s", tmp_path / "remote"
    # Setup only (a mock): the first open's uploader never starts, so its rows stay queued (a remote that was
    # down); the second open's uploader is the real one.
    monkeypatch.setattr(Uploader, "start", lambda self: None)
    keys = NS.block_keys(list(range(4 * BLOCKS)))
    with ucm_db.open(path, engine=engine, codec="none", remote=f"file://{remote_dir}",
                     remote_mode="write_back") as store:
        store.put(NS, keys, [payload(i) for i in range(BLOCKS)])
    flip_in_files(path / engine, payload(2)[:8192])
    monkeypatch.undo()
    with ucm_db.open(path, remote=f"file://{remote_dir}", remote_mode="write_back", remote_codec=remote_codec) as store:
        store.flush()  # waits for the write-back queue to drain
        stats = store.stats()
    # Quarantined locally as a read does, with its descendant (keys[3]): their queue rows went with them.
    assert (stats.quarantined, stats.blocks, stats.pending_uploads) == (1, 2, 0), stats
    uploaded = {name for _root, _dirs, files in os.walk(remote_dir) for name in files}
    assert any(keys[1].hex() in name for name in uploaded), uploaded  # the queue did drain
    assert not any(keys[2].hex() in name for name in uploaded), "the damaged block was uploaded"
    assert not any(keys[3].hex() in name for name in uploaded), "a block under the damaged one was uploaded"
