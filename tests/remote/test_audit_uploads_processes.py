"""Audit of the write side across real processes of one store directory:
what held (no fix needed; these tests could have found a failure).

* A delete with ``remote=True`` in a process that is not the uploader,
  while the elected uploader (another process) is sending that block: the
  deleting process deletes the object and leaves the retraction pending;
  the elected uploader deletes it again once its batch landed and confirms;
  the deleting process's ``flush`` returns only then.
* The elected uploader SIGKILLed with an upload in flight: the upload never
  lands (the write dies with the process), the next process is elected at
  once, uploads every block the dead one left queued, and a delete with
  ``remote=True`` there takes what it names, for good.

Real parts: a second process (its upload of block 1 waits for the test: a
PUT in flight, simulated), SIGKILL, LMDB, the election lock, ``file://``
and moto S3 remotes.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import ucm_db
from ucm_db.remote.tier import RemoteRoot

from .conftest import Remote, chain

pytestmark = [pytest.mark.timeout(180), pytest.mark.multiprocess]
CAP = 64 << 20

#: The elected uploader: puts 3 blocks write-back; its upload of block 1 waits for a line on stdin.
UPLOADER = textwrap.dedent("""
    import json, sys, time
    sys.path.insert(0, sys.argv[2])
    import ucm_db
    from ucm_db.remote.tier import RemoteTier
    from node_proc import chain
    spec = json.loads(sys.argv[1])
    namespace = ucm_db.Namespace.from_dict(spec["namespace"])
    keys, payloads = chain(namespace, 3)
    real_store = RemoteTier.store
    def held_store(self, key, parent, blob):
        if key == keys[1]:
            print("STARTED", flush=True)
            sys.stdin.readline()
        return real_store(self, key, parent, blob)
    RemoteTier.store = held_store
    store = ucm_db.open(spec["store"], capacity_bytes=64 << 20, remote=spec["remote"], remote_options=spec["options"],
                        upload_concurrency=1)
    store.put(namespace, keys, payloads)
    store.flush(upload_timeout_s=120)
    store.close()
    print("CLOSED", flush=True)
""")


def _start(remote: Remote, path: Path, namespace: ucm_db.Namespace) -> subprocess.Popen[str]:
    spec = {"store": str(path), "remote": remote.url, "options": remote.options, "namespace": namespace.to_dict()}
    proc = subprocess.Popen([sys.executable, "-c", UPLOADER, json.dumps(spec), str(Path(__file__).parent)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    assert line == "STARTED", (line, proc.stderr.read() if proc.stderr else "")
    return proc


def _remote_has(remote: Remote, namespace: ucm_db.Namespace, keys: list[bytes]) -> list[bool]:
    root = RemoteRoot.from_url(remote.url, dict(remote.options))
    root.fs.invalidate_cache()
    return root.tier(namespace.id).exists(keys)


@pytest.mark.parametrize("remote", ["file", pytest.param("s3", marks=pytest.mark.s3)], indirect=True)
def test_a_delete_beside_the_elected_uploaders_upload_in_flight_is_confirmed_after_it(
    remote: Remote, tmp_path: Path, namespace: ucm_db.Namespace,
) -> None:
    keys, _payloads = chain(namespace, 3)
    path = tmp_path / "store"
    proc = _start(remote, path, namespace)
    try:
        assert proc.stdin is not None and proc.stdout is not None
        with ucm_db.open(path, capacity_bytes=CAP, **remote.store_options(remote_deadline_s=5)) as store:
            assert not store._wing.uploader.election.held
            assert store.delete(namespace, [keys[1]], remote=True) == 2  # blocks 1 and 2
            proc.stdin.write("\n")
            proc.stdin.flush()  # the upload of block 1 lands, after the delete
            store.flush(upload_timeout_s=60)  # returns once the elected uploader confirmed
            assert store._tier.uploads.retractions_due() == []
            assert _remote_has(remote, namespace, keys) == [True, False, False]
        assert proc.stdout.readline().strip() == "CLOSED"
        assert proc.wait(30) == 0
    finally:
        proc.kill()
        proc.wait()
    assert _remote_has(remote, namespace, keys) == [True, False, False]


@pytest.mark.parametrize("remote", ["file", pytest.param("s3", marks=pytest.mark.s3)], indirect=True)
def test_the_elected_uploader_killed_mid_upload_is_replaced_and_its_upload_never_lands(
    remote: Remote, tmp_path: Path, namespace: ucm_db.Namespace,
) -> None:
    keys, payloads = chain(namespace, 3)
    path = tmp_path / "store"
    proc = _start(remote, path, namespace)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(30) == -signal.SIGKILL
    with ucm_db.open(path, capacity_bytes=CAP, **remote.store_options(remote_deadline_s=5)) as store:
        store.flush(upload_timeout_s=30)  # elected at once; uploads what the dead one left queued
        assert _remote_has(remote, namespace, keys) == [True, True, True]
        assert store.delete(namespace, [keys[2]], remote=True) == 1
        store.flush(upload_timeout_s=30)
    assert _remote_has(remote, namespace, keys) == [True, True, False]
    with ucm_db.open(tmp_path / "other", capacity_bytes=CAP, **remote.store_options(remote_deadline_s=10)) as other:
        got = other.get(namespace, keys)
        assert [g is not None and bytes(g) == p for g, p in zip(got, payloads)] == [True, True, False]
