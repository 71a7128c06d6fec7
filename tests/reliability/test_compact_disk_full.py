"""`ucm-db compact` on a full disk (issue 26, item 11): the rewrite (a
compacted copy of the data file beside it) cannot be written. compact died
with a raw lmdb.DiskError; it now exits with a ucm-db error naming the fix,
and leaves the store as it was (no copy left behind, the data file
untouched, every block readable). Blocks that compact evicted before the
rewrite stay evicted: those were committed transactions of their own.

A real full disk: a small tmpfs (needs root; skipped otherwise, as the other
disk-full tests)."""

from __future__ import annotations

import hashlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

import ucm_db
from ucm_db.errors import TierError
from ucm_db.maintenance import compact
from ucm_db.tools.cli import cli

from .harness import NS, mounted_tmpfs

BLOCKS = 48
BLOCK_BYTES = 64 << 10


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    with mounted_tmpfs(tmp_path / "tmpfs", 16) as mount_point:
        yield mount_point


def _payload(i: int) -> bytes:
    return hashlib.shake_256(b"full/%d" % i).digest(BLOCK_BYTES)


def _fill(mount_point: Path) -> None:
    """Fills the file system up to its last block."""
    with open(mount_point / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(bytes(1 << 16))
        except OSError:
            pass
        try:
            while True:
                f.write(bytes(512))
        except OSError:
            pass


def test_compact_on_a_full_disk_is_a_clear_error_and_changes_nothing(small_tmpfs: Path) -> None:
    path = small_tmpfs / "store"
    keys = NS.block_keys(list(range(BLOCKS * NS.block_size)))
    with ucm_db.open(path, codec="none", map_size_bytes=8 << 20) as store:
        store.put(NS, keys, [_payload(i) for i in range(BLOCKS)])
        store.delete(NS, keys[BLOCKS // 2:BLOCKS // 2 + 1])  # free pages: a rewrite would shrink the file
    _fill(small_tmpfs)
    data = path / "lmdb" / "data.mdb"
    before = hashlib.sha256(data.read_bytes()).hexdigest()

    result = CliRunner().invoke(cli, ["compact", str(path)], catch_exceptions=False)
    assert result.exit_code == 1, result.output  # a ucm-db error, printed (not a traceback)
    assert "disk is full" in result.stderr and "free up to" in result.stderr, result.stderr
    with pytest.raises(TierError, match="disk is full") as info:
        compact(path)
    assert "ucm-db compact again" in info.value.hint

    assert hashlib.sha256(data.read_bytes()).hexdigest() == before, "the data file must be untouched"
    assert [p.name for p in path.iterdir() if p.name.startswith("lmdb.compact")] == []
    os.unlink(small_tmpfs / "filler")
    with ucm_db.open(path) as store:
        assert store.get(NS, keys[:BLOCKS // 2]) == [_payload(i) for i in range(BLOCKS // 2)]
    assert compact(path)["rewrite"] == "rewritten"
