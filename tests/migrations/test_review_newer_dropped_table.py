"""Review of ab89e0a (migrate reads the format read-only first):
reproduction of a gap, fixed.

``format_read_only`` returns None (``migrate`` then opens for writing) for
any RocksDB store that lacks one of today's tables, taking it for an older
ucm-db's. A newer ucm-db's store that dropped or renamed a table is then
opened for writing by this RocksDB (the missing table created, the WAL
replayed, MANIFEST and OPTIONS rewritten: 9 files here) before ``migrate``
refuses it as newer: the case ab89e0a set out to stop. Not a regression
(ab89e0a^ opened every store for writing); a gap in the new guarantee,
"refused before anything opens it for writing". The newer store is made as
test_audit_newer_format.py makes one, plus one dropped column family.

Fixed (migrations/access.py, format_read_only): on "lacks tables", the store
is opened read-only with the column families it has (through a private
shadow directory, as the engine's read-only open) and the format record read
from ``info``. That read also lets ``migrate --dry-run`` (``pending`` and
``applied``) list the migrations of a format-1 or format-2 RocksDB store,
which it refused ("lacks tables heads", exit 2) telling the user to run
``ucm-db migrate``.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import rocksdict

import ucm_db
from ucm_db import FormatVersionError, Namespace, migrations
from ucm_db.format import write_format_version
from ucm_db.store import STORE_FORMAT_VERSION

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "stores"
NS = Namespace(model="test/review-newer-dropped", kv_dtype="bfloat16", block_size=4)
STATE_FILES_SKIPPED = {"ucm-db.lock", "LOCK"}  # lock files; RocksDB's LOG files too (below)


def files_of(path: Path) -> dict[str, str]:
    return {str(f.relative_to(path)): hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.rglob("*"))
            if f.is_file() and f.name not in STATE_FILES_SKIPPED and not f.name.startswith("LOG")}


def test_a_newer_store_without_one_of_todays_tables_changes_no_file(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with ucm_db.open(path, engine="rocksdb") as store:
        store.put(NS, NS.block_keys(list(range(12))), [bytes([i]) * 256 for i in range(3)])
        store._tier.engine.write(lambda txn: write_format_version(txn, STORE_FORMAT_VERSION + 1))
    db_dir = next(path.rglob("CURRENT")).parent
    tables = rocksdict.Rdict.list_cf(str(db_dir), rocksdict.Options(raw_mode=True))
    assert "heads" in tables
    db = rocksdict.Rdict(str(db_dir), options=rocksdict.Options(raw_mode=True),
                         column_families={t: rocksdict.Options(raw_mode=True) for t in tables})
    db.drop_column_family("heads")  # the newer format keeps heads elsewhere
    db.close()
    before = files_of(path)
    with pytest.raises(FormatVersionError, match="newer"):
        migrations.migrate(path)
    assert files_of(path) == before  # ab89e0a: 9 files changed, "heads" created again


@pytest.mark.parametrize("old_format", [1, 2])
def test_a_dry_run_lists_the_migrations_of_an_older_rocksdb_store_and_changes_no_file(tmp_path: Path,
                                                                                     old_format: int) -> None:
    """The checked-in fixture stores lack today's ``heads`` table: ``migrate --dry-run`` (the real entry point)
    listed nothing and said "lacks tables heads ... run `ucm-db migrate`" (exit 2); it now lists the pending
    migrations, reading the store read-only, and ``migrate`` then applies exactly those."""
    path = tmp_path / "s"
    shutil.copytree(FIXTURES / f"format{old_format}-rocksdb", path)
    before = files_of(path)
    result = subprocess.run([sys.executable, "-m", "ucm_db.tools.cli", "migrate", str(path), "--dry-run", "--json"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    expected = list(range(old_format + 1, STORE_FORMAT_VERSION + 1))
    assert [m["version"] for m in report["pending"]] == expected and report["applied"] == []
    assert files_of(path) == before
    assert [m.version for m in migrations.migrate(path)] == expected
    assert [a.version for a in migrations.applied(path)] == expected
