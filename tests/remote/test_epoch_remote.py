"""The invalidation epoch travels with the blocks to a shared remote (issue
48, item 6): a store meeting the remote for the first time (a new node, or
``lmdb/`` moved aside) adopts the epoch the namespace manifest carries, so
it never serves an invalidated chain from the remote; with an auth key the
manifest's epoch is authenticated, and a planted one is never adopted.

Each case: node A stores chain v1, invalidates, stores v2 of the same
tokens; the assertion is 0 stale (v1) blocks served by a reader keyed at
``store.epoch(ns)``, as the connector is.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

import ucm_db
from tests import epoch_reads
from ucm_db import Namespace, maintenance
from ucm_db.remote.tier import RemoteRoot

from .conftest import Remote, make_remote

pytestmark = pytest.mark.timeout(120)
NS = Namespace(model="test/epoch-remote", kv_dtype="bfloat16", block_size=4)
TOKENS = list(range(5, 5 + 4 * 6))
BLOCKS = len(TOKENS) // 4
V1 = [f"v1-{i}".encode().ljust(256, b".") for i in range(BLOCKS)]
V2 = [f"v2-{i}".encode().ljust(256, b".") for i in range(BLOCKS)]
KEY = bytes(range(32))


@pytest.fixture(params=["file", "memory"])
def shared(request: pytest.FixtureRequest, tmp_path: Path) -> Remote:
    return make_remote(request.param, tmp_path, request)


def opened(path: Path, remote: Remote, **extra: object) -> ucm_db.Store:
    return ucm_db.open(path, capacity_bytes=64 << 20, remote_mode="write_through", **remote.store_options(remote_deadline_s=10, **extra))


def served(store: ucm_db.Store) -> list[bytes]:
    return epoch_reads.served(store, NS, TOKENS)


def stale(blocks: list[bytes]) -> int:
    return sum(1 for b in blocks if b in V1)


def invalidated_node(path: Path, remote: Remote, **extra: object) -> None:
    with opened(path, remote, **extra) as store:
        store.put(NS, NS.block_keys(TOKENS, epoch=store.epoch(NS)), V1)
        assert store.bump_epoch(NS) == 1
        store.put(NS, NS.block_keys(TOKENS, epoch=store.epoch(NS)), V2)
        assert served(store) == V2


def auth_options(tmp_path: Path, *hex_keys: str, name: str = "auth.key") -> dict[str, str]:
    """Store options naming a key file that holds ``hex_keys`` (the first signs)."""
    path = tmp_path / name
    path.write_text("".join(k + "\n" for k in hex_keys))
    path.chmod(0o600)
    return {"remote_auth_key_file": str(path)}


def manifest(remote: Remote) -> dict:
    found = RemoteRoot.from_url(remote.url, remote.options).read_manifest(NS.digest[:16])
    assert found is not None
    return found


def test_a_new_store_on_the_shared_remote_adopts_its_epoch(tmp_path: Path, shared: Remote) -> None:
    invalidated_node(tmp_path / "a", shared)
    with opened(tmp_path / "b", shared) as node_b:
        got = served(node_b)
        assert stale(got) == 0 and got == V2  # read through from the remote, at epoch 1
        assert node_b.epoch(NS) == 1
    assert manifest(shared)["epoch"] == 1
    with ucm_db.open(tmp_path / "b") as node_b:  # recorded: the local store keeps it without the remote
        assert node_b.epoch(NS) == 1 and stale(served(node_b)) == 0


def test_a_store_whose_lmdb_was_moved_aside_adopts_the_remote_epoch(tmp_path: Path, shared: Remote) -> None:
    invalidated_node(tmp_path / "a", shared)
    (tmp_path / "a" / "lmdb").rename(tmp_path / "lmdb.moved")
    with opened(tmp_path / "a", shared) as node_a:
        got = served(node_a)
        assert stale(got) == 0 and got == V2


def test_reads_before_any_epoch_call_never_take_the_old_chain(tmp_path: Path, shared: Remote) -> None:
    """A lookup is first contact too: the remote's epoch is read before
    anything of the namespace is read through (and the reads write nothing)."""
    invalidated_node(tmp_path / "a", shared)
    with opened(tmp_path / "b", shared) as node_b:
        keys_v2 = NS.block_keys(TOKENS, epoch=1)
        assert node_b.lookup(NS, keys_v2) == BLOCKS
        assert node_b.epoch(NS) == 1


def test_an_invalidation_made_without_the_remote_reaches_it(tmp_path: Path, shared: Remote) -> None:
    """`ucm-db invalidate` without --remote opens the store without its
    remote: the namespace, shared with the remote, gets a fresh epoch (no
    node can have counted to it: tests/remote/test_epoch_fleet_bumps.py),
    and the store tells the remote at its next contact (its epoch is the higher)."""
    from ucm_db.store.epochs import FRESH_EPOCH_BASE

    with opened(tmp_path / "a", shared) as node_a:
        node_a.put(NS, NS.block_keys(TOKENS), V1)
    [row] = maintenance.invalidate(tmp_path / "a", (NS.model,))
    epoch = row["epoch"]
    assert epoch > FRESH_EPOCH_BASE and row["remote"] == "pending"
    with opened(tmp_path / "a", shared) as node_a:
        assert node_a.epoch(NS) == epoch
        node_a.put(NS, NS.block_keys(TOKENS, epoch=epoch), V2)
    assert manifest(shared)["epoch"] == epoch
    with opened(tmp_path / "b", shared) as node_b:
        got = served(node_b)
        assert stale(got) == 0 and got == V2


def test_a_store_never_moves_back_and_moves_past_the_remote(tmp_path: Path, shared: Remote) -> None:
    invalidated_node(tmp_path / "a", shared)
    with ucm_db.open(tmp_path / "b", capacity_bytes=64 << 20) as node_b:
        for _ in range(3):
            node_b.bump_epoch(NS)
    with opened(tmp_path / "b", shared) as node_b:
        assert node_b.epoch(NS) == 3  # not lowered to the remote's 1
        assert node_b.bump_epoch(NS) == 4
    assert manifest(shared)["epoch"] == 4
    with opened(tmp_path / "c", shared) as node_c:
        assert node_c.epoch(NS) == 4 and served(node_c) == []


def test_warm_by_tokens_pulls_the_current_chain(tmp_path: Path, shared: Remote) -> None:
    invalidated_node(tmp_path / "a", shared)
    with opened(tmp_path / "b", shared) as node_b:
        report = node_b.warm(NS, token_sequences=[TOKENS])
        assert report.fetched == BLOCKS
    with ucm_db.open(tmp_path / "b") as node_b:
        assert node_b.epoch(NS) == 1
        assert [bytes(b) for b in node_b.get(NS, NS.block_keys(TOKENS, epoch=1))] == V2
        assert node_b.lookup(NS, NS.block_keys(TOKENS)) == 0  # v1 was never pulled


def test_with_a_key_the_manifest_epoch_is_authenticated(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    remote = make_remote("file", tmp_path, None)  # type: ignore[arg-type]
    auth = auth_options(tmp_path, KEY.hex())
    invalidated_node(tmp_path / "a", remote, **auth)
    assert set(manifest(remote)["epoch_auth"]) == {"key_id", "mac"}
    with opened(tmp_path / "b", remote, **auth) as node_b:
        assert node_b.epoch(NS) == 1 and served(node_b) == V2
    # A bucket writer without the key raises the epoch (to make every node
    # drop its cache) or lowers it: neither is adopted, and nothing of the
    # namespace is read through from the remote while it cannot be established.
    for forged in (7, 0):
        body = manifest(remote)
        body["epoch"] = forged
        Path(remote.url.removeprefix("file://"), NS.short_id, "manifest.json").write_text(json.dumps(body))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="ucm_db"), opened(tmp_path / f"c{forged}", remote, **auth) as node_c:
            assert node_c.epoch(NS) == 0  # its own: the remote's cannot be established
            assert served(node_c) == [] and node_c.lookup(NS, NS.block_keys(TOKENS)) == 0  # v1 not read through
        assert any("not made by a configured auth key" in r.getMessage() for r in caplog.records)
    # A keyed store moving the epoch on rewrites the manifest, signed.
    with opened(tmp_path / "a", remote, **auth) as node_a:
        assert node_a.bump_epoch(NS) == 2
    with opened(tmp_path / "d", remote, **auth) as node_d:
        assert node_d.epoch(NS) == 2 and served(node_d) == []


@pytest.mark.parametrize("how", ["slow_first_contact", "retry_due_in_the_step"])
def test_keys_taken_before_first_contact_answered_never_read_the_old_chain_through(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """A step's ``epoch()`` answered the local epoch (0) while first contact
    was pending (an object store's slow first request) or failing (the
    remote down, retried every RETRY_S); first contact then answered (epoch
    1) between that ``epoch()`` and the step's lookup, which read the chain
    through with keys rooted at 0: the KV of before A's invalidation,
    served. Now nothing is read through until ``epoch()`` is asked again."""
    import time

    from ucm_db.remote import first_contact
    from ucm_db.store import epoch_gate

    monkeypatch.setenv("UCM_DB_INLINE_READS", "0")  # requests on the pool, as on NFS or an object store
    remote = make_remote("file", tmp_path, None)  # type: ignore[arg-type]
    invalidated_node(tmp_path / "a", remote)
    real = first_contact.manifest_epoch
    down = {"now": how == "retry_due_in_the_step"}

    def manifest_epoch(root: object, ns_id: bytes) -> int | None:
        if down["now"]:
            raise ConnectionError("remote down")
        if how == "slow_first_contact":
            time.sleep(0.5)
        return real(root, ns_id)  # type: ignore[arg-type]

    monkeypatch.setattr(first_contact, "manifest_epoch", manifest_epoch)
    monkeypatch.setattr(epoch_gate, "RETRY_S", 0.3)
    with ucm_db.open(tmp_path / "c", capacity_bytes=64 << 20, **remote.store_options()) as node_c:
        if down["now"]:
            assert node_c.lookup(NS, NS.block_keys(TOKENS, epoch=0)) == 0  # first contact fails: retried later
            down["now"] = False
        epoch = node_c.epoch(NS)  # the step's epoch: first contact pending, or its retry not due yet
        assert epoch == 0
        time.sleep(0.6)  # first contact answers (or its retry falls due) during the step
        stale_keys = NS.block_keys(TOKENS, epoch=epoch)
        assert node_c.lookup(NS, stale_keys) == 0
        assert node_c.get(NS, stale_keys) == [None] * BLOCKS
        assert node_c.epoch(NS) == 1  # the next step
        assert stale(served(node_c)) == 0 and served(node_c) == V2


def test_after_a_key_rotation_a_bump_goes_above_the_epoch_the_old_key_signed(tmp_path: Path) -> None:
    """The rotation trust.md describes ends with the old key dropped: the
    manifest's epoch (1, signed with it) can no longer be verified. A node
    with the new key alone bumped from its own epoch (0) to 1, the fleet's
    epoch already: the invalidation did nothing, and a new node was served
    the chain of before it. Now the bump goes above the unverified epoch and
    signs the manifest with the new key."""
    remote = make_remote("file", tmp_path, None)  # type: ignore[arg-type]
    old, new = KEY.hex(), bytes(range(32, 64)).hex()
    invalidated_node(tmp_path / "a", remote, **auth_options(tmp_path, old, name="old"))  # epoch 1, signed with the old key
    with opened(tmp_path / "b", remote, **auth_options(tmp_path, new, old, name="both")) as node_b:  # rotation: the new key first
        assert node_b.epoch(NS) == 1 and served(node_b) == V2
    new_only = auth_options(tmp_path, new, name="new")  # the old key dropped
    with opened(tmp_path / "c", remote, **new_only) as node_c:
        assert node_c.epoch(NS) == 0 and served(node_c) == []  # the old key's epoch: unverifiable, not adopted
        assert node_c.bump_epoch(NS) == 2  # the operator's invalidation: above the unverified 1
    assert manifest(remote)["epoch"] == 2
    with opened(tmp_path / "d", remote, **new_only) as node_d:
        assert node_d.epoch(NS) == 2 and stale(served(node_d)) == 0


def test_after_a_key_rotation_a_bump_goes_above_a_fresh_epoch_the_old_key_signed(tmp_path: Path) -> None:
    """A store whose epoch record was lost moves on to a fresh epoch (2**40 and
    up, epochs.fresh_epoch); signed with the old key, that one was past the
    unverified ceiling (2**32 then), so after the rotation a bump counted
    from the node's own 0 and wrote 1 to the manifest: every node that had
    taken the fresh epoch kept serving the chain of before the invalidation."""
    from ucm_db.store import epochs

    remote = make_remote("file", tmp_path, None)  # type: ignore[arg-type]
    old, new = KEY.hex(), bytes(range(32, 64)).hex()
    with opened(tmp_path / "a", remote, **auth_options(tmp_path, old, name="old")) as node_a:
        epochs.adopt(node_a._engine, NS.id, epochs.fresh_epoch())  # as after a lost record's bump
        fresh = node_a.bump_epoch(NS)
        assert fresh > epochs.FRESH_EPOCH_BASE and manifest(remote)["epoch"] == fresh
        node_a.put(NS, NS.block_keys(TOKENS, epoch=fresh), V2)
    new_only = auth_options(tmp_path, new, name="new")  # the old key dropped
    with opened(tmp_path / "c", remote, **new_only) as node_c:
        # The operator's invalidation: above the old key's fresh epoch (and, up there, at least the clock's: shared_epochs).
        bumped = node_c.bump_epoch(NS)
        assert bumped > fresh
    with opened(tmp_path / "a", remote, **auth_options(tmp_path, new, old, name="both")) as node_a:
        assert node_a.epoch(NS) == bumped and served(node_a) == []


@pytest.mark.parametrize("signature", ["unsigned", "unknown_key_far_above"])
def test_a_planted_epoch_never_uses_up_the_epoch_space(tmp_path: Path, signature: str) -> None:
    """A bump goes above an epoch signed by a key rotated out, but one that no
    key signed, or that is past UNVERIFIED_EPOCH_LIMIT, is not followed: a
    bucket writer without a key planted 2**64 - 2 and every later
    invalidation of the fleet failed ("its epoch would pass 2**64")."""
    remote = make_remote("file", tmp_path, None)  # type: ignore[arg-type]
    auth = auth_options(tmp_path, KEY.hex())
    invalidated_node(tmp_path / "a", remote, **auth)
    body = manifest(remote)
    body["epoch"] = 2**64 - 2
    if signature == "unsigned":
        body.pop("epoch_auth")
    else:
        body["epoch_auth"] = {"key_id": "ab" * 8, "mac": "cd" * 32}
    Path(remote.url.removeprefix("file://"), NS.short_id, "manifest.json").write_text(json.dumps(body))
    with opened(tmp_path / "b", remote, **auth) as node_b:
        assert node_b.bump_epoch(NS) == 2  # above node a's 1 (its claim, epoch_claims); the planted number is not followed
        assert node_b.bump_epoch(NS) == 3
    assert manifest(remote)["epoch"] == 3
