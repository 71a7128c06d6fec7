"""Group durability after an OS crash: synced snapshots, rollback, legacy markers.

Power is cut for real in ``test_powercut.py`` (a FUSE file system). These
tests pin down the pieces on the real disk: a writer child puts under
``UCM_DB_BOOT_ID=boot-a`` and is SIGKILLed with commits after its last
sync; reopening under ``boot-a`` is a process crash (nothing may be lost),
under ``boot-b`` a reboot (the store reopens its last synced snapshot). The
pages a power loss never wrote are removed for real, by truncating
``data.mdb`` to the synced snapshot's end. Stores of older versions, which
left unsynced-commit markers, are made by writing such a marker by hand.
"""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

import pytest

import ucm_db
from ucm_db import maintenance
from ucm_db.engines.lmdb.groupsync import read_record
from ucm_db.engines.lmdb.meta import check_file, read_meta_pages
from ucm_db.engines.lmdb.recovery import BOOT_ID_ENV, MARKER_DIR

from .harness import NS, chain_tokens, fork_call, kill_and_reap, payload_for, tail, wait_counter, write_counter

pytestmark = [pytest.mark.multiprocess]

GROUP = {"durability": "group", "sync_interval_s": 3600.0, "sync_bytes": 1 << 40}
BLOCKS = 24
SYNCED = 12  # blocks put and flushed before the unsynced rest
BLOCK_BYTES = 48 << 10


def _keys() -> list[bytes]:
    return NS.block_keys(chain_tokens("power-loss", BLOCKS))


def _payloads(keys: list[bytes]) -> list[bytes]:
    return [payload_for(k, BLOCK_BYTES) for k in keys]


def _write_then_wait(store_path: Path, boot: str, ready: Path, churn: bool = False) -> None:
    """Child: puts SYNCED blocks and flushes, puts the rest unsynced, says so, waits for SIGKILL.
    With ``churn`` it then deletes and puts the unsynced blocks again, so
    pages of the synced snapshot are freed after it."""
    os.environ[BOOT_ID_ENV] = boot
    store = ucm_db.open(store_path, **GROUP)
    keys = _keys()
    store.put(NS, keys[:SYNCED], _payloads(keys[:SYNCED]))
    store.flush()
    store.put(NS, keys[SYNCED:], _payloads(keys[SYNCED:]), parent=keys[SYNCED - 1])
    if churn:
        store.delete(NS, keys[SYNCED:])
        store.put(NS, keys[SYNCED:], _payloads(keys[SYNCED:]), parent=keys[SYNCED - 1])
    write_counter(ready, 1)
    while True:
        signal.pause()


def _killed_writer(tmp_path: Path, boot: str) -> Path:
    store_path = tmp_path / "store"
    ready = tmp_path / "ready"
    pid = fork_call(_write_then_wait, store_path, boot, ready, log_path=tmp_path / "writer.log")
    try:
        assert wait_counter(ready, 1, timeout_s=60) == 1, tail(tmp_path / "writer.log")
    finally:
        kill_and_reap(pid)
    return store_path


def test_group_sync_records_a_durable_snapshot_and_writes_no_marker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BOOT_ID_ENV, "boot-a")
    keys = _keys()
    env_dir = tmp_path / "group" / "lmdb"
    with ucm_db.open(tmp_path / "group", **GROUP) as store:
        store.put(NS, keys[:4], _payloads(keys[:4]))
        store.flush()
        record = read_record(env_dir)
        newest = max(m.txnid for m in read_meta_pages(env_dir / "data.mdb")[0])
        assert record is not None and record.boot == "boot-a" and record.txnid == newest
        store.put(NS, keys[4:8], _payloads(keys[4:8]), parent=keys[3])
        assert read_record(env_dir) == record, "an unsynced commit does not move the record"
    assert read_record(env_dir).txnid > record.txnid, "close syncs and records"  # type: ignore[union-attr]
    assert not (env_dir / MARKER_DIR).exists()


def _parent_pin(store: ucm_db.Store) -> int | None:
    """The snapshot this process's reader slot pins, from LMDB's reader table."""
    env = store._tier.engine._environment()
    for line in env.readers().splitlines()[1:]:
        pid, _thread, txnid = line.split()
        if int(pid) == os.getpid() and txnid != "-":
            return int(txnid)
    return None


def test_forked_child_does_not_unpin_the_parent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BOOT_ID_ENV, "boot-a")
    keys = _keys()
    with ucm_db.open(tmp_path / "s", **GROUP) as store:
        store.put(NS, keys[:4], _payloads(keys[:4]))
        store.flush()  # recorded; the pin goes with it (nothing of ours after it)
        store.put(NS, keys[4:6], _payloads(keys[4:6]), parent=keys[3])  # pinned again before this commit
        pinned = _parent_pin(store)
        assert pinned is not None and pinned == read_record(tmp_path / "s" / "lmdb").txnid  # type: ignore[union-attr]
        pid = os.fork()
        if pid == 0:  # the child reopens the inherited store and writes
            try:
                store.put(NS, keys[6:8], _payloads(keys[6:8]), parent=keys[5])
                store.flush()
                os._exit(0)
            except BaseException:  # noqa: BLE001
                os._exit(1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert _parent_pin(store) == pinned, "the child's reopen released the parent's snapshot pin"


def test_map_growth_re_pins_the_synced_snapshot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BOOT_ID_ENV, "boot-a")
    keys = _keys()
    with ucm_db.open(tmp_path / "s", map_size_bytes=1 << 20, **GROUP) as store:
        store.put(NS, keys[:1], _payloads(keys[:1]))
        store.flush()
        before = store._tier.engine._environment().info()["map_size"]
        for i in range(1, BLOCKS):  # 23 x 48 KiB: the 1 MiB map doubles at least once
            store.put(NS, keys[i:i + 1], _payloads(keys[i:i + 1]), parent=keys[i - 1])
        assert store._tier.engine._environment().info()["map_size"] > before
        record = read_record(tmp_path / "s" / "lmdb")
        assert record is not None and _parent_pin(store) == record.txnid, "a map resize ended the pin and nothing re-pinned"


def test_process_crash_loses_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store_path = _killed_writer(tmp_path, "boot-a")
    monkeypatch.setenv(BOOT_ID_ENV, "boot-a")  # same boot: only the process died
    with ucm_db.open(store_path, **GROUP) as store:
        assert store._tier.engine.rollback is None
        keys = _keys()
        assert store.get(NS, keys) == _payloads(keys)


@pytest.mark.parametrize("torn", [False, True])
def test_os_crash_reopens_the_last_synced_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, torn: bool,
) -> None:
    store_path = _killed_writer(tmp_path, "boot-a")
    env_dir = store_path / "lmdb"
    record = read_record(env_dir)
    assert record is not None
    if torn:  # the unsynced pages never reached the disk: cut the file to the synced snapshot's end
        pages = [m for m in read_meta_pages(env_dir / "data.mdb")[0]]
        synced_end = min((m.last_page + 1) * m.page_bytes for m in pages if m.txnid >= record.txnid)
        os.truncate(env_dir / "data.mdb", synced_end)
        assert not check_file(env_dir / "data.mdb").ok, "the newest meta page now names missing pages"
    monkeypatch.setenv(BOOT_ID_ENV, "boot-b")  # the machine rebooted
    caplog.set_level(logging.WARNING, logger="ucm_db")
    keys = _keys()
    with ucm_db.open(store_path, **GROUP) as store:
        rollback = store._tier.engine.rollback
        assert rollback is not None and rollback.to_txnid == record.txnid < rollback.from_txnid
        assert store.get(NS, keys[:SYNCED]) == _payloads(keys[:SYNCED]), "everything synced survives"
        assert store.get(NS, keys[SYNCED:]) == [None] * (BLOCKS - SYNCED), "commits after the last sync are undone whole"
        assert store.lookup(NS, keys) == SYNCED
        assert store._tier.check() == []
        store.put(NS, keys[SYNCED:], [b"again"] * (BLOCKS - SYNCED), parent=keys[SYNCED - 1])
    assert not (store_path / "damaged").exists(), "nothing is set aside"
    assert any("last synced snapshot" in r.getMessage() for r in caplog.records)
    with ucm_db.open(store_path, **GROUP) as store:
        assert store._tier.engine.rollback is None
        assert store.get(NS, keys[SYNCED:]) == [b"again"] * (BLOCKS - SYNCED)


def test_an_os_crash_after_compact_still_reopens_the_last_synced_snapshot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``compact`` replaces the data file with a copy whose transaction ids
    start again low: the record of the old file must not outrank the new
    file's (it did, and no rollback was made after a compact until the new
    file's ids passed the old record's)."""
    monkeypatch.setenv(BOOT_ID_ENV, "boot-a")
    store_path, filler = tmp_path / "store", NS.block_keys(chain_tokens("filler", 48))
    with ucm_db.open(store_path, **GROUP) as store:
        for i, key in enumerate(filler):  # a synced commit each: the old file's record passes transaction 48
            store.put(NS, [key], [payload_for(key, BLOCK_BYTES)], parent=filler[i - 1] if i else None)
            store.flush()
        store.delete(NS, filler[:1])
    inode = os.stat(store_path / "lmdb" / "data.mdb").st_ino
    maintenance.compact(store_path)
    assert os.stat(store_path / "lmdb" / "data.mdb").st_ino != inode, "compact rewrote the file"
    _killed_writer(tmp_path, "boot-a")
    monkeypatch.setenv(BOOT_ID_ENV, "boot-b")  # the machine rebooted
    keys = _keys()
    with ucm_db.open(store_path, **GROUP) as store:
        rollback = store._tier.engine.rollback
        assert rollback is not None, "the compacted file's last synced snapshot is reopened"
        assert store.get(NS, keys[:SYNCED]) == _payloads(keys[:SYNCED])
        assert store.lookup(NS, keys) == SYNCED
        assert store._tier.check() == []


def test_synced_snapshot_lost_by_a_lying_disk_is_set_aside(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    store_path = _killed_writer(tmp_path, "boot-a")
    data = store_path / "lmdb" / "data.mdb"
    os.truncate(data, 3 * 4096)  # even synced pages are gone: the disk did not honour fsync
    monkeypatch.setenv(BOOT_ID_ENV, "boot-b")
    caplog.set_level(logging.WARNING, logger="ucm_db")
    keys = _keys()
    with ucm_db.open(store_path, **GROUP) as store:
        assert store._tier.engine.rollback is not None
        assert store.stats().blocks == 0, "the last resort: an empty store, not a crash"
        store.put(NS, keys[:2], [b"fresh-0", b"fresh-1"])
        assert store.get(NS, keys[:2]) == [b"fresh-0", b"fresh-1"]
    moved = list((store_path / "damaged").iterdir())
    assert len(moved) == 1 and (moved[0] / "data.mdb").stat().st_size == 3 * 4096
    assert any("does not honour fsync" in r.getMessage() for r in caplog.records)


def _legacy_store(tmp_path: Path) -> Path:
    """A store as an older version left it after an OS crash: a marker of unsynced commits of boot-a."""
    store_path = tmp_path / "store"
    keys = _keys()
    with ucm_db.open(store_path, durability="sync") as store:
        store.put(NS, keys, _payloads(keys))
    marker_dir = store_path / "lmdb" / MARKER_DIR
    marker_dir.mkdir()
    (marker_dir / "boot-a.4242").write_text("1.0\n")
    return store_path


def test_legacy_marker_intact_store_is_checked_and_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store_path = _legacy_store(tmp_path)
    monkeypatch.setenv(BOOT_ID_ENV, "boot-b")
    with ucm_db.open(store_path) as store:
        report = store._tier.engine.recovery
        assert report is not None and not report.damaged and report.foreign_markers == 1
        keys = _keys()
        assert store.get(NS, keys) == _payloads(keys)
    assert os.listdir(store_path / "lmdb" / MARKER_DIR) == []
    assert not (store_path / "damaged").exists()


def test_legacy_marker_damaged_store_is_set_aside_not_crashed_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    store_path = _legacy_store(tmp_path)
    data = store_path / "lmdb" / "data.mdb"
    os.truncate(data, data.stat().st_size // 2)  # pages the power loss never let reach the disk
    monkeypatch.setenv(BOOT_ID_ENV, "boot-b")
    caplog.set_level(logging.WARNING, logger="ucm_db")
    keys = _keys()
    with ucm_db.open(store_path) as store:
        report = store._tier.engine.recovery
        assert report is not None and report.damaged and report.moved_to is not None
        assert (report.moved_to / "data.mdb").exists(), "the damaged file is kept for inspection"
        assert store.stats().blocks == 0
        store.put(NS, keys[:2], [b"fresh-0", b"fresh-1"])
        assert store.get(NS, keys[:2]) == [b"fresh-0", b"fresh-1"]
    assert any("moved it to" in r.getMessage() for r in caplog.records)
    with ucm_db.open(store_path) as store:
        assert store._tier.engine.recovery is None and store.get(NS, keys[:2]) == [b"fresh-0", b"fresh-1"]


def test_maintenance_after_a_crash_then_an_os_crash_serves_what_it_left(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sync writer (here ``maintenance.evict_to_bytes``, which opens the
    engine with sync=True) clears the dead group writer's pin on the
    recorded snapshot. It must record its own commits before it reuses that
    snapshot's pages: otherwise the rollback after the next OS crash lands
    on overwritten pages (the store came back empty)."""
    from ucm_db import maintenance

    store_path = tmp_path / "store"
    ready = tmp_path / "ready"
    monkeypatch.setenv(BOOT_ID_ENV, "boot-a")
    pid = fork_call(_write_then_wait, store_path, "boot-a", ready, True, log_path=tmp_path / "writer.log")
    try:
        assert wait_counter(ready, 1, timeout_s=60) == 1, tail(tmp_path / "writer.log")
    finally:
        kill_and_reap(pid)
    evicted = maintenance.evict_to_bytes(store_path, 8 * BLOCK_BYTES)  # same boot: the process died, not the machine
    assert 0 < evicted < BLOCKS
    monkeypatch.setenv(BOOT_ID_ENV, "boot-b")  # then the machine loses power
    keys = _keys()
    with ucm_db.open(store_path, **GROUP) as store:
        got = store.get(NS, keys)
        kept = [k for k, value in zip(keys, got) if value is not None]
        assert len(kept) == BLOCKS - evicted, "the evictions were synced: they stay done, and nothing else is lost"
        assert [v for v in got if v is not None] == _payloads(kept)
        assert store.lookup(NS, keys) == len(kept) and store.stats().blocks == len(kept)
        assert store._tier.check() == []
