"""Review of eb42ace's write-through reopen
(:func:`ucm_db.index.retractions.reopen`, :meth:`ucm_db.remote.uploader.Uploader.upload_now`).

1. **A write-through upload landing between the elected uploader's remote
   delete and its confirmation stays.** ``reopen`` turns only a *confirmed*
   retraction back to pending. Process W (write-through, not elected) sends
   block 1; process E (elected) voids it: E's pass deletes the object (not
   there yet), and before E's ``confirm_retracted`` commits, W's upload
   lands and W's ``reopen`` finds the retraction still pending (a no-op).
   E then confirms: the voided block stays on the remote, served to every
   node, with nothing left to delete it. The window is a whole retraction
   round (every depth's deletes and tombstones run before the confirm).
2. **A write-through upload of the recomputed block reopens its retraction
   and the elected uploader deletes the correct object.** ``upload_now``
   reopens any confirmed retraction of a key it landed, even when the blob
   it sent was read after the retraction was recorded (the recomputed,
   correct block; in the elected process itself, where no pass can
   interleave). The pass deletes the correct object again; the block is
   requeued only if it is still stored then: evicted (or deleted locally)
   meanwhile, the correct object is gone from the remote for good (and its
   tombstone keeps other nodes from uploading it as an ancestor).

Real parts: LMDB stores, a second process for W, the election lock, a
``file://`` remote. Simulated: W's PUT of block 1 waits for the test, E's
confirmation waits for the test (case 1), and E's retraction passes wait
for the test (case 2): the interleavings, not the faults.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import ucm_db
from ucm_db.index.upload_queue import UploadQueue
from ucm_db.remote.tier import RemoteRoot
from ucm_db.remote.uploader import Uploader

from .conftest import Remote, chain
from .test_audit_uploads_write_through import WRITER

pytestmark = [pytest.mark.timeout(180), pytest.mark.multiprocess]
CAP = 64 << 20


def _remote_has(remote: Remote, namespace: ucm_db.Namespace, keys: list[bytes]) -> list[bool]:
    root = RemoteRoot.from_url(remote.url, dict(remote.options))
    root.fs.invalidate_cache()
    return root.tier(namespace.id).exists(keys)


def _elected(store: ucm_db.Store) -> None:
    deadline = time.monotonic() + 30
    while not store._wing.uploader.election.held:
        assert time.monotonic() < deadline, "the store never became the uploader"
        time.sleep(0.02)


@pytest.mark.parametrize("remote", ["file"], indirect=True)
def test_a_write_through_upload_landing_before_the_confirm_never_stays(
    remote: Remote, tmp_path: Path, namespace: ucm_db.Namespace, monkeypatch: pytest.MonkeyPatch,
) -> None:
    keys, _payloads = chain(namespace, 2)
    path = tmp_path / "store"
    entered, go = threading.Event(), threading.Event()
    real_confirm = UploadQueue.confirm_retracted

    def held_confirm(self: UploadQueue, done: Any) -> None:
        if not entered.is_set() and any(item.key == keys[1] for item in done):
            entered.set()  # E's remote delete of block 1 ran; its confirmation waits
            assert go.wait(60)
        real_confirm(self, done)

    monkeypatch.setattr(UploadQueue, "confirm_retracted", held_confirm)
    with ucm_db.open(path, capacity_bytes=CAP, **remote.store_options(remote_deadline_s=5)) as elected:
        _elected(elected)
        spec = {"store": str(path), "remote": remote.url, "options": remote.options, "namespace": namespace.to_dict()}
        writer = subprocess.Popen([sys.executable, "-c", WRITER, json.dumps(spec), str(Path(__file__).parent)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        void = threading.Thread(target=elected.delete, args=(namespace, [keys[1]]), kwargs={"remote": True})
        try:
            assert writer.stdout is not None and writer.stdin is not None
            line = writer.stdout.readline().strip()
            assert line == "STARTED", (line, writer.stderr.read() if writer.stderr else "")
            void.start()
            assert entered.wait(30)
            writer.stdin.write("\n")
            writer.stdin.flush()  # W's upload of block 1 lands now, and W reopens (nothing confirmed yet)
            assert writer.stdout.readline().strip() == "CLOSED"
            assert writer.wait(30) == 0
        finally:
            go.set()
            void.join(30)
            writer.kill()
            writer.wait()
        elected.flush(upload_timeout_s=30)
    assert _remote_has(remote, namespace, keys) == [True, False], "the voided block's late upload stayed"


@pytest.mark.parametrize("remote", ["file"], indirect=True)
def test_a_recomputed_write_through_upload_is_never_deleted_again(
    remote: Remote, tmp_path: Path, namespace: ucm_db.Namespace, monkeypatch: pytest.MonkeyPatch,
) -> None:
    keys, payloads = chain(namespace, 2)
    wrong = [payloads[0], b"WRONG" + payloads[1][5:]]
    passes_held = threading.Event()
    real_drain = Uploader.drain_retractions

    def held_drain(self: Uploader) -> tuple[int, int]:
        return (0, 0) if passes_held.is_set() else real_drain(self)

    monkeypatch.setattr(Uploader, "drain_retractions", held_drain)
    with ucm_db.open(tmp_path / "a", capacity_bytes=CAP, **remote.store_options(remote_mode="write_through")) as store:
        _elected(store)
        store.put(namespace, keys, wrong)
        assert store.delete(namespace, [keys[1]], remote=True) == 1  # the void: deleted and confirmed (elected)
        assert _remote_has(remote, namespace, keys) == [True, False]
        passes_held.set()  # the elected uploader's next pass has not run yet
        store.put(namespace, keys[1:], payloads[1:], parent=keys[0])  # recomputed; written through
        assert _remote_has(remote, namespace, keys) == [True, True]
        store.delete(namespace, [keys[1]])  # local only (as an eviction): the remote copy is meant to stay
        passes_held.clear()
        store.flush(upload_timeout_s=30)
        deleted = store.stats().remote["retracted"]
    with ucm_db.open(tmp_path / "other", capacity_bytes=CAP, **remote.store_options(remote_deadline_s=10)) as other:
        got = other.get(namespace, keys)
    assert [g is not None and bytes(g) == p for g, p in zip(got, payloads)] == [True, True], \
        f"the recomputed block's object was deleted from the remote ({deleted} remote deletes)"
