"""Reads never write: ``get`` and ``get_into`` open no write transaction in
the caller's thread, even the read whose touches cross the buffer's flush
threshold; the maintenance thread writes that recency instead (real LMDB
store; the engine's ``write`` is wrapped only to count its calls)."""

from __future__ import annotations

import threading
import time

import pytest

import ucm_db
from ucm_db import Namespace
from ucm_db.store.background import ACTIVITY_FLUSH_KEYS

NS = Namespace(model="reads-do-not-write", kv_dtype="bfloat16", block_size=4)
BLOCKS = ACTIVITY_FLUSH_KEYS + 100


class WriteCounter:
    """Counts ``engine.write`` calls made by the thread that armed it."""

    def __init__(self, engine) -> None:
        self.thread = threading.get_ident()
        self.calls = 0
        real = engine.write

        def counted(fn):
            if threading.get_ident() == self.thread:
                self.calls += 1
            return real(fn)

        engine.write = counted


@pytest.mark.parametrize("read", ["get", "get_into"])
def test_a_read_crossing_the_flush_threshold_writes_nothing(tmp_path, read: str) -> None:
    keys = NS.block_keys(list(range(4 * BLOCKS)))
    with ucm_db.open(tmp_path / "s", codec="none", sync_interval_s=3600.0) as store:
        store.put(NS, keys, [bytes([i % 251]) * 64 for i in range(BLOCKS)])
        writes = WriteCounter(store._engine)
        if read == "get":
            assert all(b is not None for b in store.get(NS, keys))
        else:
            assert all(store.get_into(NS, keys, [bytearray(64) for _ in keys]))
        assert writes.calls == 0
        # The maintenance thread writes the touches (woken by the threshold,
        # not by its hour-long interval): wait for it, then check the index.
        deadline = time.monotonic() + 60
        while store._tier.metas([keys[-1]])[0].hits == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert store._tier.metas([keys[-1]])[0].hits == 1
        assert writes.calls == 0


def test_reads_waking_the_thread_never_postpone_the_interval_sync(tmp_path) -> None:
    """With group durability the maintenance thread syncs every interval even
    while reads keep waking it (each read crossing the touch threshold) more
    often than that: a wake must not restart the interval, or a read-heavy
    server never syncs its small puts and a power cut loses more than the
    last interval. (The engine's ``sync`` is wrapped only to count calls.)"""
    keys = NS.block_keys(list(range(4 * 64)))
    with ucm_db.open(tmp_path / "s", codec="none", durability="group", sync_interval_s=0.2,
                     sync_bytes=1 << 30) as store:
        store.put(NS, keys, [b"x" * 64] * 64)
        syncs = []
        real_sync = store._engine.sync_round
        store._engine.sync_round = lambda: (syncs.append(1), real_sync())[1]
        touch_keys = [i.to_bytes(32, "little") for i in range(ACTIVITY_FLUSH_KEYS)]
        background = store._activity
        deadline = time.monotonic() + 20
        while not syncs and time.monotonic() < deadline:
            background.record_reads(touch_keys, [b""] * len(touch_keys))  # wakes the thread: a flush is due
            time.sleep(0.01)
        assert syncs, "no interval sync while reads kept waking the maintenance thread"
