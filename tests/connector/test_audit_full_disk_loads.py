"""A store whose every read fails, under a connector worker: each step's
loads fail and are reported to vLLM (recomputed), counted in
``load_errors``, and logged once a minute at most, not once a step; once
the disk has room again, loads and saves resume without a restart.

The fault is real: a RocksDB store on a small tmpfs (mounted by the test,
root only) whose space and inodes are used up, with the temp directory on
the same disk, as ``/tmp`` often is. A write fails, the database cannot be
reopened, and no read-only stand-in can be made either (it needs a
directory of links in the temp directory): every read is a ``TierError``.
Before the audit a load that raised was reported to vLLM but never counted
(``load_errors`` stayed 0 while every load failed), and each step logged it
with a traceback.
"""

from __future__ import annotations

import errno
import logging
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from ucm_db.connector.metadata import BlockTransfer  # noqa: E402

from test_audit_full_disk_writer import Worker, request_keys  # noqa: E402
from tests.reliability.test_faults import fill_leaving  # noqa: E402

STEPS = 10


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    """A 24 MiB tmpfs with 64 inodes."""
    mount_point = tmp_path / "tmpfs"
    mount_point.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m,nr_inodes=64", "tmpfs", str(mount_point)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN): {proc.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def use_up_inodes(directory: Path) -> list[Path]:
    """Empty files in ``directory`` until the file system has no inode left."""
    directory.mkdir()
    made = []
    while True:
        try:
            (directory / str(len(made))).touch()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
            return made
        made.append(directory / str(len(made)))


def test_loads_from_a_store_that_cannot_be_read_are_counted_logged_once_and_resume(
        disk: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    temp = disk / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))  # the temp directory on the store's disk, as /tmp often is
    w = Worker(disk / "store", "rocksdb", "kv_both")
    assert w.step([BlockTransfer("s0", request_keys(0), (0, 1, 2, 3))])
    w.worker.drain()
    filler, inodes = fill_leaving(disk, 0), use_up_inodes(disk / "inodes")
    for number in (1, 3):  # the first fails, the second finds the store cannot be reopened nor read
        assert w.step([BlockTransfer(f"s{number}", request_keys(number), (4, 5, 6, 7))])
        w.worker.drain()
    assert w.totals["save_errors"] == 8
    with caplog.at_level(logging.WARNING):
        for step in range(STEPS):
            assert w.step([], [BlockTransfer(f"l{step}", request_keys(0), (40, 41, 42, 43))])
            assert w.worker.take_load_errors() == {40, 41, 42, 43}, "a failed load must be reported: vLLM recomputes it"
    assert w.totals["load_errors"] == 4 * STEPS, "every failed block is counted"
    lines = [r for r in caplog.records if "loading KV blocks failed" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage()[:100] for r in lines]
    assert "counted in load_errors" in lines[0].getMessage()

    filler.unlink()
    for inode in inodes:
        inode.unlink()
    assert w.step([BlockTransfer("s2", request_keys(2), (8, 9, 10, 11))],
                  [BlockTransfer("again", request_keys(0), (40, 41, 42, 43))])
    w.worker.drain()
    assert w.worker.take_load_errors() == set(), "loads did not resume once the disk had room"
    assert w.totals["saved_blocks"] == 8, "saves did not resume once the disk had room"
    w.worker.shutdown()
