"""A process that died holding the store open (SIGKILL) leaves its LMDB
reader slot, whose snapshot LMDB keeps every page of: until something
clears it, no page freed since can be reused and the data file grows with
every write. An open clears dead readers; a long-running writer that never
reopens must clear them too (its group syncs do, once its own snapshot is
recorded), or a store churned 40x its capacity grows past it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import ucm_db

from .harness import NS, kill_and_reap, tail, wait_counter

pytestmark = [pytest.mark.multiprocess]

CAPACITY_BYTES = 4 << 20
BLOCK_BYTES = 64 << 10
OPTIONS = {"codec": "none", "durability": "group", "capacity_bytes": CAPACITY_BYTES, "sync_interval_s": 0.1}


#: The reader (a new interpreter: this process has the store open, and its threads' locks must not be forked).
READER = """
import os, signal, sys
import ucm_db
from ucm_db.keys import Namespace
ns = Namespace(model="reliability-suite", kv_dtype="bfloat16", block_size=4)
store = ucm_db.open(sys.argv[1], durability="group", codec="none", capacity_bytes=4 << 20, sync_interval_s=0.1)
store.put(ns, ns.block_keys(list(range(999_000, 999_016))), [os.urandom(64 << 10)] * 4)
store.flush()
open(sys.argv[2] + ".new", "w").write("1"); os.replace(sys.argv[2] + ".new", sys.argv[2])
while True:
    signal.pause()
"""


def test_a_writer_clears_the_slot_of_a_reader_that_died_and_its_file_stays_near_capacity(tmp_path: Path) -> None:
    store_path, ready = tmp_path / "store", tmp_path / "ready"
    with ucm_db.open(store_path, **OPTIONS) as store:  # open before the reader: its open cannot clear the slot
        with open(tmp_path / "reader.log", "wb") as log:
            reader = subprocess.Popen([sys.executable, "-c", READER, str(store_path), str(ready)], stdout=log, stderr=log)
        try:
            assert wait_counter(ready, 1, timeout_s=60) == 1, tail(tmp_path / "reader.log")
        finally:
            kill_and_reap(reader.pid)
            reader.wait()
        for round_ in range(40 * CAPACITY_BYTES // (4 * BLOCK_BYTES)):  # 40x the capacity written
            tokens = list(range(round_ * 1000, round_ * 1000 + 16))
            store.put(NS, NS.block_keys(tokens), [os.urandom(BLOCK_BYTES)] * 4, parent=None)
        sync_bytes = store.config.sync_bytes
    file_bytes = os.path.getsize(store_path / "lmdb" / "data.mdb")
    assert file_bytes <= 2 * CAPACITY_BYTES + sync_bytes, file_bytes


def test_a_process_stopped_holding_the_sync_record_does_not_wedge_the_writers(tmp_path: Path) -> None:
    """A process stopped (SIGSTOP, Ctrl-Z) while it held the shared sync
    record's ``flock`` made the others' syncs skip their record (after 2 s)
    and a flush raise. No lock is shared any more (each process records into
    its own file, ``ucm_db.engines.lmdb.records``): the lock held here, as
    such a process would, holds up no put, flush or record.
    (test_record_lock.py stops real processes at random instants.)"""
    import fcntl

    from ucm_db.engines.lmdb.groupsync import RECORD_FILE, read_record

    store_path = tmp_path / "store"
    with ucm_db.open(store_path, **OPTIONS) as store:
        store.put(NS, NS.block_keys(list(range(16))), [os.urandom(BLOCK_BYTES)] * 4)
        store.flush()
        recorded = read_record(store_path / "lmdb")
        assert recorded is not None
        held = os.open(store_path / "lmdb" / RECORD_FILE, os.O_RDWR | os.O_CREAT, 0o600)  # another open file: its own lock
        try:
            fcntl.flock(held, fcntl.LOCK_EX)
            store.put(NS, NS.block_keys(list(range(1000, 1016))), [os.urandom(BLOCK_BYTES)] * 4, parent=None)
            store.flush()
            after = read_record(store_path / "lmdb")
            assert after is not None and after.txnid > recorded.txnid
        finally:
            os.close(held)


#: A maintenance view held open in another process, as by a follower stopped inside one.
VIEW = """
import os, sys, time
from ucm_db.errors import TierError
from ucm_db.store.view import open_view
with open_view(sys.argv[1]) as view:
    try:
        view.engine.write(lambda txn: None)
        refused = "wrote"
    except TierError:
        refused = "refused"
    open(sys.argv[2] + ".new", "w").write(f"{view.tier.totals().blocks} {refused}"); os.replace(sys.argv[2] + ".new", sys.argv[2])
    time.sleep(600)
"""


def test_a_view_held_open_pins_nothing_and_writes_nothing(tmp_path: Path) -> None:
    """A maintenance view (``ucm-db inspect``, ``events --follow``) of a
    writable store held open, as by a follower stopped with Ctrl-Z: it held
    a pinned snapshot (and synced and recorded it), so LMDB reused no page
    freed after it and a store churned 40x its capacity grew past it."""
    import time

    from ucm_db.engines.lmdb.groupsync import read_record

    store_path, ready = tmp_path / "store", tmp_path / "ready"
    with ucm_db.open(store_path, **OPTIONS) as store:
        store.put(NS, NS.block_keys(list(range(16))), [os.urandom(BLOCK_BYTES)] * 4)
        store.flush()
        recorded = read_record(store_path / "lmdb")
        with open(tmp_path / "view.log", "wb") as log:
            viewer = subprocess.Popen([sys.executable, "-c", VIEW, str(store_path), str(ready)], stdout=log, stderr=log)
        try:
            deadline = time.monotonic() + 60
            while not (ready.exists() and ready.read_text()) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert ready.read_text() == "4 refused", tail(tmp_path / "view.log")
            assert read_record(store_path / "lmdb") == recorded  # the view recorded nothing
            for round_ in range(40 * CAPACITY_BYTES // (4 * BLOCK_BYTES)):  # 40x the capacity, the view open
                tokens = list(range(round_ * 1000, round_ * 1000 + 16))
                store.put(NS, NS.block_keys(tokens), [os.urandom(BLOCK_BYTES)] * 4, parent=None)
        finally:
            kill_and_reap(viewer.pid)
            viewer.wait()
        sync_bytes = store.config.sync_bytes
    file_bytes = os.path.getsize(store_path / "lmdb" / "data.mdb")
    assert file_bytes <= 2 * CAPACITY_BYTES + sync_bytes, file_bytes
