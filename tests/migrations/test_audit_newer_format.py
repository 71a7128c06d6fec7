"""``ucm-db migrate`` on a store of a newer format than this ucm-db knows is
refused before anything opens the store for writing, as a FormatVersionError
(exit 2) with the fix.

Audit finding: ``migrate`` opened the store's engine for writing and only
then read its format. On a RocksDB store written by a newer ucm-db, that
writable open replayed the write-ahead log into a new table file, wrote a new
MANIFEST and OPTIONS file and dropped the old ones (12 files of the store
changed), all by this older RocksDB, before ``migrate`` said "newer than the
target" (exit 1, a MigrationError, where ``ucm_db.open`` of the same store
is a FormatVersionError, exit 2). Now the format is read through a
read-only open first; a store needing no migration is not opened for
writing at all.

``migrate --to-engine`` of such a store said "run `ucm-db migrate PATH`
first", which then refused it as newer; it now names the upgrade.

Real stores, the real ``ucm-db`` entry point in a child process.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

import ucm_db
from ucm_db import FormatVersionError, Namespace, migrations
from ucm_db.errors import MigrationError
from ucm_db.format import write_format_version
from ucm_db.store import STORE_FORMAT_VERSION

NS = Namespace(model="test/migrate-newer", kv_dtype="bfloat16", block_size=4)
#: Files every open rewrites (the lock files): not the store's contents.
LOCK_FILES = {"ucm-db.lock", "lmdb/lock.mdb"}


def files_of(path: Path) -> dict[str, tuple[str, int]]:
    return {str(f.relative_to(path)): (hashlib.sha256(f.read_bytes()).hexdigest(), f.stat().st_mtime_ns)
            for f in sorted(path.rglob("*")) if f.is_file() and str(f.relative_to(path)) not in LOCK_FILES}


def make_store(path: Path, engine: str, format_version: int | None = None) -> None:
    with ucm_db.open(path, engine=engine) as store:
        store.put(NS, NS.block_keys(list(range(12))), [bytes([i]) * 256 for i in range(3)])
        if format_version is not None:  # as newer code writes it: checksummed
            store._tier.engine.write(lambda txn: write_format_version(txn, format_version))


def cli(*args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ucm_db.tools.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("engine", ["rocksdb", "lmdb"])
def test_migrate_of_a_newer_store_is_refused_and_changes_no_file(tmp_path: Path, engine: str) -> None:
    path = tmp_path / "s"
    make_store(path, engine, STORE_FORMAT_VERSION + 5)
    before = files_of(path)
    results = [cli(*args) for args in (("migrate", path), ("migrate", path, "--dry-run"))]
    assert files_of(path) == before
    for result in results:
        assert result.returncode == 2, result.stderr
        assert "newer" in result.stderr and "upgrade ucm-db" in result.stderr


@pytest.mark.parametrize("engine", ["rocksdb", "lmdb"])
def test_conversion_of_a_newer_store_names_the_upgrade_not_migrate(tmp_path: Path, engine: str) -> None:
    """Audit finding: ``migrate --to-engine`` of a newer store said "run `ucm-db migrate PATH` first", which
    then refuses the store as newer; the fix is an upgrade."""
    path = tmp_path / "s"
    make_store(path, engine, STORE_FORMAT_VERSION + 5)
    before = files_of(path)
    result = cli("migrate", "--to-engine", "lmdb" if engine == "rocksdb" else "rocksdb", path, tmp_path / "d")
    assert result.returncode == 2 and "newer" in result.stderr and "upgrade ucm-db" in result.stderr, result.stderr
    assert "ucm-db migrate" not in result.stderr
    assert files_of(path) == before and not (tmp_path / "d").exists()


def test_the_newer_store_error_is_a_format_version_error_and_a_migration_error(tmp_path: Path) -> None:
    path = tmp_path / "s"
    make_store(path, "lmdb", STORE_FORMAT_VERSION + 1)
    with pytest.raises(FormatVersionError, match="newer") as caught:
        migrations.migrate(path)
    assert isinstance(caught.value, MigrationError)  # what callers caught before
    assert "upgrade ucm-db" in caught.value.hint


def test_migrate_of_a_current_rocksdb_store_changes_no_file(tmp_path: Path) -> None:
    path = tmp_path / "s"
    make_store(path, "rocksdb")
    before = files_of(path)
    assert migrations.migrate(path) == []
    assert files_of(path) == before
