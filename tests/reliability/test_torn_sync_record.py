"""The sync record file of earlier versions, after an upgrade: rolled back to, torn slot and all.

Earlier versions kept one record file for all processes, ``lmdb/synced-snapshot``,
with two CRC-checked slots written alternately; this version keeps one such
file per process (``ucm_db.engines.lmdb.records``) and reads the old one as
one more. A store upgraded in place after an OS crash must still roll back
to the old file's record, and to its older slot where the newest was torn.

The old file is made here from a real store: a writer child under
``UCM_DB_BOOT_ID=boot-a`` puts and flushes twice (two records), publishes
both, and is SIGKILLed; its own record file is replaced by an old-style
file holding the two records (the newest one zeroed in part, as a write that
never reached the disk whole, for the torn case). The reopen under
``boot-b`` (a reboot) must roll back to the right record. No commit followed
the second flush where the first is the target, so no page of the first
snapshot was reused (a torn slot is the disk's fault, and only the record
before the newest is kept safe from reuse).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

import ucm_db
from ucm_db.engines.lmdb import records
from ucm_db.engines.lmdb.groupsync import RECORD_FILE, read_record
from ucm_db.engines.lmdb.recovery import BOOT_ID_ENV

from .harness import NS, chain_tokens, fork_call, kill_and_reap, payload_for, tail, wait_counter, write_counter

pytestmark = [pytest.mark.multiprocess]

GROUP = {"durability": "group", "sync_interval_s": 3600.0, "sync_bytes": 1 << 40}
BLOCKS, FIRST, SECOND = 12, 4, 8  # blocks in all, put before the first flush, before the second
BLOCK_BYTES = 16 << 10


def _keys() -> list[bytes]:
    return NS.block_keys(chain_tokens("torn-record", BLOCKS))


def _payloads(keys: list[bytes]) -> list[bytes]:
    return [payload_for(k, BLOCK_BYTES) for k in keys]


def _two_flushes_then_wait(store_path: Path, published: Path, ready: Path, unsynced: bool) -> None:
    """Child: puts and flushes twice, publishing each record; with
    ``unsynced`` puts the rest unflushed; waits for SIGKILL."""
    os.environ[BOOT_ID_ENV] = "boot-a"
    env_dir = store_path / "lmdb"
    store = ucm_db.open(store_path, **GROUP)
    keys = _keys()
    store.put(NS, keys[:FIRST], _payloads(keys[:FIRST]))
    store.flush()
    first = read_record(env_dir)
    store.put(NS, keys[FIRST:SECOND], _payloads(keys[FIRST:SECOND]), parent=keys[FIRST - 1])
    store.flush()
    assert first is not None and (second := read_record(env_dir)) is not None
    published.write_bytes(records.encode(first) + records.encode(second))
    if unsynced:
        store.put(NS, keys[SECOND:], _payloads(keys[SECOND:]), parent=keys[SECOND - 1])
    write_counter(ready, 1)
    while True:
        signal.pause()


def _old_style_store(tmp_path: Path, *, unsynced: bool, torn: bool) -> tuple[Path, int, int]:
    """The store as an earlier version leaves it: only ``synced-snapshot``,
    its two slots the child's two records. Returns (path, first, second txnid)."""
    store_path, published, ready = tmp_path / "store", tmp_path / "published", tmp_path / "ready"
    pid = fork_call(_two_flushes_then_wait, store_path, published, ready, unsynced, log_path=tmp_path / "writer.log")
    try:
        assert wait_counter(ready, 1, timeout_s=60) == 1, tail(tmp_path / "writer.log")
    finally:
        kill_and_reap(pid)
    env_dir = store_path / "lmdb"
    for name in os.listdir(env_dir):
        if name.startswith(RECORD_FILE + "."):
            os.unlink(env_dir / name)
    slots = bytearray(published.read_bytes())
    first, second = records.decode(bytes(slots[:records.SLOT_BYTES])), records.decode(bytes(slots[records.SLOT_BYTES:]))
    assert first is not None and second is not None and first.txnid < second.txnid
    if torn:  # bytes 64-320 of the newest slot never reached the disk
        slots[records.SLOT_BYTES + 64:records.SLOT_BYTES + 320] = bytes(256)
    (env_dir / RECORD_FILE).write_bytes(bytes(slots))
    return store_path, first.txnid, second.txnid


def test_an_upgraded_store_rolls_back_to_the_old_record_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store_path, _, second = _old_style_store(tmp_path, unsynced=True, torn=False)
    env_dir = store_path / "lmdb"
    assert read_record(env_dir).txnid == second  # type: ignore[union-attr]
    monkeypatch.setenv(BOOT_ID_ENV, "boot-b")  # the machine rebooted
    keys = _keys()
    with ucm_db.open(store_path, **GROUP) as store:
        rollback = store._tier.engine.rollback  # type: ignore[attr-defined]
        assert rollback is not None and rollback.to_txnid == second < rollback.from_txnid
        assert store.get(NS, keys[:SECOND]) == _payloads(keys[:SECOND]), "the second flush's snapshot, whole"
        assert store.lookup(NS, keys) == SECOND, "the unsynced put is rolled back"
        assert store._tier.check() == []
        store.put(NS, keys[SECOND:], _payloads(keys[SECOND:]), parent=keys[SECOND - 1])
        store.flush()
        assert not (env_dir / RECORD_FILE).exists(), "the old file goes once a newer record is durable"
    assert not (store_path / "damaged").exists(), "nothing is set aside"


def test_a_torn_newest_slot_rolls_back_to_the_other_slot_after_a_reboot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store_path, first, second = _old_style_store(tmp_path, unsynced=False, torn=True)
    record = read_record(store_path / "lmdb")
    assert record is not None and record.txnid == first, "the torn slot fails its CRC"
    monkeypatch.setenv(BOOT_ID_ENV, "boot-b")  # the machine rebooted
    keys = _keys()
    with ucm_db.open(store_path, **GROUP) as store:
        rollback = store._tier.engine.rollback  # type: ignore[attr-defined]
        assert rollback is not None and rollback.to_txnid == first < second <= rollback.from_txnid
        assert store.get(NS, keys[:FIRST]) == _payloads(keys[:FIRST]), "the first flush's snapshot, whole"
        assert store.lookup(NS, keys) == FIRST, "the second flush's record was lost with its slot"
        assert store._tier.check() == []
    assert not (store_path / "damaged").exists(), "nothing is set aside"
