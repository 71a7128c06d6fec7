"""`ucm-db compact` on a full disk, for a store whose rewrite takes the
table-by-table copy (a quarantine left a payload on a page LMDB cannot
free): the copy opened its destination with a lock file, which LMDB writes
through a shared mapping, and the first touch of a page the full tmpfs
could not back killed compact with SIGBUS (exit -7, a temp directory left
behind). It must be the same clean "disk is full" error as LMDB's own
compacting copy gives, the data file untouched.

Real parts: a small tmpfs filled to its last block (needs root; skipped
otherwise, as the other disk-full tests), a real zeroed overflow page found
by searching data.mdb for the payload's bytes, the CLI as a subprocess (a
SIGBUS kills the child, not pytest).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import ucm_db
from ucm_db.maintenance import verify

from .harness import NS, mounted_tmpfs

PAGE = 4096
BLOCKS = 8
DAMAGED = 3


def _payload(i: int) -> bytes:
    return hashlib.shake_256(b"audit-disk/%d" % i).digest(64 << 10)


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    with mounted_tmpfs(tmp_path / "tmpfs", 16) as mount_point:
        yield mount_point


def _store_with_a_stuck_payload(path: Path) -> list[bytes]:
    keys = NS.block_keys(list(range(BLOCKS * NS.block_size)))
    with ucm_db.open(path, codec="none", map_size_bytes=8 << 20) as store:
        store.put(NS, keys, [_payload(i) for i in range(BLOCKS)])
    data = path / "lmdb" / "data.mdb"
    raw = bytearray(data.read_bytes())
    page = raw.find(_payload(DAMAGED)[:256]) // PAGE
    while int.from_bytes(raw[page * PAGE + 10:page * PAGE + 12], "little") != 0x04:  # P_OVERFLOW: the run's first page
        page -= 1
    raw[page * PAGE:(page + 1) * PAGE] = bytes(PAGE)
    data.write_bytes(raw)
    with ucm_db.open(path) as store:  # the read quarantines it; its payload cannot be freed: stuck
        assert store.get(NS, keys)[DAMAGED] is None
        assert store._tier.quarantine_records()[keys[DAMAGED]].get("payload_stuck")
    return keys


def _fill(mount_point: Path) -> None:
    with open(mount_point / "filler", "wb", buffering=0) as f:
        for chunk in (1 << 16, 512):
            try:
                while True:
                    f.write(bytes(chunk))
            except OSError:
                pass


def test_compact_with_a_stuck_payload_on_a_full_disk_is_a_clear_error(small_tmpfs: Path) -> None:
    path = small_tmpfs / "store"
    keys = _store_with_a_stuck_payload(path)
    _fill(small_tmpfs)
    data = path / "lmdb" / "data.mdb"
    before = hashlib.sha256(data.read_bytes()).hexdigest()

    done = subprocess.run([sys.executable, "-m", "ucm_db.tools.cli", "compact", str(path)], capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 1, f"exit {done.returncode}: {done.stderr[-800:]}"
    assert "disk is full" in done.stderr and "free up to" in done.stderr, done.stderr
    assert hashlib.sha256(data.read_bytes()).hexdigest() == before, "the data file must be untouched"
    assert [p.name for p in path.iterdir() if p.name.startswith("lmdb.compact")] == []

    os.unlink(small_tmpfs / "filler")
    done = subprocess.run([sys.executable, "-m", "ucm_db.tools.cli", "compact", str(path)], capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert not verify(path).problems
    with ucm_db.open(path) as store:
        assert store._tier.quarantine_records() == {}  # the rewrite left the stuck payload behind
        assert store.get(NS, keys[:DAMAGED]) == [_payload(i) for i in range(DAMAGED)]
        store.put(NS, keys, [_payload(i) for i in range(BLOCKS)])
        assert store.get(NS, keys) == [_payload(i) for i in range(BLOCKS)]
