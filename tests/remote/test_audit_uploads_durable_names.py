"""Audit of a directory remote (``file://``) across a power loss: an upload
leaves the queue only once its object's name is durable, and a retraction is
confirmed only once its object's removal is.

The finding: :func:`ucm_db.remote.files.write_whole` wrote a temp file,
fsynced it, and renamed it over the object's name; ``RemoteTier.delete``
unlinked the object. Neither synced the directory, so the rename and the
unlink were in the kernel's cache only, while the store's own records (the
upload queue's removal, the retraction's confirmation, on the store's disk)
were made durable by ``flush``. A power loss of the remote's disk then
lost objects whose uploads had left the queue (nothing ever uploaded them
again) and brought back the object of a block deleted with ``remote=True``
(its retraction confirmed: every node served the wrong KV again). Now a
rename, link or unlink on a directory remote is followed by an fsync of its
directory, and of the parents of the directories it created.

Real parts: the power-cut FUSE file system (tests/reliability/powercut) holds
the remote directory; the store lies on the test's ordinary disk (it keeps
everything: the loss is the remote disk's); a forked child writes and exits
before each cut, as a power loss finds no process alive.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import ucm_db
from ucm_db import maintenance
from ucm_db.components import local_tier
from ucm_db.remote.tier import RemoteRoot

from reliability.harness import run_child, tail
from reliability.powercut import PowerCutMount
from .conftest import chain

pytestmark = [pytest.mark.timeout(180), pytest.mark.crash]
CAP = 64 << 20
BLOCKS = 4


def _sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _put_and_flush(store: Path, url: str, namespace: ucm_db.Namespace) -> None:
    keys, payloads = chain(namespace, BLOCKS)
    with ucm_db.open(store, capacity_bytes=CAP, remote=url) as s:
        s.put(namespace, keys, payloads)
        s.flush(upload_timeout_s=60)
        assert s.stats().pending_uploads == 0


def _delete_and_flush(store: Path, url: str, namespace: ucm_db.Namespace) -> None:
    keys, _payloads = chain(namespace, BLOCKS)
    with ucm_db.open(store, capacity_bytes=CAP, remote=url) as s:
        assert s.delete(namespace, [keys[2]], remote=True) == 2
        s.flush(upload_timeout_s=60)
        assert local_tier(s).uploads.retractions_due() == []  # confirmed


def _on_remote(url: str, namespace: ucm_db.Namespace, keys: list[bytes]) -> list[bool]:
    return RemoteRoot.from_url(url).tier(namespace.id).exists(keys)


@pytest.mark.parametrize("names", ["journal", "strict"])
def test_uploads_and_deletes_of_a_directory_remote_survive_its_power_loss(
    tmp_path: Path, namespace: ucm_db.Namespace, names: str,
) -> None:
    keys, _payloads = chain(namespace, BLOCKS)
    store = tmp_path / "store"
    with PowerCutMount(tmp_path / "mnt", tmp_path) as mount:
        mount.strict_names(names == "strict")
        remote_dir = tmp_path / "mnt" / "remote"
        remote_dir.mkdir()
        _sync_dir(tmp_path / "mnt")  # the remote's root is there before anything
        url = f"file://{remote_dir}"
        log = tmp_path / "child.log"
        assert run_child(_put_and_flush, store, url, namespace, log_path=log, timeout_s=120) == 0, tail(log)
        mount.cut("drop", 1)
        with ucm_db.open(store, capacity_bytes=CAP, remote=url) as s:
            queued = local_tier(s).uploads.queued(keys)
            s._wing.uploader.stop()  # look only: no upload after the cut
        present = _on_remote(url, namespace, keys)
        lost = [i for i, key in enumerate(keys) if not present[i] and key not in queued]
        assert lost == [], f"blocks {lost} left the upload queue but their objects were lost with the remote's power"
        assert run_child(_delete_and_flush, store, url, namespace, log_path=log, timeout_s=120) == 0, tail(log)
        mount.cut("drop", 2)
        assert _on_remote(url, namespace, keys[2:]) == [False, False], \
            "a block deleted with remote=True (retraction confirmed) came back after the remote's power loss"
        assert _on_remote(url, namespace, keys[:2]) == [True, True]


def _gc_everything(url: str) -> None:
    report = maintenance.gc_remote(url, older_than_s=0)
    assert report["removed_objects"] == BLOCKS, report


def test_gc_removals_from_a_directory_remote_survive_its_power_loss(tmp_path: Path, namespace: ucm_db.Namespace) -> None:
    """gc's removals are durable when it returns (``ucm_db.remote.files.remove_all``): before, it unlinked without
    a directory fsync, and the objects it reported removed came back with the remote's power."""
    keys, _payloads = chain(namespace, BLOCKS)
    with PowerCutMount(tmp_path / "mnt", tmp_path) as mount:
        mount.strict_names(True)
        remote_dir = tmp_path / "mnt" / "remote"
        remote_dir.mkdir()
        _sync_dir(tmp_path / "mnt")
        url = f"file://{remote_dir}"
        log = tmp_path / "child.log"
        assert run_child(_put_and_flush, tmp_path / "store", url, namespace, log_path=log, timeout_s=120) == 0, tail(log)
        assert _on_remote(url, namespace, keys) == [True] * BLOCKS
        assert run_child(_gc_everything, url, log_path=log, timeout_s=120) == 0, tail(log)
        mount.cut("drop", 1)
        assert _on_remote(url, namespace, keys) == [False] * BLOCKS, "objects gc removed came back after a power loss"
