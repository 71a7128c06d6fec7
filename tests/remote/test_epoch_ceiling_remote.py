"""A remote manifest's epoch never takes a namespace past the room to
invalidate it (the remote half of tests/test_epoch_ceilings.py).

Audit finding: a remote without auth keys took any epoch below 2**64 from a
namespace manifest. A bucket writer who planted 2**64 - 1 made every store
meeting the remote adopt it, and every later invalidation of the fleet
failed while the old blocks stayed served. Now an unkeyed manifest's epoch
is taken below 2**48 and a keyed one (signed by a configured key) below
2**63 (where the engines' private epochs start); one above is treated as a malformed epoch: not adopted, nothing read
through until a bump here rewrites the manifest.
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest

import ucm_db
from tests import epoch_reads
from ucm_db import Namespace
from ucm_db.auth import load_keys
from ucm_db.remote import manifests
from ucm_db.remote.tier import RemoteRoot

from .conftest import Remote, make_remote

pytestmark = pytest.mark.timeout(120)
NS = Namespace(model="test/epoch-ceiling-remote", kv_dtype="bfloat16", block_size=4)
TOKENS = list(range(7, 7 + 4 * 3))
OLD = [f"old-{i}".encode().ljust(64, b".") for i in range(len(TOKENS) // 4)]


def opened(path: Path, remote: Remote, **extra: object) -> ucm_db.Store:
    return ucm_db.open(path, capacity_bytes=64 << 20, remote_mode="write_through", **remote.store_options(remote_deadline_s=10, **extra))


def served(store: ucm_db.Store) -> list[bytes]:
    return epoch_reads.served(store, NS, TOKENS, unreadable_epoch_is_miss=False)


def manifest_path(remote: Remote) -> Path:
    return Path(remote.url.removeprefix("file://"), NS.short_id, "manifest.json")


def plant(remote: Remote, epoch: int, key_file: Path | None = None) -> None:
    """Sets the manifest's epoch (signed with ``key_file``'s key when given)."""
    body = json.loads(manifest_path(remote).read_text())
    body.pop("epoch_auth", None)
    signer = types.SimpleNamespace(auth=load_keys(key_file, None) if key_file is not None else None)
    body.update(manifests.epoch_fields(signer, NS.id, epoch))  # type: ignore[arg-type]
    manifest_path(remote).write_text(json.dumps(body))


def key_options(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    path = tmp_path / "auth.key"
    path.write_text(bytes(range(32)).hex() + "\n")
    path.chmod(0o600)
    return path, {"remote_auth_key_file": str(path)}


def first_node(path: Path, remote: Remote, **extra: object) -> None:
    with opened(path, remote, **extra) as store:
        store.put(NS, NS.block_keys(TOKENS, epoch=store.epoch(NS)), OLD)
        assert store.bump_epoch(NS) == 1


@pytest.mark.parametrize("epoch", [2**64 - 1, 2**48])
def test_an_unkeyed_manifest_epoch_past_the_ceiling_is_not_adopted_and_a_bump_rewrites_it(tmp_path: Path,
                                                                                          epoch: int) -> None:
    remote = make_remote("file", tmp_path, None)  # type: ignore[arg-type]
    first_node(tmp_path / "a", remote)
    plant(remote, epoch)
    with opened(tmp_path / "b", remote) as node_b:
        assert node_b.epoch(NS) == 0  # the planted number is not taken
        assert node_b.bump_epoch(NS) == 2  # and invalidation works, above node a's 1 (its claim, epoch_claims)
    assert json.loads(manifest_path(remote).read_text())["epoch"] == 2  # the bump rewrote the manifest
    with opened(tmp_path / "c", remote) as node_c:
        assert node_c.epoch(NS) == 2 and node_c.bump_epoch(NS) == 3


def test_an_unkeyed_manifest_epoch_below_the_ceiling_is_still_adopted(tmp_path: Path) -> None:
    remote = make_remote("file", tmp_path, None)  # type: ignore[arg-type]
    first_node(tmp_path / "a", remote)
    plant(remote, 2**48 - 1)
    with opened(tmp_path / "b", remote) as node_b:
        assert node_b.epoch(NS) == 2**48 - 1 and served(node_b) == []
        assert node_b.bump_epoch(NS) == 2**48


def test_a_keyed_manifest_epoch_is_taken_up_to_2_63(tmp_path: Path) -> None:
    remote = make_remote("file", tmp_path, None)  # type: ignore[arg-type]
    key, options = key_options(tmp_path)
    first_node(tmp_path / "a", remote, **options)
    plant(remote, 2**50, key)  # signed by the configured key: taken above the unkeyed ceiling
    with opened(tmp_path / "b", remote, **options) as node_b:
        assert node_b.epoch(NS) == 2**50
    plant(remote, 2**63, key)
    with opened(tmp_path / "c", remote, **options) as node_c:
        assert node_c.epoch(NS) == 0 and node_c.bump_epoch(NS) == 2  # above node a's claimed 1, not the planted 2**63
    found = RemoteRoot.from_url(remote.url, remote.options).read_manifest(NS.digest[:16])
    assert found is not None and found["epoch"] == 2


def test_bumps_from_a_keyed_epoch_near_the_top_move_forward_and_reach_every_node(tmp_path: Path) -> None:
    """Review finding: from a signed manifest at 2**62 - 1 a bump recorded
    2**62, the manifest then held a number other nodes refused, and a second
    bump in the same process computed the same value: nothing invalidated."""
    remote = make_remote("file", tmp_path, None)  # type: ignore[arg-type]
    key, options = key_options(tmp_path)
    first_node(tmp_path / "a", remote, **options)
    plant(remote, 2**62 - 1, key)
    with opened(tmp_path / "b", remote, **options) as node_b:
        assert node_b.epoch(NS) == 2**62 - 1
        node_b.put(NS, NS.block_keys(TOKENS, epoch=2**62 - 1), OLD)
    with opened(tmp_path / "c", remote, **options) as node_c:
        assert node_c.bump_epoch(NS) == 2**62 and node_c.bump_epoch(NS) == 2**62 + 1
    with opened(tmp_path / "b", remote, **options) as node_b:
        assert node_b.epoch(NS) == 2**62 + 1 and served(node_b) == []
