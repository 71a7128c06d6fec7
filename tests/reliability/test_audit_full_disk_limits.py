"""Writes that fail for other reasons than a full disk, under a running
store, on both engines: a file-size limit (RLIMIT_FSIZE, in a child) and the
store's directory made read-only (a read-only bind mount over it). Puts
fail with a ``TierError`` or go on, acknowledged blocks read back right
meanwhile, puts resume once the limit is lifted, and nothing acknowledged
is lost. The audit found these holding (LMDB writes through descriptors
it holds open, so a read-only directory does not stop it; RocksDB fails
once it must make a file); these tests keep them so.
"""

from __future__ import annotations

import json
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import ucm_db
from ucm_db.errors import TierError

from .harness import mounted_tmpfs
from .test_faults import assert_readable, put_until_error

ENGINES = ["lmdb", "rocksdb"]


def _open(path: Path, engine: str) -> ucm_db.Store:
    return ucm_db.open(path, engine=engine, capacity_bytes=1 << 30, durability="group", map_size_bytes=8 << 20, codec="none")


def fsize_child(path: str, engine: str, out: str) -> None:
    """Runs in a child: puts under a 2 MiB file-size limit, then with the limit lifted; a report to ``out``."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # Python ignores it already: EFBIG, not a kill
    store = _open(Path(path), engine)
    resource.setrlimit(resource.RLIMIT_FSIZE, (2 << 20, resource.RLIM_INFINITY))
    acked, error = put_until_error(store, "limited", limit=400)
    report = {"acked": len(acked), "error": repr(error), "tier_error": isinstance(error, TierError)}
    assert_readable(store, acked)
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    deadline = time.monotonic() + 10  # RocksDB tries its reopen again 1 s after a failed try (no space was freed)
    while True:
        more, error = put_until_error(store, "lifted", limit=2)
        if error is None or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    report["resumed"] = error is None
    store.close()
    report["keys"] = [key.hex() for key in acked + more]
    Path(out).write_text(json.dumps(report))


@pytest.mark.parametrize("engine", ENGINES)
def test_a_file_size_limit_fails_puts_until_it_is_lifted(tmp_path: Path, engine: str) -> None:
    # A fresh interpreter, not a fork: RocksDB's background threads do not survive a fork of a process that opened
    # a RocksDB store before (as this one may have), and a child's writes then stall for good once a memtable is full.
    out = tmp_path / "report.json"
    code = f"from tests.reliability.test_audit_full_disk_limits import fsize_child; fsize_child(*{[str(tmp_path / 'store'), engine, str(out)]!r})"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240,
                          cwd=Path(__file__).parents[2])
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["tier_error"], report["error"]
    assert report["resumed"]
    with _open(tmp_path / "store", engine) as store:
        assert_readable(store, [bytes.fromhex(key) for key in report["keys"]])


@pytest.mark.parametrize("engine", ENGINES)
def test_a_store_directory_made_read_only_under_a_running_store(tmp_path: Path, engine: str) -> None:
    with mounted_tmpfs(tmp_path / "tmpfs", 128) as mount:  # room for more than a RocksDB memtable (16 MiB) of puts
        _read_only_under_a_running_store(mount / "store", engine)


def _read_only_under_a_running_store(path: Path, engine: str) -> None:
    store = _open(path, engine)
    failed = False
    try:
        acked, error = put_until_error(store, "before", limit=20)
        assert error is None
        subprocess.run(["mount", "--bind", str(path), str(path)], check=True)
        try:
            subprocess.run(["mount", "-o", "remount,bind,ro", str(path)], check=True)
            more, error = put_until_error(store, "read-only", limit=300)  # RocksDB: until it must make a file
            assert error is None or isinstance(error, TierError), repr(error)
            failed = error is not None
            acked += more
            assert_readable(store, acked)
        finally:
            subprocess.run(["umount", str(path)], check=True)
        more, error = put_until_error(store, "writable", limit=3)
        assert error is None, repr(error)
        acked += more
    finally:
        store.close()
    assert failed == (engine == "rocksdb")  # LMDB writes through the descriptors it holds: it goes on
    with _open(path, engine) as store:
        assert_readable(store, acked)
