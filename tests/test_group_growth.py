"""Group durability keeps an LMDB store's file near its live pages under
index-heavy commits (ucm_db/store/background.py, "Why growth counts").

The synced-snapshot pin keeps pages freed after it from being reused until
the next sync; counted by payload bytes alone, a burst of small-payload puts
grew the file to about twice what the same puts take with ``durability="sync"``
(and 4.5x at 200k blocks), and the single free pages left behind slowed later
puts of large blocks 16x. Real LMDB files, real background syncs.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import ucm_db
from ucm_db import Namespace
from ucm_db.store.background import Background

NS = Namespace(model="group-growth", kv_dtype="bfloat16", block_size=4)
BURSTS, BLOCKS_PER_BURST = 60, 1024


def _burst_file_bytes(path: Path, durability: str) -> int:
    with ucm_db.open(path, codec="none", durability=durability, sync_bytes=1 << 20) as store:
        for burst in range(BURSTS):
            tokens = list(range(burst * 10_000_000, burst * 10_000_000 + BLOCKS_PER_BURST * 4))
            store.put(NS, NS.block_keys(tokens), [b"x" * 128] * BLOCKS_PER_BURST, parent=None)
    return os.path.getsize(path / "lmdb" / "data.mdb")


def test_small_payload_bursts_do_not_bloat_a_group_durable_file(tmp_path: Path) -> None:
    synced = _burst_file_bytes(tmp_path / "sync", "sync")
    grouped = _burst_file_bytes(tmp_path / "group", "group")
    # Before growth counted: 161 MB against 82 MB here; with it about 95 MB.
    assert grouped <= 1.4 * synced, (grouped, synced)


def test_a_writer_waiting_for_a_sync_is_released_when_the_store_closes(tmp_path: Path) -> None:
    """The wait never outlives the maintenance thread: ``stop`` (close)
    wakes a writer blocked on excess growth."""
    import threading

    store = ucm_db.open(tmp_path / "s", durability="group", sync_bytes=1 << 20)
    background: Background = store._activity  # the store's own maintenance thread
    done = threading.Event()
    stop_syncs = threading.Event()
    engine = background._engine
    real_sync = engine.sync_round

    def stalled_sync() -> None:  # a fault: a disk whose fsync does not return until closed
        stop_syncs.wait(10)
        real_sync()

    engine.sync_round = stalled_sync  # type: ignore[method-assign]
    extent = engine.used_extent_bytes()
    assert extent is not None
    background._extent_at_sync = extent - (8 << 20)  # 8 MiB of excess growth since the last sync

    def writer() -> None:
        background.committed(0)
        done.set()

    thread = threading.Thread(target=writer)
    started = time.monotonic()
    thread.start()
    assert not done.wait(0.5), "a writer over the growth bound must wait for a sync"
    background._stop.set()
    with background._lock:
        background._synced.notify_all()
    assert done.wait(5) and time.monotonic() - started < 5
    stop_syncs.set()
    thread.join()
    store.close()


def test_a_sync_store_reopened_without_options_reuses_its_freed_pages(tmp_path: Path) -> None:
    """Issue 46: a ``sync`` store reopened without options (as the CLI and a
    connector config without ``durability`` reopen it) ran MDB_NOSYNC with a
    snapshot pin taken at open that never moved, so LMDB reused no freed
    page: a 4 MiB store grew to 5 GiB. Churn 40x its capacity through it."""
    path = tmp_path / "s"
    capacity = 4 << 20
    ucm_db.open(path, codec="none", durability="sync", capacity_bytes=capacity).close()
    with ucm_db.open(path) as store:
        assert store.config.durability == "sync"
        for round_ in range(160):
            tokens = list(range(round_ * 1_000_000, round_ * 1_000_000 + 16 * 4))
            store.put(NS, NS.block_keys(tokens), [os.urandom(64 << 10)] * 16, parent=None)
        assert store.stats().stored_bytes <= capacity
    file_bytes = os.path.getsize(path / "lmdb" / "data.mdb")
    # Before the fix: every round's pages stayed pinned (> 160 MiB here).
    assert file_bytes <= 3 * capacity + (4 << 20), file_bytes


def test_a_small_group_store_under_steady_churn_stays_near_its_capacity(tmp_path: Path) -> None:
    """Issue 46 finding 6: under steady churn a 4 MiB group store's data file
    plateaued at 188-248 MiB, synced only every ``sync_bytes`` (32 MiB) while
    the pin kept each period's freed pages from reuse. The sync budget is
    now at most half the capacity, and writers that outrun the syncs wait
    for one: the file stays within 2x the capacity plus ``sync_bytes``."""
    capacity = 4 << 20
    for block_bytes in (64 << 10, 256 << 10):
        path = tmp_path / f"s{block_bytes}"
        with ucm_db.open(path, codec="none", durability="group", capacity_bytes=capacity) as store:
            for round_ in range(40 * capacity // (4 * block_bytes)):  # 40x the capacity written
                tokens = list(range(round_ * 1000, round_ * 1000 + 16))
                store.put(NS, NS.block_keys(tokens), [os.urandom(block_bytes)] * 4, parent=None)
            sync_bytes = store.config.sync_bytes
        file_bytes = os.path.getsize(path / "lmdb" / "data.mdb")
        assert file_bytes <= 2 * capacity + sync_bytes, (block_bytes, file_bytes)


def test_a_flush_counts_as_the_sync_it_is(tmp_path: Path) -> None:
    """A flush's sync did not reset the background's unsynced count: the next small put started a
    whole redundant sync (and a writer could wait for it)."""
    ns = NS
    keys = ns.block_keys(list(range(4 * 12)))
    with ucm_db.open(tmp_path / "s", durability="group", codec="none", sync_bytes=1 << 20, sync_interval_s=3600.0) as store:
        background: Background = store._activity
        store.put(ns, keys[:6], [b"a" * (100 << 10)] * 6)
        assert background.unsynced_bytes >= 600 << 10
        syncs = background._syncs_done
        store.flush()
        assert background.unsynced_bytes == 0 and background._syncs_done == syncs + 1
        store.put(ns, keys[6:], [b"b" * (100 << 10)] * 6, parent=keys[5])
        assert background.unsynced_bytes < 1 << 20, "the bytes the flush synced were counted again"
