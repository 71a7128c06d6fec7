"""Review of 71776dc: only this process's own map growth is test-mapped;
adopting a growth another process made (``_adopt_resize``:
``set_mapsize(0)`` on MDB_MAP_RESIZED) is not, so under RLIMIT_AS py-lmdb
closes the environment for good, the failure the commit fixed for
``_grow``. Real limit in a forked child; the growth is a real second
process (this one) writing past the child's 1 MiB map."""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path

import pytest

import ucm_db
from tests.reliability.harness import NS, chain_tokens, fork_call, payload_for, tail, wait_pid

BLOCK_BYTES = 64 << 10
HEADROOM_BYTES = 80 << 20


def _vm_bytes() -> int:
    with open("/proc/self/status") as status:
        return int(next(line for line in status if line.startswith("VmSize:")).split()[1]) * 1024


def limited_reader(path: Path, go: Path, out: Path) -> None:
    store = ucm_db.open(path, capacity_bytes=1 << 30, map_size_bytes=1 << 20, codec="none")
    key = NS.block_keys(chain_tokens("mine", 1))
    store.put(NS, key, [payload_for(key[0], BLOCK_BYTES)])
    resource.setrlimit(resource.RLIMIT_AS, (_vm_bytes() + HEADROOM_BYTES, resource.RLIM_INFINITY))
    (go.parent / "ready").touch()
    while not go.exists():
        time.sleep(0.05)
    report: dict[str, object] = {}
    try:
        store.get(NS, key)
    except Exception as exc:  # noqa: BLE001 - reported
        report["limited"] = repr(exc)
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    try:
        report["after"] = store.get(NS, key)[0] is not None
    except Exception as exc:  # noqa: BLE001 - reported
        report["after"] = repr(exc)
    out.write_text(json.dumps(report))


def test_another_process_growing_the_map_does_not_end_a_limited_process_store(tmp_path: Path) -> None:
    path, go, out = tmp_path / "s", tmp_path / "go", tmp_path / "out.json"
    pid = fork_call(limited_reader, path, go, out, log_path=tmp_path / "child.log")
    deadline = time.monotonic() + 60
    while not (tmp_path / "ready").exists():
        assert time.monotonic() < deadline, tail(tmp_path / "child.log")
        time.sleep(0.05)
    with ucm_db.open(path, capacity_bytes=1 << 30, map_size_bytes=1 << 30, codec="none") as grower:
        keys = NS.block_keys(chain_tokens("grow", 64))  # 4 MiB: past the child's 1 MiB map
        grower.put(NS, keys, [payload_for(k, BLOCK_BYTES) for k in keys])
    go.touch()
    assert wait_pid(pid, 120) == 0, tail(tmp_path / "child.log")
    report = json.loads(out.read_text())
    assert str(report.get("limited", "TierError")).startswith("TierError"), report  # a failure for that call only
    assert report["after"] is True, report  # the limit lifted: the store serves again
