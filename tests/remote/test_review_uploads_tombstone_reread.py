"""Review of eb42ace's ancestor undo (:mod:`ucm_db.remote.ancestry`): the
second tombstone read, once an ancestor's re-upload has landed, is not
retried when it fails.

Node B re-uploads block 1 (wrong KV it promoted before A's void) as the
lost ancestor of its block 2; A voids block 1 while B's upload is in
flight (tombstone written, nothing to delete, confirmed). B's upload lands,
and its second tombstone read fails once (a transient remote error). The
failure is taken as a failed upload: block 2 waits, but block 1's object
stays and nothing owes its delete. B's next batch checks block 1, finds it
present (its own upload), and sends block 2 under it: the voided block is
served to every node, with its continuation, while A's retraction is
confirmed and nothing will delete it.

Real parts: two LMDB stores as nodes, a ``file://`` remote, A's real void.
Simulated: B's PUT of block 1 waits for the test (an upload in flight), and
B's second tombstone read raises once (a transient read error, which a
local directory cannot produce on demand).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

import ucm_db
from ucm_db.remote import ancestry
from ucm_db.remote.tier import RemoteRoot, RemoteTier

from .conftest import Remote, chain

pytestmark = pytest.mark.timeout(180)
CAP = 64 << 20


def _root(remote: Remote) -> RemoteRoot:
    root = RemoteRoot.from_url(remote.url, dict(remote.options))
    root.fs.invalidate_cache()
    return root


@pytest.mark.parametrize("remote", ["file"], indirect=True)
def test_a_failed_second_tombstone_read_never_leaves_the_retracted_ancestor(
    remote: Remote, tmp_path: Path, namespace: ucm_db.Namespace, monkeypatch: pytest.MonkeyPatch,
) -> None:
    keys, payloads = chain(namespace, 3)
    payloads[1] = b"WRONG" + payloads[1][5:]
    with ucm_db.open(tmp_path / "a", capacity_bytes=CAP, **remote.store_options(remote_mode="write_through")) as a, \
            ucm_db.open(tmp_path / "b", capacity_bytes=CAP, **remote.store_options(remote_deadline_s=10)) as b:
        a.put(namespace, keys[:2], payloads[:2])
        assert b.get(namespace, keys[:2]) == payloads[:2]  # B holds the wrong block 1
        _root(remote).tier(namespace.id).delete([keys[1]])  # as gc would: an old tail
        started, release = threading.Event(), threading.Event()
        real_store, real_has = RemoteTier.store, ancestry.has_tombstone
        reads: list[bytes] = []

        def held_store(self: RemoteTier, key: bytes, parent: bytes | None, blob: Any) -> int:
            if key == keys[1] and not started.is_set():
                started.set()
                assert release.wait(60)
            return real_store(self, key, parent, blob)

        def flaky_has(root: RemoteRoot, namespace_id: bytes, key: bytes) -> bool:
            reads.append(key)
            if key == keys[1] and reads.count(key) == 2:  # the read after B's upload landed
                raise ConnectionError("injected: one tombstone read fails")
            return real_has(root, namespace_id, key)

        monkeypatch.setattr(RemoteTier, "store", held_store)
        monkeypatch.setattr(ancestry, "has_tombstone", flaky_has)
        try:
            b.put(namespace, keys[2:], payloads[2:], parent=keys[1])
            assert started.wait(30), "B re-uploads block 1 (absent, no tombstone yet)"
            assert a.delete(namespace, [keys[1]], remote=True) == 1  # the void, while B's upload is in flight
            a.flush(upload_timeout_s=30)
        finally:
            release.set()
        b.flush(upload_timeout_s=30)
        assert reads.count(keys[1]) >= 2, "the second tombstone read never ran"
    assert _root(remote).tier(namespace.id).exists(keys) == [True, False, False], \
        "the retracted block (or a block under it) is on the remote again"


@pytest.mark.parametrize("remote", ["file"], indirect=True)
def test_the_undo_never_deletes_the_recomputed_block_another_node_uploaded(
    remote: Remote, tmp_path: Path, namespace: ucm_db.Namespace, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A voids block 1 while B's re-upload of it (wrong KV B promoted before
    the void) is in flight, recomputes block 1 and uploads it (correct). B's
    upload lands over it (``write_whole`` replaces), B sees the tombstone and
    deletes the object: A's correct block is gone from the remote, A's row
    left the queue, and nothing uploads it again. Simulated: B's PUT waits
    for the test (an upload in flight)."""
    keys, payloads = chain(namespace, 3)
    wrong = [payloads[0], b"WRONG" + payloads[1][5:]]
    opts = remote.store_options(remote_deadline_s=10)
    with ucm_db.open(tmp_path / "a", capacity_bytes=CAP, **opts) as a, \
            ucm_db.open(tmp_path / "b", capacity_bytes=CAP, **opts) as b:
        a.put(namespace, keys[:2], wrong)
        a.flush(upload_timeout_s=30)
        assert b.get(namespace, keys[:2]) == wrong  # B holds the wrong block 1
        _root(remote).tier(namespace.id).delete([keys[1]])  # as gc would: an old tail
        started, release = threading.Event(), threading.Event()
        real_store = RemoteTier.store

        def held_store(self: RemoteTier, key: bytes, parent: bytes | None, blob: Any) -> int:
            if key == keys[1] and self.remote is b._wing.link.root and not started.is_set():
                started.set()
                assert release.wait(60)
            return real_store(self, key, parent, blob)

        monkeypatch.setattr(RemoteTier, "store", held_store)
        try:
            b.put(namespace, keys[2:], payloads[2:], parent=keys[1])
            assert started.wait(30), "B re-uploads block 1 (absent, no tombstone yet)"
            assert a.delete(namespace, [keys[1]], remote=True) == 1  # the void
            a.flush(upload_timeout_s=30)
            a.put(namespace, keys[1:2], payloads[1:2], parent=keys[0])  # recomputed, correct
            a.flush(upload_timeout_s=30)
            assert _root(remote).tier(namespace.id).exists(keys[:2]) == [True, True]
        finally:
            release.set()  # B's upload lands over A's, B reads the tombstone and deletes
        b.flush(upload_timeout_s=30)
        a.flush(upload_timeout_s=30)
    with ucm_db.open(tmp_path / "fresh", capacity_bytes=CAP, **opts) as fresh:
        got = fresh.get(namespace, keys[:2])
    assert [g is not None and bytes(g) == p for g, p in zip(got, payloads[:2])] == [True, True], \
        "the recomputed block 1 is gone from the remote (or wrong there)"
