"""``export`` beside a live writer (documented as safe) writes whole blocks
or leaves them out, and says how many it left out.

Audit finding: the manifest was built from one metadata snapshot and the
payloads read in later transactions; a block evicted in between was written
as an empty member and the export reported success (beside a writer
evicting in a 1 MiB store: 16 empty members of 250; import then skipped them
as corrupt). Now each chunk's metadata and payloads are read in one read
transaction, a block gone by then is left out with its descendants (also
one stored again before its descendants' chunk was read), the manifest lists
exactly the members written, and the report counts ``left_out``.

The writer is a real second process, run between the export's chunks (its
progress callback, with chunks of two blocks), so each race happens at a
known point.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest

import ucm_db
from ucm_db import Namespace, maintenance
from ucm_db.maintenance import archive as archive_module

NS = Namespace(model="test/export-beside-writers", kv_dtype="bfloat16", block_size=4)
DEPTH = 4
CHAIN_A = list(range(100, 100 + 4 * DEPTH))
CHAIN_B = list(range(200, 200 + 4 * DEPTH))
KEYS_A, KEYS_B = NS.block_keys(CHAIN_A), NS.block_keys(CHAIN_B)
PAYLOADS_A = [f"a-{i}".encode().ljust(128, b".") for i in range(DEPTH)]
PAYLOADS_B = [f"b-{i}".encode().ljust(128, b".") for i in range(DEPTH)]

_WRITER = """
import sys, ucm_db
from ucm_db import Namespace
ns = Namespace(model="test/export-beside-writers", kv_dtype="bfloat16", block_size=4)
path, action, parent, *keys = sys.argv[1:]
keys = [bytes.fromhex(k) for k in keys]
with ucm_db.open(path) as store:
    if action == "delete":
        assert store.delete(ns, keys[:1]) == len(keys)  # the block and its descendants
    else:
        payloads = [f"a-{i}".encode().ljust(128, b".") for i in range(1, 1 + len(keys))]
        assert store.put(ns, keys, payloads, parent=bytes.fromhex(parent)).stored == len(keys)
"""


def writer(path: Path, action: str) -> None:
    """Another process deletes chain A below its root (with the descendants),
    or puts that part back."""
    args = [str(path), action, KEYS_A[0].hex(), *(k.hex() for k in KEYS_A[1:])]
    subprocess.run([sys.executable, "-c", _WRITER, *args], check=True, timeout=120)


def key_file(tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    path.write_text(bytes(range(32)).hex() + "\n")
    path.chmod(0o600)
    return path


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(archive_module, "CHUNK_BLOCKS", 2)  # blocks go parents first: each chunk is one depth of A and B
    with ucm_db.open(tmp_path / "s") as opened:
        opened.put(NS, KEYS_A, PAYLOADS_A)
        opened.put(NS, KEYS_B, PAYLOADS_B)
    return tmp_path / "s"


def members(archive: Path) -> tuple[dict[str, Any], dict[str, int]]:
    with tarfile.open(archive) as tar:
        manifest = json.loads(tar.extractfile("manifest.json").read())  # type: ignore[union-attr]
        sizes = {m.name.removeprefix("blocks/"): m.size for m in tar.getmembers() if m.name.startswith("blocks/")}
    return manifest, sizes


def check_archive(archive: Path, tmp_path: Path, **keys: Path) -> dict[str, Any]:
    """The archive holds whole blocks only, lists exactly them, parents
    first, and imports with nothing skipped; returns the import report."""
    manifest, sizes = members(archive)
    assert all(size > 0 for size in sizes.values()), sizes
    rows = manifest["blocks"]
    assert sorted(row[0] for row in rows) == sorted(sizes)
    listed: set[str] = set()
    for key, parent, _ns in rows:
        assert parent is None or parent in listed  # the prefix invariant, in the archive too
        listed.add(key)
    report = maintenance.import_archive(archive, tmp_path / "imported", **keys)
    assert report["skipped"] == [] and report["stored"] == len(rows)
    return report


@pytest.mark.parametrize("kind", ["plain", "signed", "encrypted"])
def test_a_block_evicted_during_export_is_left_out_with_its_descendants(store: Path, tmp_path: Path, kind: str) -> None:
    keys = {"plain": {}, "signed": {"auth_key_file": key_file(tmp_path, "auth.key")},
            "encrypted": {"encryption_key_file": key_file(tmp_path, "encryption.key")}}[kind]

    def between_chunks(done: int, total: int) -> None:
        if done == 2:  # depth 0 written; A's depth 1 to 3 go before their chunks are read
            writer(store, "delete")

    report = maintenance.export_archive(store, tmp_path / "x.tar", progress=between_chunks, **keys)
    check_archive(tmp_path / "x.tar", tmp_path, **keys)
    assert (report["blocks"], report.get("left_out")) == (DEPTH + 1, DEPTH - 1)
    assert report["stored_bytes"] > 0
    with ucm_db.open(tmp_path / "imported") as imported:
        assert imported.lookup(NS, KEYS_B) == DEPTH and imported.lookup(NS, KEYS_A) == 1
        assert [bytes(b) for b in imported.get(NS, KEYS_B)] == PAYLOADS_B  # type: ignore[arg-type]


def test_a_descendant_stored_again_before_its_chunk_is_left_out_too(store: Path, tmp_path: Path) -> None:
    """A's block 1 is gone when its chunk is read, and back (with 2 and 3)
    before theirs: written, they would have no parent in the archive."""
    def between_chunks(done: int, total: int) -> None:
        if done == 2:
            writer(store, "delete")
        elif done == 4:  # A1 was read as gone
            writer(store, "put")

    report = maintenance.export_archive(store, tmp_path / "x.tar", progress=between_chunks)
    check_archive(tmp_path / "x.tar", tmp_path)
    assert (report["blocks"], report.get("left_out")) == (DEPTH + 1, DEPTH - 1)
    with ucm_db.open(store) as source:
        assert source.lookup(NS, KEYS_A) == DEPTH  # the source holds them all again


def test_an_export_without_a_writer_leaves_nothing_out_and_its_manifest_is_unpadded(store: Path, tmp_path: Path) -> None:
    report = maintenance.export_archive(store, tmp_path / "x.tar")
    assert (report["blocks"], report.get("left_out")) == (2 * DEPTH, 0)
    with tarfile.open(tmp_path / "x.tar") as tar:
        assert not tar.extractfile("manifest.json").read().endswith(b" ")  # type: ignore[union-attr]
    check_archive(tmp_path / "x.tar", tmp_path)
