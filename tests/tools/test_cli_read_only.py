"""`ucm-db inspect` and `verify` on a store the user cannot write (a real
read-only bind mount): they report, and write nothing there."""

from __future__ import annotations

from pathlib import Path

import pytest

from cli_stores import invoke, invoke_json, make_store
from readonly_mount import read_only_view, tree


@pytest.mark.parametrize("engine", ["lmdb", "rocksdb"])
def test_inspect_and_verify_read_a_store_on_a_read_only_volume(tmp_path: Path, engine: str) -> None:
    source = tmp_path / "store"
    chains = make_store(source, engine)
    before = tree(source)
    with read_only_view(source, tmp_path / "ro") as view:
        report = invoke_json("inspect", view)
        assert report["blocks"] == sum(len(keys) for keys in chains.values())
        invoke_json("verify", view)  # exit 0: no problem found
    assert tree(source) == before


def test_migrate_to_engine_converts_a_source_on_a_read_only_volume(tmp_path: Path) -> None:
    """Issue 46 finding 12: `migrate --to-engine` refused a source on a
    read-only mount, though a conversion never writes its source."""
    source = tmp_path / "store"
    chains = make_store(source, "lmdb")
    before = tree(source)
    with read_only_view(source, tmp_path / "ro") as view:
        report = invoke_json("migrate", "--to-engine", "rocksdb", view, tmp_path / "converted")
        assert report
    assert tree(source) == before
    blocks = sum(len(keys) for keys in chains.values())
    assert invoke_json("inspect", tmp_path / "converted")["blocks"] == blocks


def test_migrate_dry_run_reads_a_store_on_a_read_only_volume(tmp_path: Path) -> None:
    """Audit F19: `migrate --dry-run` opened the store as a crash recovery
    does, which writes, and on a read-only volume told the user to delete
    the store. A dry run only reads, as inspect does."""
    source = tmp_path / "store"
    make_store(source, "lmdb")
    before = tree(source)
    with read_only_view(source, tmp_path / "ro") as view:
        report = invoke_json("migrate", view, "--dry-run")
        human = invoke("migrate", view, "--dry-run")
    assert report["pending"] == [] and report["dry_run"] and report["applied"] == []
    assert report["pre_unit_blocks"]["whole_blocks"] == 0
    assert "nothing to migrate" in human.stdout and "delete" not in human.stderr
    assert tree(source) == before


def test_an_older_format_store_on_a_read_only_volume_names_the_migration(tmp_path: Path) -> None:
    """Read-only, LMDB cannot open a table a format 2 store lacks (heads): MDB_NOTFOUND, exit 1, for
    inspect, verify and migrate --dry-run alike. It is an older ucm-db's store: exit 2 naming migrate."""
    import shutil

    source = tmp_path / "store"
    shutil.copytree(Path(__file__).resolve().parent.parent / "fixtures" / "stores" / "format2-lmdb", source)
    before = tree(source)
    with read_only_view(source, tmp_path / "ro") as view:
        for command in (["inspect", view], ["verify", view], ["migrate", "--dry-run", view]):
            error = invoke_json(*command, expect=2)["error"]
            assert "older ucm-db" in error["message"] and "ucm-db migrate" in error["hint"], (command, error)
    assert tree(source) == before
