"""A delete on a store with a remote retracts what it deleted from the remote.

Wrong KV a delete removed (a connector's void of a save computed over a
failed load) came back: the remote still held it, and the next lookup
promoted it into the local tier again (tests/connector/test_void_retracts_remote.py).
Now the delete records a retraction of each block it removes, in its own
transaction, deletes their remote objects (children first), and, until a
while after that delete is confirmed, never reads them back from the
remote nor promotes them. These tests take the cases one by one: the plain
delete, a remote that refuses deletes, a restart in between, an upload that
lands after the delete, a store whose process is not the elected uploader,
a block computed again, a fetch made before the delete, and expiry.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

import ucm_db
from ucm_db.errors import TierError
from ucm_db.index import retractions, upload_queue
from ucm_db.remote.promotion import PromotionTarget, promote
from ucm_db.remote.tier import RemoteRoot, RemoteTier
from ucm_db.remote.uploader import Uploader

from .conftest import Remote, chain

CAP = 64 << 20


def _remote_has(remote: Remote, namespace: ucm_db.Namespace, keys: list[bytes]) -> list[bool]:
    return RemoteRoot.from_url(remote.url, dict(remote.options)).tier(namespace.id).exists(keys)


def _refuse_deletes(monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(self: RemoteTier, keys: Any) -> int:
        raise PermissionError("deletes refused (a write-once bucket)")
    monkeypatch.setattr(RemoteTier, "delete", refused)


def _pending(store: ucm_db.Store) -> list[retractions.Retraction]:
    return store._tier.uploads.retractions_due()


@pytest.mark.parametrize("mode", ["write_back", "write_through"])
def test_a_delete_takes_the_remote_objects_of_the_blocks_and_their_descendants(
    remote: Remote, tmp_path: Path, namespace: ucm_db.Namespace, mode: str,
) -> None:
    keys, payloads = chain(namespace, 6)
    with ucm_db.open(tmp_path / "a", capacity_bytes=CAP, **remote.store_options(remote_mode=mode)) as store:
        store.put(namespace, keys, payloads)
        store.flush(upload_timeout_s=30)
        assert _remote_has(remote, namespace, keys) == [True] * 6
        assert store.delete(namespace, [keys[2]], remote=True) == 4  # block 2 and its descendants
        assert _remote_has(remote, namespace, keys) == [True, True, False, False, False, False]
        assert store.lookup(namespace, keys) == 2
        store.flush(upload_timeout_s=30)
        assert store.stats().remote["retracted"] >= 4
    with ucm_db.open(tmp_path / "b", capacity_bytes=CAP, **remote.store_options(remote_deadline_s=10)) as other:
        assert other.lookup(namespace, keys) == 2


@pytest.mark.parametrize("remote", ["file"], indirect=True)
def test_a_refused_remote_delete_is_retried_and_never_read_back_meanwhile(
    remote: Remote, tmp_path: Path, namespace: ucm_db.Namespace, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The remote refuses deletes: the blocks go locally all the same, stay
    unreadable from the remote here (lookup, get), ``flush`` says so, and a
    restart with a remote that deletes again finishes the job."""
    keys, payloads = chain(namespace, 4)
    with ucm_db.open(tmp_path / "a", capacity_bytes=CAP, **remote.store_options(remote_deadline_s=0.05)) as store:
        store.put(namespace, keys, payloads)
        store.flush(upload_timeout_s=30)
        with monkeypatch.context() as patch:
            _refuse_deletes(patch)
            assert store.delete(namespace, [keys[2]], remote=True) == 2
            assert _remote_has(remote, namespace, keys) == [True] * 4  # still there: the delete was refused
            assert sorted(r.key for r in _pending(store)) == sorted(keys[2:])
            assert store.lookup(namespace, keys) == 2, "a lookup promoted a deleted block back"
            assert store.get(namespace, keys[2:]) == [None, None], "a get served a deleted block from the remote"
            with pytest.raises(TierError, match="deleted block"):
                store.flush(upload_timeout_s=0.3)
            store._wing.uploader.stop()  # a crash before the retry: the retractions are on disk
    with ucm_db.open(tmp_path / "a", capacity_bytes=CAP, **remote.store_options()) as store:
        store.flush(upload_timeout_s=30)
        assert _remote_has(remote, namespace, keys) == [True, True, False, False]
        assert _pending(store) == []


@pytest.mark.parametrize("remote", ["file"], indirect=True)
def test_an_upload_that_lands_after_the_delete_is_deleted_again(
    remote: Remote, tmp_path: Path, namespace: ucm_db.Namespace, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The uploader read block 3 before its delete and sends it after (a
    slow remote): the delete cannot wait for that batch, and the uploader's
    pass after the batch deletes the object it just wrote."""
    keys, payloads = chain(namespace, 4)
    started, release = threading.Event(), threading.Event()
    real_store = RemoteTier.store

    def slow_store(self: RemoteTier, key: bytes, parent: bytes | None, blob: Any) -> int:
        if key == keys[3]:
            started.set()
            assert release.wait(30)
        return real_store(self, key, parent, blob)

    monkeypatch.setattr(RemoteTier, "store", slow_store)
    with ucm_db.open(tmp_path / "a", capacity_bytes=CAP, **remote.store_options(remote_deadline_s=0.05)) as store:
        store.put(namespace, keys, payloads)
        assert started.wait(30), "the uploader's batch reached block 3"
        assert store.delete(namespace, [keys[3]], remote=True) == 1  # the batch holds the uploads: its retraction stays pending
        assert [r.key for r in _pending(store)] == [keys[3]]
        release.set()
        store.flush(upload_timeout_s=30)
        assert _remote_has(remote, namespace, keys) == [True, True, True, False]


@pytest.mark.parametrize("remote", ["file"], indirect=True)
def test_a_store_not_elected_leaves_the_confirmation_to_the_elected_uploader(
    remote: Remote, tmp_path: Path, namespace: ucm_db.Namespace, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Another process's uploader may still be sending a block this store
    deleted: this store deletes the object at once but does not confirm; the
    elected uploader deletes it again after its batch (here: it landed)."""
    keys, payloads = chain(namespace, 3)
    monkeypatch.setattr(Uploader, "_take_lock", lambda self: False)  # another process holds the election
    with ucm_db.open(tmp_path / "a", capacity_bytes=CAP, **remote.store_options(remote_mode="write_through")) as store:
        store.put(namespace, keys, payloads)
        assert store.delete(namespace, [keys[2]], remote=True) == 1
        assert _remote_has(remote, namespace, keys) == [True, True, False]
        assert [r.key for r in _pending(store)] == [keys[2]]  # deleted, not confirmed
        late = chain(namespace, 3)  # the other process's batch lands now
        RemoteRoot.from_url(remote.url).tier(namespace.id).store(keys[2], keys[1], _blob_of(tmp_path, namespace, late))
        assert store.lookup(namespace, keys) == 2  # still never promoted
        monkeypatch.undo()  # the election comes to this store's uploader
        store.flush(upload_timeout_s=30)
        assert _remote_has(remote, namespace, keys) == [True, True, False]
        assert _pending(store) == []


def _blob_of(tmp_path: Path, namespace: ucm_db.Namespace, keys_payloads: tuple[list[bytes], list[bytes]]) -> bytes:
    """Block 2 of a chain, as a store holds it (what an upload sends)."""
    keys, payloads = keys_payloads
    with ucm_db.open(tmp_path / "blob", capacity_bytes=CAP) as scratch:
        scratch.put(namespace, keys, payloads)
        return scratch._tier.read_blobs([keys[2]])[0]


@pytest.mark.parametrize("remote", ["memory", "file"], indirect=True)
def test_a_block_computed_again_after_its_delete_reaches_the_remote(
    remote: Remote, tmp_path: Path, namespace: ucm_db.Namespace, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Put again (recomputed) right after its delete: whatever order its
    upload and the retraction's delete take, the remote ends with it."""
    keys, payloads = chain(namespace, 3)
    again = payloads[:2] + [b"recomputed" + payloads[2][10:]]
    monkeypatch.setattr(Uploader, "_take_lock", lambda self: False)  # another process's uploader is elected
    with ucm_db.open(tmp_path / "a", capacity_bytes=CAP, **remote.store_options(remote_mode="write_through")) as store:
        store.put(namespace, keys, payloads)
        assert store.delete(namespace, [keys[2]], remote=True) == 1  # deleted remotely, not confirmed
        store.put(namespace, keys[2:], again[2:], parent=keys[1])  # written through: on the remote
        assert _remote_has(remote, namespace, keys) == [True] * 3
        monkeypatch.undo()  # the elected pass: deletes the object again, then queues the block again
        store.flush(upload_timeout_s=30)
        assert _pending(store) == []
    with ucm_db.open(tmp_path / "b", capacity_bytes=CAP, **remote.store_options(remote_deadline_s=10)) as other:
        assert [None if p is None else bytes(p) for p in other.get(namespace, keys)] == again


@pytest.mark.parametrize("remote", ["file"], indirect=True)
def test_a_fetch_made_before_the_delete_is_not_promoted_after_it(
    remote: Remote, tmp_path: Path, namespace: ucm_db.Namespace, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A lookup fetched block 2 just before its delete and commits it just
    after (promotion checks retractions in its own transaction)."""
    keys, payloads = chain(namespace, 3)
    with ucm_db.open(tmp_path / "a", capacity_bytes=CAP, **remote.store_options()) as store:
        store.put(namespace, keys, payloads)
        store.flush(upload_timeout_s=30)
        fetched = RemoteRoot.from_url(remote.url).tier(namespace.id).fetch(keys[2])
        assert fetched is not None
        with monkeypatch.context() as patch:
            _refuse_deletes(patch)  # and its remote delete fails too
            assert store.delete(namespace, [keys[2]], remote=True) == 1
        target = PromotionTarget(namespace, lambda ns: None)
        assert promote(store._tier, [fetched], target) == 0
        assert store.lookup(namespace, keys, remote=False) == 2
        with monkeypatch.context() as patch:
            patch.setattr(retractions, "refuse", lambda txn, keys: None)
            assert promote(store._tier, [fetched], target) == 1, "the control: only the retraction refused it"
        store.flush(upload_timeout_s=30)


@pytest.mark.parametrize("remote", ["file"], indirect=True)
def test_confirmed_retractions_expire(
    remote: Remote, tmp_path: Path, namespace: ucm_db.Namespace, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After its grace a confirmed retraction goes: the block is read
    through again once another node uploads it."""
    monkeypatch.setattr(upload_queue, "RETRACTION_GRACE_S", 0.0)
    keys, payloads = chain(namespace, 3)
    with ucm_db.open(tmp_path / "a", capacity_bytes=CAP, **remote.store_options(remote_deadline_s=10)) as store:
        store.put(namespace, keys, payloads)
        assert store.delete(namespace, [keys[2]], remote=True) == 1
        store.flush(upload_timeout_s=30)
        time.sleep(0.01)
        assert _pending(store) == []  # and the confirmed one dropped on the way
        assert store._tier.uploads.first_retracted(keys) is None
        with ucm_db.open(tmp_path / "b", capacity_bytes=CAP, **remote.store_options()) as other:
            other.put(namespace, keys, payloads)
            other.flush(upload_timeout_s=30)
        assert store.lookup(namespace, keys) == 3
