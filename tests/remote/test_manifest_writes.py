"""Namespace manifests written by uploads (ucm_db.remote.manifests):

* an upload's manifest never replaces one another node wrote meanwhile (it
  carried that node's epoch bump: later nodes then keyed at the old epoch and
  were served the KV of before the invalidation);
* a manifest that cannot be read as one (JSON nested past the parser's depth)
  or replaced (a directory in its place) stops neither the uploads, of any
  namespace, nor ``gc`` and ``warm``'s namespace discovery.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

import ucm_db
from ucm_db import Namespace, maintenance
from ucm_db.remote import manifests
from ucm_db.remote.tier import RemoteRoot

from .conftest import Remote

pytestmark = pytest.mark.timeout(120)
NS = Namespace(model="test/manifests", kv_dtype="bfloat16", block_size=4, layout="t")
OTHER = Namespace(model="test/manifests-other", kv_dtype="bfloat16", block_size=4, layout="t")


def _chain(ns: Namespace, seed: int, blocks: int = 4) -> tuple[list[bytes], list[bytes]]:
    rng = random.Random(seed)
    keys = ns.block_keys([rng.randrange(50_000) for _ in range(blocks * ns.block_size)])
    return keys, [rng.randbytes(256) + key for key in keys]


def test_an_upload_never_writes_over_a_manifest_written_since_it_looked(
        tmp_path: Path, remote: Remote, monkeypatch: pytest.MonkeyPatch) -> None:
    """Node B's upload finds no manifest; node A's bump writes one with epoch
    1 before B writes: B's fresh manifest (no epoch) used to replace it."""
    with ucm_db.open(tmp_path / "a", capacity_bytes=64 << 20, remote_mode="write_through", **remote.store_options()) as node_a:
        real = manifests.read_manifest

        bumped = []

        def a_bumps_after_b_looked(root: object, namespace_id: bytes) -> dict | None:
            found = real(root, namespace_id)  # type: ignore[arg-type]
            if sys._getframe(1).f_code.co_name == "ensure_manifest" and found is None and not bumped:
                bumped.append(node_a.bump_epoch(NS))  # A's manifest, epoch 1, lands between B's read and write
            return found

        monkeypatch.setattr(manifests, "read_manifest", a_bumps_after_b_looked)
        with ucm_db.open(tmp_path / "b", capacity_bytes=64 << 20, remote_mode="write_through", **remote.store_options()) as node_b:
            keys, payloads = _chain(NS, 1)
            node_b.put(NS, keys, payloads)  # B's upload writes the namespace manifest
        monkeypatch.setattr(manifests, "read_manifest", real)
    assert bumped == [1]
    found = RemoteRoot.from_url(remote.url, remote.options).read_manifest(NS.id)
    assert found is not None and found.get("epoch") == 1
    with ucm_db.open(tmp_path / "c", capacity_bytes=64 << 20, **remote.store_options()) as node_c:
        assert node_c.epoch(NS) == 1  # a new node keys at the bump, not before it


@pytest.mark.parametrize("bad", ["nested_json", "directory"])
def test_a_bad_manifest_stops_no_upload_nor_gc_nor_warm(tmp_path: Path, bad: str) -> None:
    remote_dir = tmp_path / "remote"
    ns_dir = remote_dir / NS.id[:8].hex()
    ns_dir.mkdir(parents=True)
    if bad == "nested_json":
        (ns_dir / manifests.MANIFEST_NAME).write_text("[" * 200_000)
    else:
        (ns_dir / manifests.MANIFEST_NAME).mkdir()
    url = f"file://{remote_dir}"
    with ucm_db.open(tmp_path / "node", remote=url, capacity_bytes=64 << 20) as store:
        for seed, ns in enumerate((NS, OTHER)):
            keys, payloads = _chain(ns, seed)
            store.put(ns, keys, payloads)
        store.flush(upload_timeout_s=30)  # raised TierError: the batch failed at the manifest, again and again
        assert store.stats().pending_uploads == 0
    for ns in (NS, OTHER):
        objects = [p for p in (remote_dir / ns.id[:8].hex()).rglob("*") if p.is_file() and p.name != manifests.MANIFEST_NAME]
        assert len(objects) == 4, f"{ns.model}: {len(objects)} of 4 blocks uploaded"
    assert maintenance.remote_namespace(url, {}, OTHER.model) == OTHER  # warm's discovery: raised too
    report = maintenance.gc_remote(url, older_than_s=0)  # raised RecursionError; now removes what it may
    assert report["removed_objects"] >= 4  # at least OTHER's blocks (a namespace without a readable manifest is skipped)
    if bad == "nested_json":
        assert json.loads((ns_dir / manifests.MANIFEST_NAME).read_text())["namespace_id"] == NS.id.hex()  # replaced


def test_an_unreadable_manifest_repaired_meanwhile_is_not_replaced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Node B's upload finds the manifest unreadable; node A's bump (what the
    error's hint tells an operator to run) rewrites it with epoch 1 before
    B replaces it: B's fresh body (no epoch) used to win."""
    remote_dir = tmp_path / "remote"
    ns_dir = remote_dir / NS.id[:8].hex()
    ns_dir.mkdir(parents=True)
    (ns_dir / manifests.MANIFEST_NAME).write_text("{not json")
    url = f"file://{remote_dir}"
    with ucm_db.open(tmp_path / "a", remote=url, capacity_bytes=64 << 20) as node_a:
        real = manifests.read_manifest
        bumped = []

        def a_repairs_after_b_looked(root: object, namespace_id: bytes) -> dict | None:
            try:
                return real(root, namespace_id)  # type: ignore[arg-type]
            except manifests.ManifestError:
                if sys._getframe(1).f_code.co_name == "ensure_manifest" and not bumped:
                    bumped.append(node_a.bump_epoch(NS))  # A's manifest, epoch 1, lands between B's read and write
                raise

        monkeypatch.setattr(manifests, "read_manifest", a_repairs_after_b_looked)
        with ucm_db.open(tmp_path / "b", remote=url, capacity_bytes=64 << 20, remote_mode="write_through") as node_b:
            keys, payloads = _chain(NS, 3)
            node_b.put(NS, keys, payloads)
        monkeypatch.setattr(manifests, "read_manifest", real)
    assert bumped == [1]
    assert json.loads((ns_dir / manifests.MANIFEST_NAME).read_text()).get("epoch") == 1
