"""Audit: one store path, one error, whichever door it enters by.

A store path with a name over the file system's limit (255 bytes) is the
user's input, so it is a ConfigError naming the fix -- what ``ucm_db.open``
and the CLI raise (docs/api.md), and the connector too (it was a TierError:
``connector/stores.py``'s ``store_is_read_only`` runs ``Path.is_dir`` on the
path first, and Python 3.11 raises ENAMETOOLONG from it)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import ucm_db
from ucm_db.errors import ConfigError


def test_the_core_names_a_too_long_name_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="name of 300 bytes") as raised:
        ucm_db.open(tmp_path / ("a" * 300))
    assert "255" in raised.value.hint


def test_the_connector_names_a_too_long_name_a_config_error_too(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    from ucm_db.connector.stores import check_openable, role_settings

    try:
        settings, _ = role_settings({"path": str(tmp_path / ("a" * 300))}, "kv_both")
        check_openable(settings)
    except ucm_db.UcmDbError as exc:
        assert isinstance(exc, ConfigError), f"{type(exc).__name__}: {exc}"
        assert "255" in (exc.hint or "")
    else:
        pytest.fail("a 300-byte name was accepted")


def _open_lock_files(pid: int) -> set[str]:
    """The store lock files process ``pid`` has open (real paths)."""
    fds = Path(f"/proc/{pid}/fd")
    return {os.readlink(fd) for fd in fds.iterdir() if os.readlink(fd).endswith("ucm-db.lock")}


def test_the_commit_process_opens_the_store_the_worker_holds_after_its_link_moved(tmp_path: Path) -> None:
    """The store path is a symlink, moved to another store between the
    worker's open and the commit process's start (a deployment switching
    its cache link while an engine starts). The commit process must open
    the store the worker holds, not the link's new target: it was handed
    the configured path and resolved it again, so its puts went to a store
    the worker never reads. Real stores, a real commit process (its open
    lock file read from /proc)."""
    pytest.importorskip("vllm")
    if not Path("/proc/self/fd").is_dir():
        pytest.skip("no /proc to read the commit process's open files from")
    from ucm_db.connector.settings import ConnectorSettings
    from ucm_db.connector.stores import acquire, acquire_committer, release, release_committer

    held, other = tmp_path / "a", tmp_path / "b"
    ucm_db.open(held).close()
    ucm_db.open(other).close()
    link = tmp_path / "current"
    link.symlink_to(held)
    settings = ConnectorSettings.from_extra_config({"path": str(link)})
    store = acquire(settings)
    try:
        (tmp_path / "next").symlink_to(other)
        os.replace(tmp_path / "next", link)  # the link now names the other store
        committer = acquire_committer(settings)
        try:
            assert _open_lock_files(committer.pid) == {str(held / "ucm-db.lock")}
        finally:
            release_committer(committer)
    finally:
        release(store)
