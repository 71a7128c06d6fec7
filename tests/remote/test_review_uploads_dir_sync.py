"""Review of eb42ace's directory fsync (:func:`ucm_db.remote.files._sync_names`):
a shared directory a node may write and traverse but not list refuses
every upload now.

Objects are read and written by exact path, so a remote directory tree with
``-wx`` permissions for a node (search and create, no listing: a locked-down
NFS share) served every upload and read before the commit. ``_sync_names``
opens each directory ``O_RDONLY`` to fsync it, which needs read permission:
``EACCES`` is raised after the object was linked, the upload counts as
failed, and the row stays queued, retried forever (the same on every later
upload, with the object written each time). Only ``EINVAL``/``ENOTSUP`` are
taken for "no directory fsync here".

Real parts: a real directory with real permissions, the product's
``write_whole`` (what an upload calls) and ``write_new``, a real unprivileged process (as root,
the test forks a child that drops to uid 65534: root bypasses permissions).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import fsspec
import pytest

from ucm_db.remote.files import write_new, write_whole


def _in_unprivileged_child(call) -> int:  # type: ignore[no-untyped-def]
    """Exit status of ``call()`` run as an unprivileged user (0: returned)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            if os.getuid() == 0:
                os.setgid(65534)
                os.setuid(65534)
            call()
            code = 0
        except BaseException:  # noqa: BLE001 - reported by the exit status
            code = 3
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


@pytest.mark.parametrize("write", [write_whole, write_new], ids=["write_whole", "write_new"])
def test_an_upload_into_a_write_only_directory_still_succeeds(tmp_path: Path, write) -> None:  # type: ignore[no-untyped-def]
    """``write_whole``: an object upload (``RemoteTier.store``) or a
    tombstone; ``write_new``: a manifest or an epoch claim."""
    base = Path(tempfile.mkdtemp(dir="/tmp")) if os.getuid() == 0 else tmp_path  # pytest's root tmp is 0700
    base.chmod(0o755)
    shard = base / "remote" / "ns" / "ab"
    shard.mkdir(parents=True)
    for directory in (base / "remote", base / "remote" / "ns", shard):
        directory.chmod(0o733)  # search and create, no listing
    target = str(shard / ("ab" + "0" * 62))
    fs = fsspec.filesystem("file")
    try:
        status = _in_unprivileged_child(lambda: write(fs, target, b"object"))
        assert os.path.exists(target), "the object was not written at all"
        assert status == 0, "the upload failed after its object was written (directory fsync: EACCES)"
    finally:
        for directory in (base / "remote", base / "remote" / "ns", shard):
            directory.chmod(0o755)
        if base != tmp_path:
            shutil.rmtree(base, ignore_errors=True)
