"""A full disk under a store's maintenance thread: every round fails (the
readers' touches cannot be written), is counted and retried, and is logged
once a minute at most, with one line when rounds succeed again. Before the
audit each failed round logged a warning: one a second at the default
``sync_interval_s`` for as long as the disk stayed full.

The disk is full for real (a small tmpfs mounted by the test, filled by a
filler file). RocksDB fails every write while its disk is full; LMDB's
small maintenance writes mostly reuse pages freed by the commit before
them, so on LMDB only some rounds fail (the worker sweep of the audit saw
1-2 a minute there), too few to test the limit on.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

import ucm_db

from .harness import NS
from .test_faults import assert_readable, fill_leaving, put_until_error, small_tmpfs  # noqa: F401 - small_tmpfs is a fixture

FAILED_ROUNDS = 8


def _wait(condition, timeout_s: float = 30.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return bool(condition())


def test_failing_maintenance_rounds_log_once_and_say_when_they_succeed_again(
        small_tmpfs: Path, caplog: pytest.LogCaptureFixture) -> None:  # noqa: F811
    store = ucm_db.open(small_tmpfs / "store", engine="rocksdb", capacity_bytes=1 << 30, durability="sync", sync_interval_s=0.05)
    try:
        acked, error = put_until_error(store, "acked", limit=8)
        assert error is None
        filler = fill_leaving(small_tmpfs, 0)
        put_until_error(store, "full", limit=40)  # the disk is full: a put fails
        with caplog.at_level(logging.INFO, logger="ucm_db"):
            errors_before = store.stats().maintenance_errors
            for _ in range(FAILED_ROUNDS):  # a read's touches for each round to write, which it cannot
                store.get(NS, acked)
                rounds = store.stats().maintenance_errors
                assert _wait(lambda: store.stats().maintenance_errors > rounds), "the maintenance rounds stopped"
            assert store.stats().maintenance_errors - errors_before >= FAILED_ROUNDS
            warnings = [r for r in caplog.records if "background sync/flush failed" in r.getMessage()]
            assert len(warnings) == 1, [r.getMessage()[:100] for r in warnings]
            assert_readable(store, acked)
            filler.unlink()
            assert _wait(lambda: any("background sync/flush works again" in r.getMessage() for r in caplog.records))
            more, error = put_until_error(store, "after", limit=2)
            assert error is None, repr(error)
    finally:
        store.close()
