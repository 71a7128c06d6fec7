"""The directory fsyncs of an upload batch to a ``file://`` remote
(:class:`ucm_db.remote.files.DirSyncs`): each distinct directory once per
batch, and all of them before the batch's queue rows go.

One fsync per object (eb42ace) cost a quarter of the uploads' rate; the
fan-out directories a batch shares, and above all the namespace directory
(the parent of every fan-out directory a batch creates), were fsynced again
for each object. Durability before dequeue still holds: a row leaves the
queue only once every directory the batch changed is synced (the power-cut
test, tests/remote/test_audit_uploads_durable_names.py, checks the outcome).

Real parts: an LMDB store, a ``file://`` remote, the uploader's own batch.
Observed (not faked): ``os.fsync`` is wrapped to record which directories
it syncs, and the queue's row removal to record when it runs.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest

import ucm_db
from ucm_db.components import local_tier
from ucm_db.index.upload_queue import UploadQueue
from ucm_db.remote import files
from ucm_db.remote.tier import RemoteRoot
from ucm_db.remote.uploader import Uploader

from .conftest import chain

pytestmark = pytest.mark.timeout(120)
CAP = 64 << 20
BLOCKS = 64


def test_a_batch_fsyncs_each_directory_once_and_before_its_rows_go(
    tmp_path: Path, namespace: ucm_db.Namespace, monkeypatch: pytest.MonkeyPatch,
) -> None:
    keys, payloads = chain(namespace, BLOCKS + 1)
    remote_dir = tmp_path / "remote"
    remote_dir.mkdir()
    synced: list[tuple[int, int]] = []
    at_dequeue: list[set[tuple[int, int]]] = []
    real_fsync, real_mark = os.fsync, UploadQueue.mark_uploaded

    def recording_fsync(fd: int) -> None:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            synced.append((info.st_dev, info.st_ino))
        real_fsync(fd)

    def recording_mark(self: UploadQueue, done: Any) -> None:
        at_dequeue.append(set(synced))
        real_mark(self, done)

    monkeypatch.setattr(Uploader, "_take_lock", lambda self: False)  # the thread stays idle: one batch, run here
    with ucm_db.open(tmp_path / "store", capacity_bytes=CAP, remote=f"file://{remote_dir}") as store:
        store.put(namespace, keys[:1], payloads[:1])
        assert store._wing.uploader.drain_batch() == (1, 0)  # the namespace's manifest is written (synced apart)
        store.put(namespace, keys[1:], payloads[1:], parent=keys[0])
        monkeypatch.setattr(files.os, "fsync", recording_fsync)
        tier = local_tier(store)
        monkeypatch.setattr(tier, "mark_uploaded", lambda done: recording_mark(tier.uploads, done))
        assert store._wing.uploader.drain_batch() == (BLOCKS, 0)
        monkeypatch.undo()
        assert local_tier(store).pending_uploads() == []
    root = RemoteRoot.from_url(f"file://{remote_dir}")
    changed = {os.path.dirname(root.object_path(namespace.id, key)) for key in keys[1:]} | {root.namespace_dir(namespace.id)}
    wanted = {(os.stat(d).st_dev, os.stat(d).st_ino) for d in changed}
    assert sorted(synced) == sorted(set(synced)), f"{len(synced)} directory fsyncs for {len(set(synced))} directories"
    assert at_dequeue and wanted <= at_dequeue[-1], "the batch's rows left the queue before its directories were synced"
