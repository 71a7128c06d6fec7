"""Audit: the hidden temp file of an ``ucm-db export`` killed mid-write.

An export writes its archive under a hidden temp name beside the
destination and renames it into place. A SIGKILLed export cannot remove it,
and before this fix nothing ever did: each killed export left a file of up
to the archive's size in the destination directory, for ever. Now the temp
file is held under an exclusive ``flock`` for its export's life (the kernel
drops it when the process dies, however it dies), and the next export to
the directory removes every temp file whose lock it can take, and no other
(:mod:`ucm_db.maintenance.archive.temps`).

Every export here is a real ``ucm-db export`` process over a real 128 MiB
LMDB store, stopped mid-write with SIGSTOP (so "mid-write" is checked, not
hoped for: its temp file exists and is growing, its archive does not), then
killed with SIGKILL, or continued (a live export).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

import ucm_db
from ucm_db import Namespace
from ucm_db.maintenance.archive import files, temps

pytestmark = pytest.mark.timeout(300)
NS = Namespace(model="test/leftover-exports", kv_dtype="bfloat16", block_size=16)
BLOCKS, BLOCK_BYTES = 512, 256 << 10  # 128 MiB of incompressible payload: the write takes a while
#: Bytes of temp file that show the export is writing its blocks.
MID_WRITE_BYTES = 4 << 20


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("leftovers") / "store"
    with ucm_db.open(path, capacity_bytes=1 << 30, codec="none") as opened:
        keys = NS.block_keys(list(range(BLOCKS * NS.block_size)))
        opened.put(NS, keys, [os.urandom(BLOCK_BYTES) for _ in range(BLOCKS)])
    return path


def _export(store: Path, archive: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "ucm_db.tools.cli", "export", str(store), str(archive), "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _stopped_mid_write(store: Path, archive: Path) -> tuple[subprocess.Popen[str], Path]:
    """A real export of ``store`` to ``archive``, stopped (SIGSTOP) while
    its temp file holds at least MID_WRITE_BYTES and its archive does not
    exist yet; with that temp file."""
    child = _export(store, archive)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        temp = next((p for p in archive.parent.iterdir() if p.name.startswith(f".{archive.name}.")), None)
        if temp is not None and os.stat(temp).st_size >= MID_WRITE_BYTES:
            child.send_signal(signal.SIGSTOP)
            _, status = os.waitpid(child.pid, os.WUNTRACED)  # returns once it is stopped (or if it ended)
            assert os.WIFSTOPPED(status), child.communicate()
            break
        assert child.poll() is None, child.communicate()
        time.sleep(0.002)
    else:
        child.kill()
        pytest.fail("the export wrote no temp file of MID_WRITE_BYTES within 120 s")
    assert child.poll() is None and temp.exists() and not archive.exists()  # stopped mid-write, alive
    return child, temp


def _second_export(store: Path, archive: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "ucm_db.tools.cli", "export", str(store), str(archive), "--json"],
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr
    _check_archive(archive)


def _check_archive(archive: Path) -> None:
    with tarfile.open(archive) as tar:
        assert len(tar.getmembers()) == BLOCKS + 1  # every block and the manifest


def test_the_next_export_removes_the_temp_file_of_an_export_killed_mid_write(store: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    child, temp = _stopped_mid_write(store, out / "a.tar")
    child.send_signal(signal.SIGKILL)
    child.communicate(timeout=60)
    assert child.returncode == -signal.SIGKILL
    assert temp.exists() and os.stat(temp).st_size >= MID_WRITE_BYTES  # what the killed export left
    _second_export(store, out / "b.tar")  # another archive, same directory
    assert sorted(p.name for p in out.iterdir()) == ["b.tar"]  # the stale temp file is gone, nothing else left


def test_a_live_export_keeps_its_temp_file_while_another_export_runs(store: Path, tmp_path: Path) -> None:
    """The stopped export is alive (its pid, its lock): the second export
    must leave its temp file alone, and it then completes as if nothing
    had happened."""
    out = tmp_path / "out"
    out.mkdir()
    child, temp = _stopped_mid_write(store, out / "a.tar")
    before = os.stat(temp)
    try:
        _second_export(store, out / "b.tar")
        after = os.stat(temp)
        assert (after.st_ino, after.st_size) == (before.st_ino, before.st_size)
    finally:
        child.send_signal(signal.SIGCONT)
    _, stderr = child.communicate(timeout=240)
    assert child.returncode == 0, stderr
    _check_archive(out / "a.tar")
    assert sorted(p.name for p in out.iterdir()) == ["a.tar", "b.tar"]


def test_only_unlocked_regular_temp_files_of_this_version_are_removed(tmp_path: Path) -> None:
    """What the cleaner leaves: an older ucm-db's unlocked ``.partial`` temp
    file (nothing proves its export dead), a FIFO under a temp file's name
    (never opened: the export must not hang on it), and the temp file of an
    export running in this very process (on NFS, flock is a process-wide
    POSIX lock this process would get). An unlocked one of this version goes."""
    older = tmp_path / ".x.tar.0123456789abcdef.partial"
    older.write_bytes(b"an older ucm-db's export, perhaps running")
    fifo = tmp_path / ".y.tar.ucm-db-export.0123456789abcdef.partial"
    os.mkfifo(fifo)
    dead = tmp_path / ".z.tar.ucm-db-export.fedcba9876543210.partial"
    dead.write_bytes(b"no lock: its export is gone")
    with files.atomic_output(tmp_path / "w.tar", 0o600) as out:
        out.write(b"being written")
        ours = next(p for p in tmp_path.iterdir() if p.name.startswith(".w.tar."))
        assert temps.remove_abandoned_temps(tmp_path) == []  # the running export's own temp file stays
        assert ours.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([older.name, fifo.name, "w.tar"])
    assert (tmp_path / "w.tar").read_bytes() == b"being written"
