"""``Store.warm`` and ``ucm-db warm`` fetch nothing before the remote's
epoch of the namespace is known (audit: warm asked the store's epoch but
never whether first contact had answered, as lookups and gets do; so while
the manifest was slow, unreadable, or, with an auth key, altered by a bucket
writer without it, warm keyed the prompts at the local epoch, 0 on a new
node, and promoted the chain of before another node's invalidation, which
the node then served from its local tier).

Each case: node A stores v1, invalidates, stores v2 of the same tokens; a
new node warms; nothing of v1 may be promoted. Now warm raises
:class:`~ucm_db.remote.warming.RemoteEpochUnknownError` (a TierError; the
CLI exits 1 naming the problem and the fix).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

import ucm_db
from faultfs import FaultPlan
from tests import epoch_reads
from ucm_db import Namespace
from ucm_db.errors import TierError
from ucm_db.remote.warming import RemoteEpochUnknownError

from .conftest import key_file

pytestmark = pytest.mark.timeout(120)
NS = Namespace(model="test/warm-remote-epoch", kv_dtype="bfloat16", block_size=4)
TOKENS = list(range(9, 9 + 4 * 5))
BLOCKS = len(TOKENS) // 4
V1 = [f"v1-{i}".encode().ljust(300, b".") for i in range(BLOCKS)]
V2 = [f"v2-{i}".encode().ljust(300, b".") for i in range(BLOCKS)]


def invalidated_node(path: Path, url: str, **options: object) -> None:
    with ucm_db.open(path, capacity_bytes=64 << 20, remote=url, remote_mode="write_through", **options) as node_a:
        node_a.put(NS, NS.block_keys(TOKENS, epoch=node_a.epoch(NS)), V1)
        assert node_a.bump_epoch(NS) == 1
        node_a.put(NS, NS.block_keys(TOKENS, epoch=1), V2)


def nothing_local(path: Path) -> bool:
    with ucm_db.open(path) as store:
        return all(store.lookup(NS, NS.block_keys(TOKENS, epoch=e), remote=False) == 0 for e in (0, 1))


def altered_manifest(tmp_path: Path) -> tuple[str, dict[str, str]]:
    """A keyed remote whose manifest epoch a bucket writer without the key changed (its MAC now fails)."""
    url = f"file://{tmp_path / 'remote'}"
    keyed = {"remote_auth_key_file": key_file(tmp_path, bytes(range(32)))}
    invalidated_node(tmp_path / "a", url, **keyed)
    path = tmp_path / "remote" / NS.short_id / "manifest.json"
    body = json.loads(path.read_text())
    body["epoch"] = 7
    path.write_text(json.dumps(body))
    return url, keyed


def test_warm_refuses_a_manifest_whose_epoch_no_configured_key_signed(tmp_path: Path) -> None:
    url, keyed = altered_manifest(tmp_path)
    with ucm_db.open(tmp_path / "c", capacity_bytes=64 << 20, remote=url, **keyed) as node_c:
        with pytest.raises(RemoteEpochUnknownError) as caught:
            node_c.warm(NS, token_sequences=[TOKENS])
        assert isinstance(caught.value, TierError)
        assert "not made by a configured auth key" in caught.value.message and "nothing was fetched" in caught.value.message
        assert "ucm-db invalidate" in caught.value.hint
        with pytest.raises(RemoteEpochUnknownError):
            node_c.warm(NS, keys=NS.block_keys(TOKENS))  # caller-keyed chains too: they may be as stale
        assert epoch_reads.served(node_c, NS, TOKENS) == []
    assert nothing_local(tmp_path / "c")


def test_the_cli_warm_exits_1_naming_the_problem(tmp_path: Path) -> None:
    url, keyed = altered_manifest(tmp_path)
    (tmp_path / "tokens.jsonl").write_text(json.dumps(TOKENS) + "\n")
    cli = str(Path(sys.executable).with_name("ucm-db"))
    done = subprocess.run([cli, "warm", str(tmp_path / "c"), "--remote", url, "--namespace", NS.model, "--tokens",
                           str(tmp_path / "tokens.jsonl"), "--auth-key-file", keyed["remote_auth_key_file"], "--json"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    error = json.loads(done.stdout)["error"]
    assert error["type"] == "RemoteEpochUnknownError" and "cannot warm namespace" in error["message"]
    assert "not made by a configured auth key" in error["message"] and error["hint"]
    assert nothing_local(tmp_path / "c")


def test_warm_waits_out_a_slow_first_contact_then_refuses_and_warms_once_it_answered(tmp_path: Path) -> None:
    """Every request of node C's remote slower than warm's bulk deadline
    (ten lookup deadlines: 2 s), as an object store's first request can be
    (faultfs: a latency the real remotes of the tests cannot be made to show)."""
    root = f"ucm-warm-{uuid.uuid4().hex[:10]}"
    invalidated_node(tmp_path / "a", f"memory://{root}")
    plan = FaultPlan(seed=3, latency_s=3.0)
    try:
        with ucm_db.open(tmp_path / "c", capacity_bytes=64 << 20, remote=f"ucmfault://{root}", remote_deadline_s=0.2,
                         remote_options={"target_protocol": "memory", "plan": plan}) as node_c:
            with pytest.raises(RemoteEpochUnknownError, match="not known yet"):
                node_c.warm(NS, token_sequences=[TOKENS])
            assert node_c.lookup(NS, NS.block_keys(TOKENS), remote=False) == 0  # v1 never pulled
            plan.heal()  # later requests are fast; the read in flight answers when its latency is over (epoch 1)
            end = time.monotonic() + 20
            while node_c.epoch(NS) != 1 and time.monotonic() < end:
                time.sleep(0.05)
            report = node_c.warm(NS, token_sequences=[TOKENS])
            assert report.fetched == BLOCKS
            assert node_c.epoch(NS) == 1 and epoch_reads.served(node_c, NS, TOKENS) == V2
            assert node_c.lookup(NS, NS.block_keys(TOKENS), remote=False) == 0
    finally:
        plan.heal()
