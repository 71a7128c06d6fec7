"""A fresh epoch a partitioned node took never undoes an invalidation made
meanwhile through the remote.

A review's finding (wrong KV): node A, cut off from the remote, invalidates
and takes a fresh epoch F (2**40 + the clock in ms) and stores its blocks at
F; node B then invalidates through the remote, whose claims count from the
manifest (1, below F). When A's remote came back, A told F: the manifest
rose to F, and B, restarted, served A's blocks stored before B's own
invalidation. Now A finds B's later claim when it tells F, and claims a new
epoch through the remote instead: nobody serves the blocks of F.

The partition is faultfs's (a remote that stops answering: a fault the real
remotes of the tests cannot be made to show).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

import ucm_db
from faultfs import FaultPlan
from tests import epoch_reads
from ucm_db import Namespace, maintenance

pytestmark = pytest.mark.timeout(120)
NS = Namespace(model="test/epoch-partition", kv_dtype="bfloat16", block_size=4)
TOKENS = list(range(100, 116))


def _blocks(tag: str) -> list[bytes]:
    return [f"{tag}-{i}".encode().ljust(256, b".") for i in range(len(TOKENS) // 4)]


def _manifest_epoch(remote: Path) -> int | None:
    path = remote / NS.short_id / "manifest.json"
    return json.loads(path.read_text()).get("epoch") if path.exists() else None


def _node_b(tmp_path: Path, remote: Path) -> ucm_db.Store:
    return ucm_db.open(tmp_path / "b", capacity_bytes=64 << 20, remote=f"file://{remote}", remote_deadline_s=2,
                       remote_mode="write_through")


@pytest.mark.parametrize("later_bump", [True, False], ids=["invalidated-meanwhile", "alone"])
def test_a_partitioned_node_s_fresh_epoch_never_undoes_a_later_invalidation(tmp_path: Path, later_bump: bool) -> None:
    remote = tmp_path / "remote"
    remote.mkdir()
    with _node_b(tmp_path, remote) as b:
        b.put(NS, NS.block_keys(TOKENS, epoch=b.epoch(NS)), _blocks("gen0"))
    plan = FaultPlan(hang_s=0.5)
    a = ucm_db.open(tmp_path / "a", capacity_bytes=64 << 20, remote=f"ucmfault://{remote}",
                    remote_options={"target_protocol": "file", "plan": plan}, remote_deadline_s=0.2)
    try:
        assert a.epoch(NS) == 0
        plan.down = True  # A is cut off
        fresh = a.bump_epoch(NS)
        a.put(NS, NS.block_keys(TOKENS, epoch=fresh), _blocks("A-at-its-fresh-epoch"))
        time.sleep(0.05)  # B's invalidation comes after A's (claims carry their time)
        if later_bump:
            with _node_b(tmp_path, remote) as b:
                assert b.bump_epoch(NS) == 1
        plan.down = False
        plan.heal()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (_manifest_epoch(remote) or 0) < fresh:
            a.epoch(NS)  # the next contact tells the remote
            time.sleep(0.2)
        a.flush(upload_timeout_s=30)
        told = _manifest_epoch(remote)
    finally:
        a.close()
    assert told is not None and told >= fresh
    with _node_b(tmp_path, remote) as b:
        served = epoch_reads.served(b, NS, TOKENS, unreadable_epoch_is_miss=False)
    if later_bump:  # before the fix: the manifest rose to `fresh` and B served A's blocks of before B's invalidation
        assert told > fresh and served == []
    else:  # nothing invalidated after it: the partitioned node's epoch is the fleet's, its blocks served
        assert told == fresh and served == _blocks("A-at-its-fresh-epoch")


def test_a_store_whose_only_contact_told_the_remote_its_epoch_takes_a_fresh_epoch_offline(tmp_path: Path) -> None:
    """A review's finding (wrong KV): node A counted to epoch 3 before it had
    a remote; with one, its only contact told the remote 3 (a node whose
    connector only looked up). It was not marked shared, so an ``invalidate``
    without ``--remote`` counted to 4, the epoch node B had claimed meanwhile
    and stored blocks at, and A served them. A told remote now marks it."""
    remote = tmp_path / "remote"
    remote.mkdir()
    with ucm_db.open(tmp_path / "a", capacity_bytes=64 << 20) as a:
        for _ in range(3):
            a.bump_epoch(NS)
        a.put(NS, NS.block_keys(TOKENS, epoch=3), _blocks("A-at-3"))
    with ucm_db.open(tmp_path / "a", capacity_bytes=64 << 20, remote=f"file://{remote}", remote_deadline_s=5) as a:
        assert a.epoch(NS) == 3
    assert _manifest_epoch(remote) == 3
    with _node_b(tmp_path, remote) as b:
        claimed = b.bump_epoch(NS)
        b.put(NS, NS.block_keys(TOKENS, epoch=claimed), _blocks("B-before-A-invalidated"))
    (row,) = maintenance.invalidate(tmp_path / "a", (NS.id.hex(),))
    assert row["epoch"] != claimed and row.get("remote") == "pending"  # before the fix: 4, B's, with no "remote"
    with ucm_db.open(tmp_path / "a", capacity_bytes=64 << 20, remote=f"file://{remote}", remote_deadline_s=5) as a:
        assert _blocks("B-before-A-invalidated")[0] not in epoch_reads.served(a, NS, TOKENS)
