"""The change feed after a rollback to the last synced snapshot: no seq a
reader may hold is handed out again.

A writer child appends evented blocks, syncs, appends more (unsynced),
publishes its feed position and is SIGKILLed; the store then reopens under
another boot id (the machine went down), which rolls the unsynced commits
back. A router that saved the pre-crash position (``ucm-db events --since``,
``Store.changes_since``) would, once the store appended past it again, read
other blocks' records under seqs it had already seen and never learn that
the blocks it was told of are gone. The reader must be told to resync.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

import ucm_db
from ucm_db import BlockEventFields, maintenance
from ucm_db.engines.lmdb.recovery import BOOT_ID_ENV

from .harness import NS, chain_tokens, fork_call, kill_and_reap, tail, wait_counter, write_counter

pytestmark = [pytest.mark.multiprocess, pytest.mark.usefixtures("feed_from_zero")]  # seqs named from 0

GROUP = {"codec": "none", "durability": "group", "sync_interval_s": 3600.0, "sync_bytes": 1 << 40}


def _put_evented(store: ucm_db.Store, label: str, blocks: int) -> None:
    tokens = chain_tokens(label, blocks)
    keys = NS.block_keys(tokens)
    fields, parent = {}, None
    for i, key in enumerate(keys):
        fields[key] = BlockEventFields(b"v" + key[:15], parent, tuple(tokens[4 * i:4 * i + 4]), 4, None, None, 0)
        parent = fields[key].block_hash
    store.put(NS, keys, [b"kv" * 512] * blocks, event_fields=fields)


def _append_then_wait(store_path: Path, ready: Path) -> None:
    os.environ[BOOT_ID_ENV] = "boot-a"
    store = ucm_db.open(store_path, **GROUP)
    _put_evented(store, "synced", 8)
    store.flush()
    _put_evented(store, "undone", 8)  # records 8..15: handed out, then rolled back
    write_counter(ready, store.feed_position())
    while True:
        signal.pause()


@pytest.mark.parametrize("first_open", ["writable", "read_only_view"])
def test_a_reader_holding_a_rolled_back_seq_is_told_to_resync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, first_open: str,
) -> None:
    store_path, ready = tmp_path / "s", tmp_path / "ready"
    pid = fork_call(_append_then_wait, store_path, ready, log_path=tmp_path / "child.log")
    try:
        held = wait_counter(ready, 1, timeout_s=60)  # a router's saved cursor: past every record it read
        assert held == 16, tail(tmp_path / "child.log")
    finally:
        kill_and_reap(pid)
    monkeypatch.setenv(BOOT_ID_ENV, "boot-b")  # the machine went down
    if first_open == "read_only_view":  # the rollback made by a reader (`ucm-db events`, inspect)
        assert [row["blocks"] for row in maintenance.namespaces(store_path)] == [8]
    with ucm_db.open(store_path, **GROUP) as store:
        assert store.lookup(NS, NS.block_keys(chain_tokens("undone", 8))) == 0, "the unsynced puts were rolled back"
        restarted = store.feed_position()
        assert restarted > held
        _put_evented(store, "after", 24)  # appends past the held cursor, as a restarted engine does
        batch = store.changes_since(held)
        assert batch.resync and batch.records == (), "records after the rollback read under seqs the reader had seen"
        follow = store.changes_since(restarted)
        assert len(follow.records) == 24 and not follow.resync
    assert not (store_path / "lmdb" / "rolled-back").exists()
    with ucm_db.open(store_path, **GROUP) as store:  # restarted once, not at every open
        assert store.feed_position() == restarted + 24


def test_two_processes_opening_after_one_rollback_restart_the_feed_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every writable open reads the marker until one clears it: a second process that read it while the
    first restarted and appended restarted again, dropping the first's new records. A rollback's token
    makes its restart happen once."""
    store_path, ready = tmp_path / "s", tmp_path / "ready"
    pid = fork_call(_append_then_wait, store_path, ready, log_path=tmp_path / "child.log")
    try:
        assert wait_counter(ready, 1, timeout_s=60) == 16, tail(tmp_path / "child.log")
    finally:
        kill_and_reap(pid)
    monkeypatch.setenv(BOOT_ID_ENV, "boot-b")
    marker = store_path / "lmdb" / "rolled-back"
    maintenance.namespaces(store_path)  # a read-only view rolls back and leaves the marker
    token = marker.read_bytes()
    with ucm_db.open(store_path, **GROUP) as store:  # the first process: restarts, appends, clears
        restarted = store.feed_position()
        _put_evented(store, "after", 4)
    assert not marker.exists()
    marker.write_bytes(token)  # the second process read the marker before the first cleared it
    with ucm_db.open(store_path, **GROUP) as store:
        assert store.feed_position() == restarted + 4, "the same rollback restarted the feed twice"
        assert len(store.changes_since(restarted).records) == 4
    assert not marker.exists()
