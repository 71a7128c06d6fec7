"""A store that closes while its uploads run keeps the uploader election
until they have landed.

The audit (r3): close stopped the uploader while block 1's upload was still
on the upload pool, gave the pool up without waiting, and let go of the
election lock (``uploader.lock``). The store opened again (or another
process of the store directory) became the uploader at once; a delete of
block 1 there (``remote=True``: its KV was wrong) deleted the remote object,
confirmed the retraction, and ``flush`` returned; then the abandoned upload
landed, and every other node served the wrong block 1 for good.

Now an uploader lets go of the election only once every call it started on
its pool has ended: whoever is elected next confirms a retraction only after
the last upload that read the block before its delete has landed. Close
still returns at once, whatever the remote does.

The slow (or hung) upload is simulated: ``RemoteTier.store`` of one key
waits before it writes (a slow PUT, a stalled NFS server). Everything else
is real: LMDB stores, the election lock, a ``memory://``, ``file://`` or
moto S3 remote.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

import ucm_db
from ucm_db.errors import TierError
from ucm_db.remote.tier import RemoteRoot, RemoteTier

from .conftest import Remote, chain

pytestmark = pytest.mark.timeout(180)
CAP = 64 << 20
#: How long the simulated slow upload takes.
SLOW_S = 2.0


def _remote_has(remote: Remote, namespace: ucm_db.Namespace, keys: list[bytes]) -> list[bool]:
    root = RemoteRoot.from_url(remote.url, dict(remote.options))
    root.fs.invalidate_cache()
    return root.tier(namespace.id).exists(keys)


def _held_upload(monkeypatch: pytest.MonkeyPatch, key: bytes, release: threading.Event | None = None,
                 ) -> tuple[threading.Event, threading.Event]:
    """Makes the first upload of ``key`` slow: it waits :data:`SLOW_S` (or
    for ``release``) before writing. Returns (started, landed) events."""
    started, landed = threading.Event(), threading.Event()
    real_store = RemoteTier.store

    def slow_store(self: RemoteTier, k: bytes, parent: bytes | None, blob: Any) -> int:
        if k != key or started.is_set():
            return real_store(self, k, parent, blob)
        started.set()
        if release is None:
            time.sleep(SLOW_S)
        else:
            assert release.wait(60)
        try:
            return real_store(self, k, parent, blob)
        finally:
            landed.set()

    monkeypatch.setattr(RemoteTier, "store", slow_store)
    return started, landed


def test_an_upload_left_running_at_close_lands_before_its_retraction_is_confirmed(
    remote: Remote, tmp_path: Path, namespace: ucm_db.Namespace, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The audit's r3: block 1 (wrong KV) is uploading when the store closes;
    opened again, the store deletes it with ``remote=True`` and flushes. The
    flush used to return with the retraction confirmed before the upload
    landed; now the retraction is confirmed after it, and deletes it."""
    keys, payloads = chain(namespace, 2)
    wrong = [payloads[0], b"WRONG" + payloads[1][5:]]
    started, landed = _held_upload(monkeypatch, keys[1])
    options = remote.store_options(remote_mode="write_back", remote_deadline_s=5)
    store = ucm_db.open(tmp_path / "a", capacity_bytes=CAP, **options)
    store.put(namespace, keys, wrong)
    assert started.wait(30), "the uploader reached block 1"
    began = time.monotonic()
    store.close()
    assert time.monotonic() - began < SLOW_S, "close waited for the upload"
    with ucm_db.open(tmp_path / "a", capacity_bytes=CAP, **options) as store:
        assert store.delete(namespace, [keys[1]], remote=True) == 1
        store.flush(upload_timeout_s=60)
        assert landed.wait(30)
        assert _remote_has(remote, namespace, keys) == [True, False], "the abandoned upload landed after the retraction"
    with ucm_db.open(tmp_path / "b", capacity_bytes=CAP, **remote.store_options(remote_deadline_s=10)) as other:
        assert other.lookup(namespace, keys) == 1
        assert other.get(namespace, keys[1:]) == [None], "another node served the deleted (wrong) block"


@pytest.mark.parametrize("remote", ["file"], indirect=True)
def test_a_hung_upload_never_holds_up_close_and_keeps_the_election_until_it_ends(
    remote: Remote, tmp_path: Path, namespace: ucm_db.Namespace, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A remote that stops answering mid-upload: close returns at once, and
    no uploader of the store directory takes over (so nothing is confirmed
    under the hung write) until the write ends; then the next one drains."""
    keys, payloads = chain(namespace, 3)
    release = threading.Event()
    started, landed = _held_upload(monkeypatch, keys[1], release)
    options = remote.store_options(remote_mode="write_back", remote_deadline_s=5)
    store = ucm_db.open(tmp_path / "a", capacity_bytes=CAP, **options)
    try:
        store.put(namespace, keys[:2], payloads[:2])
        assert started.wait(30)
        began = time.monotonic()
        store.close()
        assert time.monotonic() - began < 5, "close waited for a hung upload"
        with ucm_db.open(tmp_path / "a", capacity_bytes=CAP, **options) as again:
            again.put(namespace, keys[2:], payloads[2:], parent=keys[1])
            with pytest.raises(TierError, match="still waiting for upload"):
                again.flush(upload_timeout_s=1.5)  # the hung upload still holds the election
            release.set()
            again.flush(upload_timeout_s=60)
            assert landed.is_set()
        assert _remote_has(remote, namespace, keys) == [True, True, True]
    finally:
        release.set()
