"""Audit of write-through uploads against deletes with ``remote=True``.

Two findings, one mechanism (:meth:`ucm_db.remote.uploader.Uploader.upload_now`):

* **A write-through upload outside the election landed after the
  retraction was confirmed.** Process W (write-through, not the store
  directory's elected uploader) put block 1 and sent it; process E (the
  elected uploader) deleted block 1 with ``remote=True`` meanwhile: its
  retraction deleted the object (not there yet) and was confirmed at once,
  and W's upload landed after. Every node served the deleted (wrong) KV
  (docs/remote.md listed it as not covered). Now a write-through upload,
  once landed, reopens a confirmed retraction of its key: the elected
  uploader deletes the object again after it.
* **A write-through put uploaded the bytes of a block deleted since.**
  A put's ``upload_now`` sent the blob the put had stored, if the key was
  still queued. Deleted (``remote=True``) and put again (recomputed) by
  another thread before that ``upload_now`` ran, the key was queued for the
  new block: the old (wrong) bytes went to the remote, and the new block's
  row was removed as uploaded. Now a write-through upload sends a blob only
  while it is the block stored under the key (same head: key, sizes,
  checksum), and removes a row only while it is still that block's.

Real parts: LMDB stores, a second process for W, the election lock, the
remote (``memory://`` is per process, so ``file://`` and moto S3 for the
two-process case). Simulated: a slow PUT (``RemoteTier.store`` of block 1
waits for the test) and, in one process, the order in which two threads
reach ``upload_now`` (each call waits for the test).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import ucm_db
from ucm_db.remote.tier import RemoteRoot
from ucm_db.remote.uploader import Uploader

from .conftest import Remote, chain

pytestmark = [pytest.mark.timeout(180), pytest.mark.multiprocess]
CAP = 64 << 20

#: Process W: a write-through store whose upload of block 1 waits for a line on stdin.
WRITER = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[2])
    import ucm_db
    from ucm_db.remote.tier import RemoteTier
    from node_proc import chain
    spec = json.loads(sys.argv[1])
    namespace = ucm_db.Namespace.from_dict(spec["namespace"])
    keys, payloads = chain(namespace, 2)
    payloads[1] = b"WRONG" + payloads[1][5:]
    real_store = RemoteTier.store
    def held_store(self, key, parent, blob):
        if key == keys[1]:
            print("STARTED", flush=True)
            sys.stdin.readline()
        return real_store(self, key, parent, blob)
    RemoteTier.store = held_store
    store = ucm_db.open(spec["store"], capacity_bytes=64 << 20, remote=spec["remote"], remote_options=spec["options"],
                        remote_mode="write_through")
    assert not store._wing.uploader.election.held
    store.put(namespace, keys, payloads)
    store.close()
    print("CLOSED", flush=True)
""")


def _remote_has(remote: Remote, namespace: ucm_db.Namespace, keys: list[bytes]) -> list[bool]:
    root = RemoteRoot.from_url(remote.url, dict(remote.options))
    root.fs.invalidate_cache()
    return root.tier(namespace.id).exists(keys)


def _elected(store: ucm_db.Store) -> None:
    deadline = time.monotonic() + 30
    while not store._wing.uploader.election.held:
        assert time.monotonic() < deadline, "the store never became the uploader"
        time.sleep(0.02)


@pytest.mark.parametrize("remote", ["file", pytest.param("s3", marks=pytest.mark.s3)], indirect=True)
def test_a_write_through_upload_outside_the_election_never_lands_after_the_retraction(
    remote: Remote, tmp_path: Path, namespace: ucm_db.Namespace,
) -> None:
    keys, _payloads = chain(namespace, 2)
    path = tmp_path / "store"
    with ucm_db.open(path, capacity_bytes=CAP, **remote.store_options(remote_deadline_s=5)) as elected:
        _elected(elected)
        spec = {"store": str(path), "remote": remote.url, "options": remote.options, "namespace": namespace.to_dict()}
        writer = subprocess.Popen([sys.executable, "-c", WRITER, json.dumps(spec), str(Path(__file__).parent)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert writer.stdout is not None and writer.stdin is not None
            line = writer.stdout.readline().strip()
            assert line == "STARTED", (line, writer.stderr.read() if writer.stderr else "")
            assert elected.delete(namespace, [keys[1]], remote=True) == 1  # elected: confirmed at once
            writer.stdin.write("\n")
            writer.stdin.flush()  # W's upload of block 1 lands now
            assert writer.stdout.readline().strip() == "CLOSED"
            assert writer.wait(30) == 0
        finally:
            writer.kill()
            writer.wait()
        elected.flush(upload_timeout_s=30)
    assert _remote_has(remote, namespace, keys) == [True, False], "the deleted block's late upload stayed"
    with ucm_db.open(tmp_path / "other", capacity_bytes=CAP, **remote.store_options(remote_deadline_s=10)) as other:
        assert other.get(namespace, keys[1:]) == [None], "another node served the deleted (wrong) block"


@pytest.mark.parametrize("remote", ["memory", "file"], indirect=True)
def test_a_write_through_put_never_uploads_the_bytes_of_a_block_deleted_since(
    remote: Remote, tmp_path: Path, namespace: ucm_db.Namespace, monkeypatch: pytest.MonkeyPatch,
) -> None:
    keys, payloads = chain(namespace, 2)
    wrong = [payloads[0], b"WRONG" + payloads[1][5:]]
    gates = [(threading.Event(), threading.Event()) for _ in range(2)]
    waiting = list(gates)
    real_upload_now = Uploader.upload_now

    def held_upload_now(self: Uploader, items: Any) -> list[str]:
        if waiting and any(item[0] == keys[1] for item in items):
            entered, go = waiting.pop(0)
            entered.set()
            assert go.wait(30)
        return real_upload_now(self, items)

    monkeypatch.setattr(Uploader, "upload_now", held_upload_now)
    with ucm_db.open(tmp_path / "a", capacity_bytes=CAP, **remote.store_options(remote_mode="write_through")) as store:
        _elected(store)
        first = threading.Thread(target=store.put, args=(namespace, keys, wrong))
        first.start()
        assert gates[0][0].wait(30)  # the wrong put committed; its upload waits
        assert store.delete(namespace, [keys[1]], remote=True) == 1  # the void (confirmed: elected)
        second = threading.Thread(target=store.put, args=(namespace, keys[1:], payloads[1:]), kwargs={"parent": keys[0]})
        second.start()
        assert gates[1][0].wait(30)  # recomputed and stored; its upload waits
        gates[0][1].set()  # the first put's upload runs now: block 1 is queued, for the new block
        first.join(30)
        gates[1][1].set()
        second.join(30)
        store.flush(upload_timeout_s=30)
    with ucm_db.open(tmp_path / "other", capacity_bytes=CAP, **remote.store_options(remote_deadline_s=10)) as other:
        got = other.get(namespace, keys)
        assert [g is not None and bytes(g) == p for g, p in zip(got, payloads)] == [True, True], \
            "the remote holds the deleted block's bytes"
