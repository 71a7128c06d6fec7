"""A retraction leaves a tombstone where it deletes a block's object, and no
node uploads that block again as a lost ancestor.

The finding: the uploaders' ancestor repair (:mod:`ucm_db.remote.ancestry`)
uploads again, from the local tier, a parent it finds absent from the
remote, for a continuation to land under. Node A voided block 1 (its KV was
wrong) and retracted it: its object deleted, confirmed. Node B had promoted
block 1 into its local tier just before (a reader in the step before the
void). When B uploaded a continuation of block 1, it found block 1 absent,
took it for gc'd, and re-published the wrong block 1 to the whole fleet
(before the repair, the continuation landed under nothing, unreachable).

Now a retraction writes ``<key hex>.retracted`` beside the object before it
deletes it (:mod:`ucm_db.remote.tombstones`); a parent found absent with a
tombstone is never uploaded again, and the queued blocks under it leave the
queue without an upload; gc lists tombstones apart and removes them after a
week. Real LMDB stores as nodes, one shared remote (``memory://``,
``file://``, moto S3).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import ucm_db
from ucm_db.components import local_tier
from ucm_db.remote import retraction
from ucm_db.remote.gc import gc
from ucm_db.remote.tier import RemoteRoot
from ucm_db.remote.uploader import Uploader

from .conftest import Remote, chain
from .test_upload_ancestors import uploads_held

pytestmark = pytest.mark.timeout(180)
CAP = 64 << 20
DAY_S = 86400.0


def _root(remote: Remote) -> RemoteRoot:
    root = RemoteRoot.from_url(remote.url, dict(remote.options))
    root.fs.invalidate_cache()
    return root


def _remote_has(remote: Remote, namespace: ucm_db.Namespace, keys: list[bytes]) -> list[bool]:
    return _root(remote).tier(namespace.id).exists(keys)


def _tombstone(remote: Remote, namespace: ucm_db.Namespace, key: bytes) -> str:
    root = _root(remote)
    return root.object_path(namespace.id, key) + ".retracted"


def _void_after_a_reader(remote: Remote, tmp_path: Path, namespace: ucm_db.Namespace,
                         ) -> tuple[list[bytes], list[bytes]]:
    """Node A writes blocks 0 and 1 (1 is wrong) through; node B reads both
    through (promoted into its local tier); A deletes block 1 with
    ``remote=True`` and flushes (its retraction confirmed)."""
    keys, payloads = chain(namespace, 3)
    payloads[1] = b"WRONG" + payloads[1][5:]
    with ucm_db.open(tmp_path / "a", capacity_bytes=CAP, **remote.store_options(remote_mode="write_through")) as a:
        a.put(namespace, keys[:2], payloads[:2])
        with ucm_db.open(tmp_path / "b", capacity_bytes=CAP, **remote.store_options(remote_deadline_s=10)) as b:
            assert b.get(namespace, keys[:2]) == payloads[:2]  # B holds the wrong block 1 now
        assert a.delete(namespace, [keys[1]], remote=True) == 1
        a.flush(upload_timeout_s=30)
    assert _remote_has(remote, namespace, keys[:2]) == [True, False]
    return keys, payloads


@pytest.mark.parametrize("mode", ["write_back", "write_through"])
def test_a_node_that_read_a_block_before_its_void_never_uploads_it_again(
    remote: Remote, tmp_path: Path, namespace: ucm_db.Namespace, mode: str,
) -> None:
    """B continues block 1 (block 2, computed over the wrong block 1 it
    holds): its upload finds block 1 absent. It used to upload the wrong
    block 1 again, and a fresh node served it; now the tombstone stops it,
    and block 2 leaves B's queue without an upload."""
    keys, payloads = _void_after_a_reader(remote, tmp_path, namespace)
    with ucm_db.open(tmp_path / "b", capacity_bytes=CAP, **remote.store_options(remote_mode=mode, remote_deadline_s=10)) as b:
        b.put(namespace, keys[2:], payloads[2:], parent=keys[1])
        b.flush(upload_timeout_s=30)
        stats = b.stats().remote
    assert _remote_has(remote, namespace, keys) == [True, False, False], "the retracted block was uploaded again"
    assert (stats["ancestors_retracted"], stats["dropped_under_retracted"], stats["ancestors_reuploaded"]) == (1, 1, 0), stats
    with ucm_db.open(tmp_path / "fresh", capacity_bytes=CAP, **remote.store_options(remote_deadline_s=10)) as fresh:
        assert fresh.lookup(namespace, keys) == 1
        assert fresh.get(namespace, keys[1:2]) == [None]
    assert _root(remote).fs.exists(_tombstone(remote, namespace, keys[1])), "the retraction left no tombstone"


@pytest.mark.parametrize("remote", ["file"], indirect=True)
def test_the_tombstone_is_written_before_the_delete(
    remote: Remote, tmp_path: Path, namespace: ucm_db.Namespace, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A tombstone that cannot be written (simulated: the remote refuses
    that write) leaves the object in place and the retraction pending: the
    object is never gone without its tombstone. The next pass writes both."""
    keys, payloads = chain(namespace, 2)
    with ucm_db.open(tmp_path / "a", capacity_bytes=CAP, **remote.store_options(remote_mode="write_through",
                                                                                   remote_deadline_s=0.2)) as a:
        a.put(namespace, keys, payloads)
        with monkeypatch.context() as patch:
            def refused(*args: object) -> None:
                raise PermissionError("tombstone write refused")
            patch.setattr(retraction, "write_tombstone", refused)
            assert a.delete(namespace, [keys[1]], remote=True) == 1
            assert _remote_has(remote, namespace, keys) == [True, True]
            assert [r.key for r in local_tier(a).uploads.retractions_due()] == [keys[1]]
        a.flush(upload_timeout_s=30)
        assert _remote_has(remote, namespace, keys) == [True, False]
        assert Path(_tombstone(remote, namespace, keys[1])).exists()


def test_gc_lists_tombstones_apart_and_removes_them_after_a_week(
    remote: Remote, tmp_path: Path, namespace: ucm_db.Namespace,
) -> None:
    """A tombstone is neither an object nor an entry gc leaves alone
    (``skipped_entries``); the rules never take it, and it goes once a week
    old. A file of that name that is not ucm-db's tombstone stays."""
    keys, _payloads = _void_after_a_reader(remote, tmp_path, namespace)
    root = _root(remote)
    foreign = root.object_path(namespace.id, keys[2]) + ".retracted"
    root.fs.makedirs(foreign.rsplit("/", 1)[0], exist_ok=True)
    root.fs.pipe_file(foreign, b"someone else's file")
    assert sorted(root.tier(namespace.id).iterate()) == [keys[0]], "a listing of the tier took a tombstone for a block"
    report = gc(root, older_than_s=None, max_bytes=None, dry_run=False, now_s=time.time() + 6 * DAY_S)
    assert (report["objects_before"], report["skipped_entries"], report["tombstones"]) == (1, 0, 2), report
    assert report["tombstones_removed"] == 0
    report = gc(root, older_than_s=None, max_bytes=None, dry_run=True, now_s=time.time() + 8 * DAY_S)
    assert report["tombstones_removed"] == 1 and root.fs.exists(_tombstone(remote, namespace, keys[1]))
    report = gc(root, older_than_s=None, max_bytes=None, dry_run=False, now_s=time.time() + 8 * DAY_S)
    assert report["tombstones_removed"] == 1, report
    root.fs.invalidate_cache()
    assert not root.fs.exists(_tombstone(remote, namespace, keys[1]))
    assert root.fs.exists(foreign)
    assert _remote_has(remote, namespace, keys[:1]) == [True]


def test_a_void_before_the_first_upload_leaves_a_namespace_gc_takes_for_ucm_dbs(
    remote: Remote, tmp_path: Path, namespace: ucm_db.Namespace,
) -> None:
    """A save voided before its upload (its namespace has nothing on the
    remote yet): the tombstones make the namespace's directory, so its
    manifest is written first; gc then lists them, and never counts the
    directory as an entry that is not ucm-db's."""
    keys, payloads = chain(namespace, 2)
    with uploads_held(tmp_path / "a") as release, ucm_db.open(
            tmp_path / "a", capacity_bytes=CAP, **remote.store_options(remote_deadline_s=10)) as a:
        a.put(namespace, keys, payloads)  # queued: another process of the store holds the election
        assert a.delete(namespace, [keys[0]], remote=True) == 2
        release()
        a.flush(upload_timeout_s=30)
    root = _root(remote)
    assert root.read_manifest(namespace.id) is not None
    report = gc(root, older_than_s=None, max_bytes=None, dry_run=True)
    assert (report["objects_before"], report["skipped_entries"], report["tombstones"]) == (0, 0, 2), report


@pytest.mark.parametrize("remote", ["memory"], indirect=True)
def test_the_node_that_retracted_a_block_lets_its_own_continuation_go(
    remote: Remote, tmp_path: Path, namespace: ucm_db.Namespace,
) -> None:
    """The node whose delete wrote the tombstone knows its own: that delete
    took the block's whole tree here, so what it queued under the block
    since was computed anew. A batch root over such a parent (absent, with
    a tombstone, retracted here) goes, as before: it is not dropped."""
    keys, payloads = chain(namespace, 3)
    with ucm_db.open(tmp_path / "a", capacity_bytes=CAP, **remote.store_options(remote_mode="write_through")) as a:
        a.put(namespace, keys[:2], payloads[:2])
        assert a.delete(namespace, [keys[1]], remote=True) == 1
        a.flush(upload_timeout_s=30)
        a.put(namespace, keys[1:], payloads[1:], parent=keys[0])  # recomputed, and continued
        assert _remote_has(remote, namespace, keys[1:2]) == [True]
        _root(remote).tier(namespace.id).delete([keys[1]])  # as if gc, or a stale pass, took it again
        uploader = Uploader(local_tier(a), _root(remote), a.path, concurrency=2)  # never started: no election
        try:
            repair = uploader.ancestry.before_batch([(keys[2], keys[1], namespace.id, 2, b"")])
            assert repair is not None and repair.dropped == frozenset() and repair.held_back == frozenset(), repair
            assert (uploader.ancestry.retracted, uploader.ancestry.missing) == (0, 1)
        finally:
            uploader.stop()
