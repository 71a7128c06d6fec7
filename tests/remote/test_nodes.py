"""Real processes: node B hits what node A wrote after A is gone; a node
killed with SIGKILL while uploading resumes its queue on restart, and the
remote ends up complete with no partial object."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import ucm_db
from ucm_db.remote.tier import TEMP_PREFIX, RemoteRoot, unpack_object

from .conftest import Remote, chain, make_remote

NODE = Path(__file__).with_name("node_proc.py")
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(90)]


def _spawn(spec: dict) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(NODE), json.dumps(spec)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def _wait_line(proc: subprocess.Popen[str], line: str, timeout_s: float = 60) -> None:
    end = time.monotonic() + timeout_s
    assert proc.stdout is not None
    while time.monotonic() < end:
        got = proc.stdout.readline()
        if got.strip() == line:
            return
        if not got and proc.poll() is not None:
            raise AssertionError(f"node exited {proc.returncode}: {proc.stderr.read() if proc.stderr else ''}")
    raise AssertionError(f"node did not print {line}")


@pytest.mark.parametrize("kind", ["file", pytest.param("s3", marks=pytest.mark.s3)])
def test_node_b_hits_what_gone_node_a_wrote(kind: str, tmp_path: Path, namespace, request) -> None:
    remote = make_remote(kind, tmp_path, request)
    spec = {"store": str(tmp_path / "node-a"), "remote": remote.url, "remote_options": remote.options,
            "namespace": namespace.to_dict(), "n_blocks": 24, "seed": 7, "flush": True, "then": "exit"}
    node_a = _spawn(spec)
    _wait_line(node_a, "FLUSHED")
    assert node_a.wait(30) == 0  # node A is gone
    keys, payloads = chain(namespace, 24, seed=7)
    with ucm_db.open(tmp_path / "node-b", capacity_bytes=64 << 20, **remote.store_options(remote_deadline_s=5.0)) as node_b:
        assert node_b._tier.count_prefix(keys) == 0
        assert node_b.lookup(namespace, keys) == 24
        assert node_b.get(namespace, keys) == payloads


def _object_count(remote: Remote, namespace) -> int:
    return len(list(RemoteRoot.from_url(remote.url, remote.options).tier(namespace.digest[:16]).iterate()))


@pytest.mark.crash
@pytest.mark.parametrize("kind", ["file", pytest.param("s3", marks=[pytest.mark.s3, pytest.mark.slow])])
def test_sigkill_during_uploads_then_restart_completes_remote(kind: str, tmp_path: Path, namespace, request) -> None:
    remote = make_remote(kind, tmp_path, request)
    # The child uploads 2 at a time through a latency wrapper (moto is slow
    # enough by itself) so that the kill lands in the middle of the queue.
    n_blocks, latency_s = (200, 0.02) if kind == "file" else (100, 0.0)
    inner = remote.url.split("://", 1)[1]
    plan = {"latency_s": latency_s}
    spec = {"store": str(tmp_path / "node"), "remote": f"ucmfault://{inner}",
            "remote_options": {"target_protocol": kind, "target_options": remote.options, "plan": plan},
            "namespace": namespace.to_dict(), "n_blocks": n_blocks, "seed": 3, "batch_blocks": 16,
            "upload_concurrency": 2, "then": "sleep"}
    node = _spawn(spec)
    _wait_line(node, "PUT-DONE")
    end = time.monotonic() + 30
    while _object_count(remote, namespace) < 20 and time.monotonic() < end:
        time.sleep(0.05)
    os.kill(node.pid, signal.SIGKILL)
    node.wait(10)
    before = _object_count(remote, namespace)
    assert 0 < before < n_blocks, "the kill must land while uploads are pending"

    keys, payloads = chain(namespace, n_blocks, seed=3)
    with ucm_db.open(tmp_path / "node", **remote.store_options()) as restarted:
        assert restarted.stats().pending_uploads > 0  # the queue survived the kill
        restarted.flush(upload_timeout_s=60)
        assert restarted.stats().pending_uploads == 0
    root = RemoteRoot.from_url(remote.url, remote.options)  # keeps no listings: sees the restart's uploads
    tier = root.tier(namespace.digest[:16])
    stored = sorted(tier.iterate())
    assert stored == sorted(keys)
    for i, key in enumerate(keys):
        obj = unpack_object(root.fs.cat_file(tier.path(key)), key)  # raises on any partial/corrupt object
        assert obj.parent == (keys[i - 1] if i else None)
    if kind == "file":  # no partial object under a final name; temp files are never objects
        names = [p.name for p in Path(remote.url[len("file://"):]).rglob("*") if p.is_file()]
        assert all(n == "manifest.json" or len(n) == 64 or n.startswith(TEMP_PREFIX) for n in names)
    with ucm_db.open(tmp_path / "other", capacity_bytes=64 << 20, **remote.store_options(remote_deadline_s=5.0)) as other:
        assert other.lookup(namespace, keys) == n_blocks
        assert other.get(namespace, keys[-5:]) == payloads[-5:]
