"""A torn slot of the sync record: the rollback after a reboot uses the other.

docs/storage.md: the sync record ``lmdb/synced-snapshot`` has two
CRC-checked slots, written alternately (``ucm_db.engines.lmdb.groupsync``),
so a power loss that tears the write of the newest leaves the one before it.
The power-cut file system drops unsynced writes but never tears a slot
(audit U2), so the tear is made here by hand, on a real store: a writer child
under ``UCM_DB_BOOT_ID=boot-a`` puts and flushes twice (two records) and is
SIGKILLed; part of the newest slot is zeroed, as a write that never reached
the disk whole; the reopen under ``boot-b`` (a reboot) must roll back to the
first flush's snapshot. No commit followed the second flush, so no page of
the first snapshot was reused.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

import ucm_db
from ucm_db.engines.lmdb import groupsync
from ucm_db.engines.lmdb.groupsync import RECORD_FILE, read_record
from ucm_db.engines.lmdb.meta import read_meta_pages
from ucm_db.engines.lmdb.recovery import BOOT_ID_ENV

from .harness import NS, chain_tokens, fork_call, kill_and_reap, payload_for, read_counter, tail, wait_counter, write_counter

pytestmark = [pytest.mark.multiprocess]

GROUP = {"durability": "group", "sync_interval_s": 3600.0, "sync_bytes": 1 << 40}
BLOCKS, FIRST = 8, 4  # blocks in all, and put before the first flush
BLOCK_BYTES = 16 << 10


def _keys() -> list[bytes]:
    return NS.block_keys(chain_tokens("torn-record", BLOCKS))


def _payloads(keys: list[bytes]) -> list[bytes]:
    return [payload_for(k, BLOCK_BYTES) for k in keys]


def _two_flushes_then_wait(store_path: Path, first_txnid: Path, ready: Path) -> None:
    """Child: puts and flushes twice, publishes the first flush's snapshot, waits for SIGKILL."""
    os.environ[BOOT_ID_ENV] = "boot-a"
    store = ucm_db.open(store_path, **GROUP)
    keys = _keys()
    store.put(NS, keys[:FIRST], _payloads(keys[:FIRST]))
    store.flush()  # records its snapshot, the newest commit (read from the data file: read_record is under test)
    write_counter(first_txnid, max(m.txnid for m in read_meta_pages(store_path / "lmdb" / "data.mdb")[0]))
    store.put(NS, keys[FIRST:], _payloads(keys[FIRST:]), parent=keys[FIRST - 1])
    store.flush()
    write_counter(ready, 1)
    while True:
        signal.pause()


def _tear_newest_slot(env_dir: Path) -> tuple[int, int]:
    """Zeroes bytes 64-320 of the newest slot; returns (its txnid, the other slot's)."""
    fd = os.open(env_dir / RECORD_FILE, os.O_RDWR)
    try:
        slots = groupsync._read_slots(fd)
        assert slots[0] is not None and slots[1] is not None, "both slots hold a record"
        newest = 0 if slots[0].txnid > slots[1].txnid else 1
        os.pwrite(fd, bytes(256), newest * groupsync._SLOT_BYTES + 64)
        assert groupsync._read_slots(fd)[newest] is None, "the torn slot fails its CRC"
        return slots[newest].txnid, slots[1 - newest].txnid  # type: ignore[union-attr]
    finally:
        os.close(fd)


def test_a_torn_newest_slot_rolls_back_to_the_other_slot_after_a_reboot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store_path, first_txnid, ready = tmp_path / "store", tmp_path / "first", tmp_path / "ready"
    pid = fork_call(_two_flushes_then_wait, store_path, first_txnid, ready, log_path=tmp_path / "writer.log")
    try:
        assert wait_counter(ready, 1, timeout_s=60) == 1, tail(tmp_path / "writer.log")
    finally:
        kill_and_reap(pid)
    env_dir = store_path / "lmdb"
    torn, other = _tear_newest_slot(env_dir)
    assert other == read_counter(first_txnid) < torn, "the other slot holds the first flush's record"
    record = read_record(env_dir)
    assert record is not None and record.txnid == other
    monkeypatch.setenv(BOOT_ID_ENV, "boot-b")  # the machine rebooted
    keys = _keys()
    with ucm_db.open(store_path, **GROUP) as store:
        rollback = store._tier.engine.rollback  # type: ignore[attr-defined]
        assert rollback is not None and rollback.to_txnid == other < rollback.from_txnid
        assert store.get(NS, keys[:FIRST]) == _payloads(keys[:FIRST]), "the first flush's snapshot, whole"
        assert store.lookup(NS, keys) == FIRST, "the second flush's record was lost with its slot"
        assert store._tier.check() == []
    assert not (store_path / "damaged").exists(), "nothing is set aside"
