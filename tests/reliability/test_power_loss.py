"""Group durability after an OS crash: markers, the child check, set-aside.

A power loss cannot be produced in a test. What the recovery code sees of
one is a marker of unsynced commits written under another boot id, so these
tests write under ``UCM_DB_BOOT_ID=boot-a`` in a real child process that is
SIGKILLed (its marker stays), and reopen under ``boot-b``: the one simulated
part, and it is the boot id alone. The damage a power loss leaves (pages
never written) is produced for real, by truncating ``data.mdb``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

import ucm_db
from ucm_db.tiers.lmdb_recovery import BOOT_ID_ENV, MARKER_DIR

from .harness import NS, chain_tokens, fork_call, kill_and_reap, payload_for, tail, wait_counter, write_counter

pytestmark = [pytest.mark.multiprocess]

GROUP = {"durability": "group", "sync_interval_s": 3600.0, "sync_bytes": 1 << 40}
BLOCKS = 24
BLOCK_BYTES = 48 << 10


def _keys() -> list[bytes]:
    return NS.block_keys(chain_tokens("power-loss", BLOCKS))


def _markers(store_path: Path) -> list[str]:
    marker_dir = store_path / "lmdb" / MARKER_DIR
    return sorted(os.listdir(marker_dir)) if marker_dir.is_dir() else []


def _write_then_wait(store_path: Path, boot: str, ready: Path) -> None:
    """Child: puts the blocks unsynced, says so, and waits for its SIGKILL."""
    os.environ[BOOT_ID_ENV] = boot
    store = ucm_db.open(store_path, **GROUP)
    keys = _keys()
    store.put(NS, keys, [payload_for(k, BLOCK_BYTES) for k in keys])
    write_counter(ready, 1)
    while True:
        os.pause()


def _killed_writer(tmp_path: Path, boot: str) -> Path:
    store_path = tmp_path / "store"
    ready = tmp_path / "ready"
    pid = fork_call(_write_then_wait, store_path, boot, ready, log_path=tmp_path / "writer.log")
    try:
        assert wait_counter(ready, 1, timeout_s=60) == 1, tail(tmp_path / "writer.log")
    finally:
        kill_and_reap(pid)
    assert [m.split(".")[0] for m in _markers(store_path)] == [boot], "the killed writer's marker is on disk"
    return store_path


def test_marker_exists_exactly_while_commits_are_unsynced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BOOT_ID_ENV, "boot-a")
    keys = _keys()
    with ucm_db.open(tmp_path / "group", **GROUP) as store:
        mine = [f"boot-a.{os.getpid()}"]
        store.put(NS, keys[:4], [payload_for(k, 1024) for k in keys[:4]])
        assert _markers(tmp_path / "group") == mine
        store.flush()
        assert _markers(tmp_path / "group") == mine, "a writing process keeps its marker across syncs"
        store.flush()
        assert _markers(tmp_path / "group") == [], "a sync after a commit-free interval removes it"
        store.put(NS, keys[4:8], [payload_for(k, 1024) for k in keys[4:8]], parent=keys[3])
        assert _markers(tmp_path / "group") == mine
    assert _markers(tmp_path / "group") == [], "close syncs, so it leaves no marker"
    with ucm_db.open(tmp_path / "sync", durability="sync") as store:
        store.put(NS, keys[:4], [payload_for(k, 1024) for k in keys[:4]])
        assert _markers(tmp_path / "sync") == []


def test_process_crash_loses_nothing_and_needs_no_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store_path = _killed_writer(tmp_path, "boot-a")
    monkeypatch.setenv(BOOT_ID_ENV, "boot-a")  # same boot: only the process died
    with ucm_db.open(store_path, **GROUP) as store:
        assert store.tier.engine.recovery is None
        keys = _keys()
        assert store.get(NS, keys) == [payload_for(k, BLOCK_BYTES) for k in keys]
        assert all(not m.startswith("boot-a.") or m.endswith(f".{os.getpid()}") for m in _markers(store_path))


def test_intact_store_after_an_os_crash_is_checked_and_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store_path = _killed_writer(tmp_path, "boot-a")
    monkeypatch.setenv(BOOT_ID_ENV, "boot-b")  # the machine rebooted
    with ucm_db.open(store_path, **GROUP) as store:
        report = store.tier.engine.recovery
        assert report is not None and not report.damaged and report.foreign_markers == 1
        keys = _keys()
        assert store.get(NS, keys) == [payload_for(k, BLOCK_BYTES) for k in keys]
        assert not any(m.startswith("boot-a.") for m in _markers(store_path))
    assert not (store_path / "damaged").exists()


def test_damaged_store_after_an_os_crash_is_set_aside_not_crashed_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    store_path = _killed_writer(tmp_path, "boot-a")
    data = store_path / "lmdb" / "data.mdb"
    os.truncate(data, data.stat().st_size // 2)  # pages the power loss never let reach the disk
    monkeypatch.setenv(BOOT_ID_ENV, "boot-b")
    caplog.set_level(logging.WARNING, logger="ucm_db")
    with ucm_db.open(store_path, **GROUP) as store:
        report = store.tier.engine.recovery
        assert report is not None and report.damaged and report.moved_to is not None
        assert (report.moved_to / "data.mdb").exists(), "the damaged file is kept for inspection"
        assert store.stats().blocks == 0
        keys = _keys()
        assert store.get(NS, keys[:1]) == [None]
        store.put(NS, keys[:2], [b"fresh-0", b"fresh-1"])
        assert store.get(NS, keys[:2]) == [b"fresh-0", b"fresh-1"]
    assert any("moved it to" in r.getMessage() and "durability='sync'" in r.getMessage() for r in caplog.records)
    with ucm_db.open(store_path, **GROUP) as store:
        assert store.tier.engine.recovery is None and store.get(NS, keys[:2]) == [b"fresh-0", b"fresh-1"]
