"""An explicit sync of a group store is recorded, or it is not acknowledged.

After an OS crash a group store reopens the snapshot its sync record names
(``ucm_db.engines.lmdb.groupsync``). A sync that made the file durable but
left the record where it was is therefore undone by that rollback: an epoch
bump so undone serves the blocks it invalidated again. The background's
rounds may leave a record to a later round; a flush, an epoch bump, a pin
and a close must record their snapshot or raise; so must the first
commit after a process let its pin go, where the pin it takes needs a
new record.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import ucm_db
from ucm_db.engines.lmdb import groupsync, records
from ucm_db.engines.lmdb.groupsync import read_record
from ucm_db.engines.lmdb.meta import read_meta_pages
from ucm_db.engines.lmdb.recovery import BOOT_ID_ENV

from .harness import (
    NS, chain_tokens, fork_call, kill_and_reap, payload_for, put_once_taken_again, put_until_refused, tail, wait_counter,
    write_counter,
)

pytestmark = [pytest.mark.multiprocess]

GROUP = {"codec": "none", "durability": "group", "sync_interval_s": 3600.0, "sync_bytes": 1 << 40}
BLOCK_BYTES = 16 << 10


def _newest_txnid(env_dir: Path) -> int:
    return max(m.txnid for m in read_meta_pages(env_dir / "data.mdb")[0])


def _put(store: ucm_db.Store, label: str, blocks: int = 4) -> None:
    keys = NS.block_keys(chain_tokens(label, blocks))
    store.put(NS, keys, [payload_for(k, BLOCK_BYTES) for k in keys])


def test_a_sync_whose_copies_all_lose_the_race_copies_again_under_the_writer_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two commits landing between a snapshot's start and the copy of its
    meta page, at every try, is a race this test cannot schedule: setting
    the tries to 0 stands for it (every try lost). A round and a flush then
    copy under LMDB's writer lock and record (before: neither recorded).
    The copy is wrapped to start a put in another thread and give it 0.3 s:
    under the fence it cannot commit until the copy is done."""
    monkeypatch.setenv(BOOT_ID_ENV, "boot-a")
    monkeypatch.setattr(groupsync, "_META_COPY_TRIES", 0)
    env_dir = tmp_path / "s" / "lmdb"
    with ucm_db.open(tmp_path / "s", **GROUP) as store:
        _put(store, "raced-a")
        copy_meta = groupsync.SnapshotPin._meta_of
        during_copy: list[int] = []
        racers: list[threading.Thread] = []

        def copy_with_a_racing_put(pin: groupsync.SnapshotPin, txnid: int) -> bytes | None:
            if not racers:
                racers.append(threading.Thread(target=_put, args=(store, f"racer-{txnid}")))
                racers[0].start()
                racers[0].join(0.3)
                during_copy.append(_newest_txnid(env_dir))
            return copy_meta(pin, txnid)

        monkeypatch.setattr(groupsync.SnapshotPin, "_meta_of", copy_with_a_racing_put)
        before = _newest_txnid(env_dir)
        assert store._tier.engine.sync_round() is True
        racers[0].join()
        assert during_copy == [before], "a commit landed while the meta page was copied"
        record = read_record(env_dir)
        assert record is not None and record.txnid == before < _newest_txnid(env_dir)
        store.flush()
        flushed = read_record(env_dir)
        assert flushed is not None and flushed.txnid == _newest_txnid(env_dir) > record.txnid
        epoch = store.epoch(NS)
        assert store.bump_epoch(NS) > epoch
        bumped = read_record(env_dir)
        assert bumped is not None and bumped.txnid == _newest_txnid(env_dir) > flushed.txnid, \
            "an OS crash would roll the epoch bump back"


@contextlib.contextmanager
def _records_failing(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every sync record write fails with ENOSPC for the body. A mock: no
    real disk fails the record alone (records are written in place, after
    the data file's own sync, which a failing disk fails first; the shared
    lock that a stopped process could hold is gone, test_record_lock.py)."""
    def full_disk(env_dir: Path, record: records.SyncRecord) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(records, "write_own", full_disk)
        yield


def test_an_epoch_bump_whose_record_cannot_be_written_is_not_acknowledged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(BOOT_ID_ENV, "boot-a")
    env_dir = tmp_path / "s" / "lmdb"
    with ucm_db.open(tmp_path / "s", **GROUP) as store:
        _put(store, "held-a")
        store.flush()
        recorded = read_record(env_dir)
        assert recorded is not None
        with _records_failing(monkeypatch):
            epoch = store.epoch(NS)
            with pytest.raises(ucm_db.TierError, match="could not be recorded") as raised:
                store.bump_epoch(NS)
            assert raised.value.hint and "synced-snapshot" in raised.value.hint
            assert read_record(env_dir) == recorded
            with pytest.raises(ucm_db.TierError, match="could not be recorded"):
                store._tier.engine.sync_round()  # a round fails too (the background logs and retries it)
        store.flush()
        after = read_record(env_dir)
        assert after is not None and after.txnid == _newest_txnid(env_dir) > recorded.txnid
        assert store.epoch(NS) > epoch, "the bump itself committed: only its acknowledgement was withheld"


#: The explicit syncs besides the epoch bump (storage.md): each must raise while the record's lock is held.
EXPLICIT_SYNCS = {
    "flush": lambda store, keys: store.flush(),
    "pin": lambda store, keys: store.pin(NS, keys),
    "close": lambda store, keys: store.close(),
}


@pytest.mark.parametrize("call", sorted(EXPLICIT_SYNCS))
def test_a_flush_pin_or_close_whose_record_cannot_be_written_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, call: str,
) -> None:
    """Audit U3: only the epoch bump was checked. A flush, a pin or a close that
    returned here would have a caller take commits a power loss undoes for durable."""
    monkeypatch.setenv(BOOT_ID_ENV, "boot-a")
    env_dir = tmp_path / "s" / "lmdb"
    store = ucm_db.open(tmp_path / "s", **GROUP)
    try:
        _put(store, "held-a")
        store.flush()
        recorded = read_record(env_dir)
        assert recorded is not None
        _put(store, "held-b")  # a commit the record does not name yet
        with _records_failing(monkeypatch):
            with pytest.raises(ucm_db.TierError, match="could not be recorded") as raised:
                EXPLICIT_SYNCS[call](store, NS.block_keys(chain_tokens("held-b", 4)))
            assert raised.value.hint and "synced-snapshot" in raised.value.hint
            assert read_record(env_dir) == recorded
    finally:
        store.close()  # a close that raised has released the store already: this one does nothing
    with ucm_db.open(tmp_path / "s", **GROUP) as again:  # same boot: a process crash, nothing rolled back
        assert again.lookup(NS, NS.block_keys(chain_tokens("held-b", 4))) == 4


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


def test_puts_are_refused_while_no_sync_can_be_recorded_and_resume_once_one_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A round that synced but could not record its snapshot is a failed
    sync: a power loss rolls back to the record. So once two sync budgets
    are committed past the record, puts are refused (before: 80 puts, ten
    budgets, were acknowledged, and a reboot lost every one)."""
    monkeypatch.setenv(BOOT_ID_ENV, "boot-a")
    budget_bytes, block_bytes = 1 << 20, 128 << 10
    options = {**GROUP, "sync_bytes": budget_bytes, "sync_interval_s": 0.05}
    env_dir = tmp_path / "s" / "lmdb"
    keys = NS.block_keys(chain_tokens("unrecorded", 64))
    with ucm_db.open(tmp_path / "s", **options) as store:
        store.put(NS, keys[:1], [payload_for(keys[0], block_bytes)])
        store.flush()
        with _records_failing(monkeypatch):
            acknowledged, refused = put_until_refused(store, keys, block_bytes)
            assert "could not be recorded" in str(refused) and "puts are refused" in str(refused), refused
            assert 2 * budget_bytes <= (acknowledged - 1) * block_bytes <= 4 * budget_bytes, acknowledged
        put_once_taken_again(store, keys, acknowledged, block_bytes, "records could be written")  # the next round records
