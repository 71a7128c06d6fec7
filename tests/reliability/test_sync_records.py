"""An explicit sync of a group store is recorded, or it is not acknowledged.

After an OS crash a group store reopens the snapshot its sync record names
(``ucm_db.engines.lmdb.groupsync``). A sync that made the file durable but
left the record where it was is therefore undone by that rollback: an epoch
bump so undone serves the blocks it invalidated again. The background's
rounds may leave a record to a later round; a flush, an epoch bump, a pin
and a close must record their snapshot or raise.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import ucm_db
from ucm_db.engines.lmdb import groupsync
from ucm_db.engines.lmdb.groupsync import RECORD_FILE, read_record
from ucm_db.engines.lmdb.meta import read_meta_pages
from ucm_db.engines.lmdb.recovery import BOOT_ID_ENV

from .harness import NS, chain_tokens, fork_call, kill_and_reap, payload_for, tail, wait_counter, write_counter

pytestmark = [pytest.mark.multiprocess]

GROUP = {"codec": "none", "durability": "group", "sync_interval_s": 3600.0, "sync_bytes": 1 << 40}
BLOCK_BYTES = 16 << 10


def _newest_txnid(env_dir: Path) -> int:
    return max(m.txnid for m in read_meta_pages(env_dir / "data.mdb")[0])


def _put(store: ucm_db.Store, label: str, blocks: int = 4) -> None:
    keys = NS.block_keys(chain_tokens(label, blocks))
    store.put(NS, keys, [payload_for(k, BLOCK_BYTES) for k in keys])


def test_an_explicit_sync_records_its_snapshot_where_commits_race_every_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two commits landing between a snapshot's start and the copy of its
    meta page, at every try, is a race this test cannot schedule: setting
    the tries to 0 stands for it (every try lost). The background's round
    then records nothing; a flush and an epoch bump fence the copy with
    LMDB's writer lock and record (before: neither did)."""
    monkeypatch.setenv(BOOT_ID_ENV, "boot-a")
    monkeypatch.setattr(groupsync, "_META_COPY_TRIES", 0)
    env_dir = tmp_path / "s" / "lmdb"
    with ucm_db.open(tmp_path / "s", **GROUP) as store:
        _put(store, "raced-a")
        engine = store._tier.engine
        engine.sync_round()
        assert read_record(env_dir) is None, "the background's round needs its raced copy"
        store.flush()
        record = read_record(env_dir)
        assert record is not None and record.txnid == _newest_txnid(env_dir)
        epoch = store.epoch(NS)
        assert store.bump_epoch(NS) > epoch
        bumped = read_record(env_dir)
        assert bumped is not None and bumped.txnid == _newest_txnid(env_dir) > record.txnid, \
            "an OS crash would roll the epoch bump back"


#: A process that takes the sync record's lock, says so, and stops (as one stopped while it wrote the record).
HOLDER = """
import fcntl, signal, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
fcntl.flock(fd, fcntl.LOCK_EX)
open(sys.argv[2], "w").write("1")
while True:
    signal.pause()
"""


def test_an_epoch_bump_whose_record_another_process_holds_is_not_acknowledged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(BOOT_ID_ENV, "boot-a")
    monkeypatch.setattr(groupsync, "RECORD_LOCK_WAIT_S", 0.3)
    env_dir, ready = tmp_path / "s" / "lmdb", tmp_path / "ready"
    with ucm_db.open(tmp_path / "s", **GROUP) as store:
        _put(store, "held-a")
        store.flush()
        recorded = read_record(env_dir)
        assert recorded is not None
        with open(tmp_path / "holder.log", "wb") as log:
            holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(env_dir / RECORD_FILE), str(ready)],
                                      stdout=log, stderr=log)
        try:
            assert wait_counter(ready, 1, timeout_s=60) == 1, tail(tmp_path / "holder.log")
            epoch = store.epoch(NS)
            with pytest.raises(ucm_db.TierError, match="sync record's lock") as raised:
                store.bump_epoch(NS)
            assert raised.value.hint and "synced-snapshot" in raised.value.hint
            assert read_record(env_dir) == recorded
            store._tier.engine.sync_round()  # the background's round skips without raising
        finally:
            kill_and_reap(holder.pid)
            holder.wait()
        store.flush()
        after = read_record(env_dir)
        assert after is not None and after.txnid == _newest_txnid(env_dir) > recorded.txnid
        assert store.epoch(NS) > epoch, "the bump itself committed: only its acknowledgement was withheld"


def _bump_then_wait(store_path: Path, ready: Path) -> None:
    """Child: puts and flushes (recorded), bumps the epoch with every raced
    copy of its meta page lost, puts again unsynced, publishes the new
    epoch and waits for SIGKILL."""
    os.environ[BOOT_ID_ENV] = "boot-a"
    store = ucm_db.open(store_path, **GROUP)
    _put(store, "reboot-a")
    store.flush()
    groupsync._META_COPY_TRIES = 0  # as above: a race this test cannot schedule, every try lost
    bumped = store.bump_epoch(NS)
    _put(store, "reboot-b")
    write_counter(ready, bumped)
    while True:
        signal.pause()


def test_an_acknowledged_epoch_bump_survives_the_rollback_after_a_reboot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The end to end: a bump acknowledged, then the machine goes down with
    a later put unsynced. The reopened store rolls that put back and keeps
    the bump (before: it rolled back to the flush, and the invalidated
    epoch was served again)."""
    store_path, ready = tmp_path / "s", tmp_path / "ready"
    pid = fork_call(_bump_then_wait, store_path, ready, log_path=tmp_path / "child.log")
    try:
        bumped = wait_counter(ready, 1, timeout_s=60)
        assert bumped >= 1, tail(tmp_path / "child.log")
    finally:
        kill_and_reap(pid)
    monkeypatch.setenv(BOOT_ID_ENV, "boot-b")  # the machine rebooted
    with ucm_db.open(store_path, **GROUP) as store:
        rollback = store._tier.engine.rollback  # type: ignore[attr-defined]
        assert rollback is not None, "the unsynced put after the bump is rolled back"
        assert store.epoch(NS) == bumped
        assert store.lookup(NS, NS.block_keys(chain_tokens("reboot-b", 4))) == 0
