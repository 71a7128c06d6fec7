"""Audit of tombstones against uploads in flight on another node: an
ancestor re-uploaded while another node retracts it does not stay.

The finding: node B promoted block 1 (wrong KV, node A's) before its void;
gc took block 1's object (old). B continued block 1 (block 2), and its
upload found block 1 absent with no tombstone, so B uploaded block 1 again
from its local tier (the ancestor repair). Meanwhile A voided block 1: it
wrote the tombstone and deleted the object (absent: nothing to delete) and
confirmed. B's re-upload, checked before the tombstone existed, landed after
it, and every node served the wrong block 1 again, with block 2 under it.
Now a re-uploaded ancestor's tombstone is read again once its upload has
landed (:mod:`ucm_db.remote.ancestry`): a retraction whose tombstone came
first is seen there, and one whose tombstone came after deletes the object
after it landed. Seen, B deletes its upload, and drops what hangs under it
(a delete that fails is retried by a later batch, which holds block 2 until
then).

The slow upload is simulated (``RemoteTier.store`` of block 1 waits for the
test: a PUT in flight while the other node voids); everything else is real:
two LMDB stores as nodes, a ``memory://``, ``file://`` or moto S3 remote.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

import ucm_db
from ucm_db.remote.tier import RemoteRoot, RemoteTier

from .conftest import Remote, chain

pytestmark = pytest.mark.timeout(180)
CAP = 64 << 20


def _root(remote: Remote) -> RemoteRoot:
    root = RemoteRoot.from_url(remote.url, dict(remote.options))
    root.fs.invalidate_cache()
    return root


def _hold_first_upload(monkeypatch: pytest.MonkeyPatch, key: bytes) -> tuple[threading.Event, threading.Event]:
    """The next upload of ``key`` waits for ``release`` before it writes;
    returns (started, release)."""
    started, release = threading.Event(), threading.Event()
    real_store = RemoteTier.store

    def held_store(self: RemoteTier, k: bytes, parent: bytes | None, blob: Any) -> int:
        if k == key and not started.is_set():
            started.set()
            assert release.wait(60)
        return real_store(self, k, parent, blob)

    monkeypatch.setattr(RemoteTier, "store", held_store)
    return started, release


def _refuse_first_delete(monkeypatch: pytest.MonkeyPatch, root: RemoteRoot) -> None:
    """The first delete through ``root`` (B's) fails."""
    refused: list[bool] = []
    real_delete = RemoteTier.delete

    def delete(self: RemoteTier, keys: Any) -> int:
        if self.remote is root and not refused:
            refused.append(True)
            raise ConnectionError("injected: delete refused once")
        return real_delete(self, keys)

    monkeypatch.setattr(RemoteTier, "delete", delete)


@pytest.mark.parametrize("undo_fails", [False, True], ids=["undone", "undo-retried"])
def test_an_ancestor_reupload_in_flight_during_a_void_does_not_stay(
    remote: Remote, tmp_path: Path, namespace: ucm_db.Namespace, monkeypatch: pytest.MonkeyPatch, undo_fails: bool,
) -> None:
    """``undo-retried``: B's first delete of its upload fails (simulated: the
    remote refuses it); block 2 stays queued until a later batch deletes it."""
    keys, payloads = chain(namespace, 3)
    payloads[1] = b"WRONG" + payloads[1][5:]
    opts = remote.store_options(remote_deadline_s=10)
    with ucm_db.open(tmp_path / "a", capacity_bytes=CAP, **remote.store_options(remote_mode="write_through")) as a, \
            ucm_db.open(tmp_path / "b", capacity_bytes=CAP, **opts) as b:
        a.put(namespace, keys[:2], payloads[:2])
        assert b.get(namespace, keys[:2]) == payloads[:2]  # B holds the wrong block 1
        _root(remote).tier(namespace.id).delete([keys[1]])  # as gc would: an old tail
        started, release = _hold_first_upload(monkeypatch, keys[1])
        if undo_fails:
            _refuse_first_delete(monkeypatch, b._wing.link.root)
        try:
            b.put(namespace, keys[2:], payloads[2:], parent=keys[1])
            assert started.wait(30), "B's upload re-uploads block 1 (absent, no tombstone yet)"
            assert a.delete(namespace, [keys[1]], remote=True) == 1  # the void, while B's upload is in flight
            a.flush(upload_timeout_s=30)
        finally:
            release.set()
        b.flush(upload_timeout_s=30)
        stats = b.stats().remote
    assert (stats["ancestors_retracted"], stats["dropped_under_retracted"]) == (1, 1), stats
    assert _root(remote).tier(namespace.id).exists(keys) == [True, False, False], \
        "the retracted block (or a block under it) is on the remote again"
    with ucm_db.open(tmp_path / "fresh", capacity_bytes=CAP, **opts) as fresh:
        assert fresh.lookup(namespace, keys) == 1
        assert fresh.get(namespace, keys[1:2]) == [None], "a node served the voided block"
