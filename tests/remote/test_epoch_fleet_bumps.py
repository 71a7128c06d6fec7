"""Invalidations of nodes sharing a remote never share an epoch (audit:
an invalidation landed on an epoch another node had already used).

Node A bumps a namespace and uploads the chain it computes after ("A-gen1");
node B then invalidates the same namespace. Before the fix B's new epoch
was 1, A's, and B served A-gen1, stored before B's own invalidation:
``ucm-db invalidate`` on B opened the store without its remote, a long-running
B counted from the epoch it read at first contact, and with the fleet at 2
B's bump gave 1, below the fleet. Now a bump claims its epoch on the remote
above every node's (ucm_db/remote/epoch_claims.py), and one made without the
remote takes a fresh epoch no node can have counted to
(ucm_db/store/shared_epochs.py).

Real stores (two store directories are two nodes) on a real shared
directory, ``memory://`` and moto's S3; concurrent bumps in real processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import ucm_db
from tests import epoch_reads
from ucm_db import Namespace, maintenance
from ucm_db.remote.epoch_claims import claims_dir
from ucm_db.remote.tier import RemoteRoot
from ucm_db.store.epochs import FRESH_EPOCH_BASE

from .conftest import Remote, key_file, make_remote, s3_options

pytestmark = pytest.mark.timeout(180)
NS = Namespace(model="test/fleet-bumps", kv_dtype="bfloat16", block_size=4)
TOKENS = list(range(100, 100 + 4 * 4))


def payloads(tag: str) -> list[bytes]:
    return [f"{tag}-{i}".encode().ljust(256, b".") for i in range(len(TOKENS) // 4)]


def opened(path: Path, remote: Remote, **extra: object) -> ucm_db.Store:
    return ucm_db.open(path, capacity_bytes=64 << 20, remote_mode="write_through",
                       **remote.store_options(**{"remote_deadline_s": 5, **extra}))


def served(store: ucm_db.Store) -> list[bytes]:
    return epoch_reads.served(store, NS, TOKENS)


def put_current(store: ucm_db.Store, tag: str) -> int:
    epoch = store.epoch(NS)
    store.put(NS, NS.block_keys(TOKENS, epoch=epoch), payloads(tag))
    return epoch


def manifest_epoch(remote: Remote) -> int:
    found = RemoteRoot.from_url(remote.url, remote.options).read_manifest(NS.id)
    assert found is not None
    return int(found["epoch"])


def test_a_running_node_bumps_above_a_bump_made_since_its_first_contact(tmp_path: Path, remote: Remote) -> None:
    """Audit r1 (b): B met the remote at epoch 0, A bumped to 1 and uploaded
    A-gen1, B's bump returned 1 and B served A-gen1."""
    with opened(tmp_path / "b", remote) as node_b:
        put_current(node_b, "B-gen0")  # first contact: the remote's epoch is 0
        with opened(tmp_path / "a", remote) as node_a:
            assert node_a.bump_epoch(NS) == 1
            put_current(node_a, "A-gen1")
        assert node_b.bump_epoch(NS) == 2  # above A's 1, read afresh from the remote
        assert served(node_b) == []  # nothing stored before B's invalidation
    assert manifest_epoch(remote) == 2
    with opened(tmp_path / "c", remote) as node_c:
        assert node_c.epoch(NS) == 2 and served(node_c) == []


def test_a_bump_never_lands_below_the_fleets_epoch(tmp_path: Path, remote: Remote) -> None:
    """Audit r1 (c): with the fleet at 2, B's bump gave 1 and B served
    A-gen1, which the fleet had invalidated."""
    with opened(tmp_path / "b", remote) as node_b:
        put_current(node_b, "B-gen0")
        with opened(tmp_path / "a", remote) as node_a:
            for tag in ("A-gen1", "A-gen2"):
                node_a.bump_epoch(NS)
                put_current(node_a, tag)
        assert node_b.bump_epoch(NS) == 3
        assert served(node_b) == []
    assert manifest_epoch(remote) == 3


def a_gen1_after_b_met_the_remote(tmp_path: Path, remote: Remote) -> None:
    """B stored gen 0 through the remote (so shares the namespace with it);
    A then bumped to 1 and uploaded A-gen1."""
    with opened(tmp_path / "b", remote) as node_b:
        put_current(node_b, "B-gen0")
    with opened(tmp_path / "a", remote) as node_a:
        assert node_a.bump_epoch(NS) == 1
        put_current(node_a, "A-gen1")


def test_invalidate_without_the_remote_takes_an_epoch_no_node_counted_to(tmp_path: Path, remote: Remote) -> None:
    """Audit r1 (a): `ucm-db invalidate` on B opened B without the remote;
    B's new epoch was 1, A's, and B served A-gen1. Now B, sharing the
    namespace with the remote, takes a fresh epoch, told at B's next contact."""
    a_gen1_after_b_met_the_remote(tmp_path, remote)
    [row] = maintenance.invalidate(tmp_path / "b", (NS.model,))
    fresh = row["epoch"]
    assert fresh > FRESH_EPOCH_BASE and row["remote"] == "pending"
    with opened(tmp_path / "b", remote) as node_b:
        assert node_b.epoch(NS) == fresh and served(node_b) == []  # none of A-gen1; told to the remote now
    assert manifest_epoch(remote) == fresh
    with opened(tmp_path / "a", remote) as node_a:  # A, restarted, meets it; its next bump goes above
        assert node_a.epoch(NS) == fresh and served(node_a) == []
        assert node_a.bump_epoch(NS) > fresh


def test_invalidate_through_the_remote_claims_above_every_node(tmp_path: Path, remote: Remote) -> None:
    a_gen1_after_b_met_the_remote(tmp_path, remote)
    [row] = maintenance.invalidate(tmp_path / "b", (NS.model,), **remote.store_options())
    assert (row["epoch"], row["remote"]) == (2, "claimed")
    with opened(tmp_path / "b", remote) as node_b:
        assert node_b.epoch(NS) == 2 and served(node_b) == []
    assert manifest_epoch(remote) == 2


def test_the_cli_invalidates_through_the_remote(tmp_path: Path) -> None:
    """`ucm-db invalidate --remote URL` (the real entry point)."""
    remote = make_remote("file", tmp_path, None)  # type: ignore[arg-type]
    a_gen1_after_b_met_the_remote(tmp_path, remote)
    cli = str(Path(sys.executable).with_name("ucm-db"))
    done = subprocess.run([cli, "invalidate", str(tmp_path / "b"), "--namespace", NS.model, "--remote", remote.url, "--json"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["invalidated"][0] | {"namespace": None} == {
        "namespace": None, "model": NS.model, "epoch": 2, "remote": "claimed"}
    human = subprocess.run([cli, "invalidate", str(tmp_path / "b"), "--namespace", NS.model], capture_output=True,
                           text=True, timeout=120)
    assert human.returncode == 0 and "taken without the remote" in human.stdout
    orphan = subprocess.run([cli, "invalidate", str(tmp_path / "b"), "--namespace", NS.model, "--option", "a=b"],
                            capture_output=True, text=True, timeout=120)
    assert orphan.returncode == 2 and "--remote" in orphan.stderr


def _dead_endpoint() -> dict[str, object]:
    """s3fs options naming an endpoint nothing listens on: a remote that is
    down, for real (connection refused)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return s3_options(f"http://127.0.0.1:{port}")


@pytest.mark.s3
def test_a_bump_that_cannot_reach_the_remote_takes_an_epoch_no_node_counted_to(
        tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """B, cut off from the remote, bumps while A's gen1 is there: before,
    B counted to 1 (A's epoch), and once back served A-gen1."""
    remote = make_remote("s3", tmp_path, request)
    a_gen1_after_b_met_the_remote(tmp_path, remote)
    with opened(tmp_path / "b", Remote("s3", remote.url, _dead_endpoint()), remote_deadline_s=0.5) as node_b:
        bumped = node_b.bump_epoch(NS)
        assert bumped > FRESH_EPOCH_BASE
    with opened(tmp_path / "b", remote) as node_b:
        assert node_b.epoch(NS) == bumped and served(node_b) == []  # none of A-gen1
    assert manifest_epoch(remote) == bumped  # told at the next contact
    with opened(tmp_path / "c", remote) as node_c:
        assert node_c.epoch(NS) == bumped and served(node_c) == []


_BUMPER = textwrap.dedent("""
    import json, os, sys, time
    import ucm_db
    from ucm_db import Namespace
    spec = json.loads(sys.argv[1])
    ns = Namespace(**spec["namespace"])
    with ucm_db.open(spec["store"], capacity_bytes=1 << 24, remote=spec["url"], remote_options=spec["options"],
                     remote_deadline_s=5) as store:
        store.epoch(ns)  # first contact made: every node then counts from what it read here
        while not os.path.exists(spec["go"]):
            time.sleep(0.005)
        print(json.dumps([store.bump_epoch(ns) for _ in range(spec["bumps"])]), flush=True)
""")


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["file", pytest.param("s3", marks=pytest.mark.s3)])
def test_concurrent_bumps_of_several_nodes_never_share_an_epoch(tmp_path: Path, kind: str,
                                                                request: pytest.FixtureRequest) -> None:
    remote = make_remote(kind, tmp_path, request)
    nodes, bumps = 4, 5
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", _BUMPER, json.dumps({
        "store": str(tmp_path / f"node-{i}"), "url": remote.url, "options": remote.options, "go": str(go),
        "namespace": NS.to_dict(), "bumps": bumps})], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(nodes)]
    time.sleep(3.0)  # the nodes open and meet the remote
    go.write_text("")
    taken: list[int] = []
    for proc in procs:
        out, err = proc.communicate(timeout=150)
        assert proc.returncode == 0, err
        epochs = json.loads(out.strip().splitlines()[-1])
        assert epochs == sorted(set(epochs))  # each node moves forward
        taken += epochs
    assert len(set(taken)) == nodes * bumps  # no two invalidations share an epoch
    assert max(taken) < FRESH_EPOCH_BASE  # all claimed through the remote: counts
    assert manifest_epoch(remote) == max(taken)


def test_the_claims_are_no_namespace_and_gc_leaves_them(tmp_path: Path) -> None:
    remote = make_remote("file", tmp_path, None)  # type: ignore[arg-type]
    with opened(tmp_path / "a", remote) as node_a:
        put_current(node_a, "A-gen0")
        node_a.bump_epoch(NS)
        put_current(node_a, "A-gen1")
    root = RemoteRoot.from_url(remote.url)
    assert os.listdir(claims_dir(root, NS.id)) == [f"{1:020d}"]
    report = maintenance.gc_remote(remote.url, older_than_s=0.0)
    assert report["skipped_entries"] == 0
    assert os.listdir(claims_dir(root, NS.id)) == [f"{1:020d}"]
    found = maintenance.remote_namespace(remote.url, None, NS.model)
    assert found.id == NS.id


def test_a_claim_no_key_signed_is_not_followed(tmp_path: Path) -> None:
    """A bucket writer without the key plants a claim far up: a keyed node's
    bump neither follows it (the epoch space is not used up) nor takes its
    number; a claim the key signed is followed."""
    remote = make_remote("file", tmp_path, None)  # type: ignore[arg-type]
    keyed = {"remote_auth_key_file": key_file(tmp_path, bytes(range(32)))}
    with opened(tmp_path / "a", remote, **keyed) as node_a:
        put_current(node_a, "A-gen0")
    root = RemoteRoot.from_url(remote.url)
    planted = Path(claims_dir(root, NS.id))
    planted.mkdir(parents=True)
    (planted / f"{2**60:020d}").write_text(json.dumps({"epoch": 2**60}))
    (planted / f"{1:020d}").write_text(json.dumps({"epoch": 1}))  # unsigned, where the next count is
    with opened(tmp_path / "a", remote, **keyed) as node_a:
        assert node_a.bump_epoch(NS) == 2  # 1 is taken (by whoever), 2**60 not followed
    with opened(tmp_path / "b", remote, **keyed) as node_b:
        assert node_b.epoch(NS) == 2 and node_b.bump_epoch(NS) == 3
    assert manifest_epoch(remote) == 3


def test_a_bump_with_no_room_above_the_fleet_fails_rather_than_go_below_it(tmp_path: Path) -> None:
    """A key holder signed the manifest at 2**63 - 1, the top: a bump has no
    epoch above it and fails (EpochSpaceError, exit 1 in the CLI), never
    taking a fresh epoch below the fleet's."""
    import types

    from ucm_db.auth import load_keys
    from ucm_db.remote import manifests
    from ucm_db.store.epochs import EpochSpaceError

    remote = make_remote("file", tmp_path, None)  # type: ignore[arg-type]
    keyed = {"remote_auth_key_file": key_file(tmp_path, bytes(range(32)))}
    with opened(tmp_path / "a", remote, **keyed) as node_a:
        put_current(node_a, "A-gen0")
    path = Path(remote.url.removeprefix("file://"), NS.short_id, "manifest.json")
    body = json.loads(path.read_text())
    signer = types.SimpleNamespace(auth=load_keys(Path(keyed["remote_auth_key_file"]), None))
    body.update(manifests.epoch_fields(signer, NS.id, 2**63 - 1))  # type: ignore[arg-type]
    path.write_text(json.dumps(body))
    with opened(tmp_path / "b", remote, **keyed) as node_b:
        with pytest.raises(EpochSpaceError):
            node_b.bump_epoch(NS)
        assert node_b.epoch(NS) == 2**63 - 1
