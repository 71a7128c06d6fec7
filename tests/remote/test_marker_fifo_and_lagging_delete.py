"""Two hardenings of the remote tier's edges.

* A root marker (``auth.json``, ``encryption.json``) is read as objects and
  manifests are: one bounded request, a regular file only. Before, the
  marker was read with ``fs.cat_file``: a FIFO in ``auth.json``'s place held
  the open for MARKER_WAIT_S (10 s), left a thread blocked in ``open()`` for
  good, and the keyless open then went on as if there were no marker.
* A remote delete (a retraction) is sent whatever ``exists`` answers.
  Before, a ``False`` from ``exists`` skipped it: on an eventually
  consistent store a lagging answer confirmed the retraction while the
  object stayed.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from fsspec.implementations.local import LocalFileSystem

import ucm_db
from ucm_db.errors import ConfigError
from ucm_db.remote.keying import MARKER_NAME
from ucm_db.remote.tier import RemoteRoot

from .conftest import key_file

pytestmark = pytest.mark.timeout(60)


def _unblock(fifo: Path) -> None:
    """Opens the FIFO's write end once so a reader stuck on it (the code before the fix) returns."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass  # no reader waiting: nothing stuck


def test_a_fifo_in_the_markers_place_is_refused_at_once_and_blocks_nothing(tmp_path: Path) -> None:
    root = tmp_path / "remote"
    root.mkdir()
    fifo = root / MARKER_NAME
    os.mkfifo(fifo)
    try:
        started = time.monotonic()
        with pytest.raises(ConfigError, match="is keyed"):  # the safe side: what is there may mean keyed
            ucm_db.open(tmp_path / "s", capacity_bytes=64 << 20, remote=f"file://{root}")
        assert time.monotonic() - started < 5.0
        assert not [t for t in threading.enumerate() if t.name == "ucm-db-remote-keying" and t.is_alive()]
        keyed = key_file(tmp_path, bytes(range(32)))
        with ucm_db.open(tmp_path / "k", capacity_bytes=64 << 20, remote=f"file://{root}", remote_auth_key_file=keyed):
            pass  # a keyed open goes on, and leaves the FIFO as it is
        assert fifo.is_fifo()
    finally:
        _unblock(fifo)


class _LaggingExists(LocalFileSystem):
    """A local directory whose ``exists`` lags behind the writes (says
    "absent"), as an eventually consistent object store's HEAD can: a fault
    neither a local directory nor moto's S3 produces, hence this wrapper."""

    def exists(self, path: Any, **kwargs: Any) -> bool:
        return False


def test_a_delete_goes_out_whatever_a_lagging_exists_says(tmp_path: Path) -> None:
    namespace_id, key = bytes(range(16)), bytes(range(32))
    lagging = RemoteRoot(_LaggingExists(), str(tmp_path / "remote"))
    tier = lagging.tier(namespace_id)
    tier.store(key, None, b"\0" * 64)
    assert Path(tier.path(key)).is_file()
    tier.delete([key])
    assert not Path(tier.path(key)).exists()
    assert tier.delete([key]) == 0  # gone: nothing to count, nothing raised
