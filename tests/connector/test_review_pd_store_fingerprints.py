"""Review of 2bbb753 (b): a publication names its stores, and a consumer
waits only for one naming a store it reads (roles.store_fingerprints).

1. A remote tier is named by its URL's text (trailing slashes dropped), not
   by what it reaches: the same shared directory under another mount path
   (a symlink here; an NFS export mounted at another path on the decode
   nodes, a pod's other mountPath), or the same bucket through another
   fsspec protocol alias (``s3a://`` for ``s3://``, ``gcs://`` for ``gs://``),
   is "a store it does not read". The consumer
   then does an ordinary lookup, silently (no log line, no counter): it
   no longer waits for announced blocks that are not visible yet, which it
   did before this commit.
2. A local store is named by ``st_dev:st_ino`` alone, with nothing of the
   node: identically provisioned nodes (the same image, the same mount
   order, a directory baked into the image) name their own, different,
   local caches alike, and a consumer's local-cache child waits
   ``load_deadline_s`` for blocks it never gets: the behaviour the commit
   removed. Two nodes cannot be had here: the second node's ``os.stat`` and
   its kernel's boot id are replaced by what that node's would answer (mocks,
   for that reason).

Fixed (roles.py): a remote is named by its URL with fsspec's aliases merged
(s3a/s3n -> s3), trailing slashes dropped and a ``file://`` directory by its
resolved path on the node (a symlinked mount path matches; an NFS export
mounted at another path on another node still does not: a publication naming
no store the engine reads is logged once, naming the fix); a local store by
the node's boot id with its device and inode.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ucm_db.connector import roles
from ucm_db.connector.roles import Publication, store_fingerprints


def _published_to(stores: tuple[str, ...]) -> Publication:
    return Publication("ns", 4, 16, "00" * 32, "remote", stores)


def test_a_shared_directory_under_another_mount_path_is_the_same_remote(tmp_path: Path) -> None:
    shared = tmp_path / "nfs" / "kv"
    shared.mkdir(parents=True)
    (tmp_path / "mnt").mkdir()
    os.symlink(tmp_path / "nfs", tmp_path / "mnt" / "nfs")  # the decode node mounts the export elsewhere
    prefill_local, decode_local = tmp_path / "p", tmp_path / "d"
    prefill_local.mkdir()
    decode_local.mkdir()
    producer = store_fingerprints(prefill_local, f"file://{shared}")
    consumer = store_fingerprints(decode_local, f"file://{tmp_path / 'mnt' / 'nfs' / 'kv'}")
    assert _published_to(producer).reaches(consumer)


@pytest.mark.parametrize("theirs", ["s3a://bucket/kv", "s3n://bucket/kv/", "S3://bucket/kv//"])  # s3fs: one root, "bucket/kv"
def test_one_bucket_under_another_spelling_is_the_same_remote(tmp_path: Path, theirs: str) -> None:
    producer = store_fingerprints(tmp_path / "p", "s3://bucket/kv")
    consumer = store_fingerprints(tmp_path / "d", theirs)
    assert _published_to(producer).reaches(consumer)


def test_two_nodes_own_local_caches_are_not_the_same_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    prefill_node = store_fingerprints(cache, None)  # node A's cache, no remote
    real = os.stat(cache)

    class _OtherNode:  # node B's own cache at the same path: what its stat answers on an identical node
        st_dev, st_ino = real.st_dev, real.st_ino

    real_stat = os.stat

    def node_b_stat(path: object, *args: object, **kwargs: object) -> object:
        return _OtherNode() if Path(str(path)) == cache else real_stat(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(roles, "node_identity", lambda: "boot:node-b", raising=False)  # and its kernel's boot id, its own
    monkeypatch.setattr(roles.os, "stat", node_b_stat)
    decode_node = store_fingerprints(cache, None)
    monkeypatch.undo()
    assert not _published_to(prefill_node).reaches(decode_node)


def test_one_directory_is_one_local_store_wherever_it_is_mounted_on_a_node(tmp_path: Path) -> None:
    """The node's identity keeps what the device and inode gave: two mount
    paths (here a symlink) of one directory on one node are one store."""
    cache = tmp_path / "cache"
    cache.mkdir()
    os.symlink(cache, tmp_path / "mounted")
    assert store_fingerprints(cache, None) == store_fingerprints(tmp_path / "mounted", None)


def test_other_remotes_stay_apart(tmp_path: Path) -> None:
    producer = store_fingerprints(tmp_path / "p", "s3://bucket/kv")
    for theirs in ("s3://bucket/kv2", "gs://bucket/kv", f"file://{tmp_path / 'kv'}"):
        assert not _published_to(producer).reaches(store_fingerprints(tmp_path / "d", theirs))


def test_a_publication_no_store_of_this_process_reads_is_logged_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """A consumer that does not wait because the stores named are none it
    reads says so once per process, naming the fix (spell the remote alike);
    a publication another ucm-db connector of the process reads is not logged
    (a local cache child in front of the shared store: MultiConnector)."""
    pytest.importorskip("vllm")
    from ucm_db.connector.scheduler import publications

    read = store_fingerprints(tmp_path / "d", "s3://bucket/kv")
    monkeypatch.setattr(publications, "_read_stores", set(read))
    monkeypatch.setattr(publications, "_told_unread", False)
    with caplog.at_level("WARNING"):
        publications._tell_unread(_published_to(store_fingerprints(tmp_path / "p", "s3a://bucket/kv")))  # read here
        assert not caplog.records
        for _ in range(2):
            publications._tell_unread(_published_to(store_fingerprints(tmp_path / "p", "s3://bucket/other")))
    assert len(caplog.records) == 1 and "spell its remote alike" in caplog.records[0].getMessage()
