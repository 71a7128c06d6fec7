"""RocksDB under a full disk and with its files removed, as a connector's
model thread meets it: reads never wait for the reopen a failed write
starts, a disk that stays full is not reopened at every write, and a file
truncated or removed under the running store is a ``TierError`` or a miss,
never rocksdict's bare ``Exception`` nor wrong bytes.

The disk is full for real (a small tmpfs mounted by the test, filled by a
filler file). Before the audit, a write after a failed one reopened the
database holding the reads' gate: every read (a worker's load) waited 1 s
for the failed database's close (RocksDB retrying the failed write), then
30-70 ms for every later write's reopen, one per writer round while the
disk stayed full (``/tmp`` sweep: a step's load 1.05 s, now 0.03 s).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import ucm_db
from ucm_db.errors import TierError

from .harness import NS, payload_for, size_for
from .test_faults import SIZE_RANGE, assert_readable, fill_leaving, put_until_error, small_tmpfs  # noqa: F401 - fixture


def _open(path: Path) -> ucm_db.Store:
    return ucm_db.open(path, engine="rocksdb", capacity_bytes=1 << 30, durability="sync")


def _full(store: ucm_db.Store, mount: Path) -> tuple[list[bytes], Path]:
    """Blocks acknowledged, then a full disk and a failed put: (acked keys, the filler)."""
    acked, error = put_until_error(store, "acked", limit=12)
    assert error is None
    filler = fill_leaving(mount, 0)
    _, error = put_until_error(store, "full", limit=40)
    assert isinstance(error, TierError), repr(error)
    return acked, filler


def test_reads_go_on_while_a_failed_write_reopens_the_store(small_tmpfs: Path) -> None:  # noqa: F811
    store = _open(small_tmpfs / "store")
    try:
        acked, filler = _full(store, small_tmpfs)
        engine = store._tier.engine
        real_open, read_in_time = engine._open, []  # type: ignore[attr-defined]
        reopening, read_done = threading.Event(), threading.Event()

        def stalled_open():  # type: ignore[no-untyped-def]
            # The reopen for writing stalls until a read beside it returned (at most 20 s): a reopen is 30-70 ms
            # here, too short to meet a read on purpose without a stall.
            reopening.set()
            read_in_time.append(read_done.wait(20))
            return real_open()
        engine._open = stalled_open  # type: ignore[attr-defined]
        writer = threading.Thread(target=put_until_error, args=(store, "reopen", 1), daemon=True)
        writer.start()
        assert reopening.wait(20), "the write after a failed one did not try to reopen the store"
        assert_readable(store, acked)  # beside the stalled reopen
        read_done.set()
        writer.join(30)
        assert read_in_time == [True], "a read waited for the reopen of a failed write"
        engine._open = real_open  # type: ignore[attr-defined]
        filler.unlink()
        more, error = put_until_error(store, "after", limit=2)
        assert error is None, repr(error)
        assert_readable(store, acked + more)
    finally:
        store.close()


def test_a_disk_that_stays_full_is_not_reopened_at_every_write(small_tmpfs: Path) -> None:  # noqa: F811
    store = _open(small_tmpfs / "store")
    try:
        acked, filler = _full(store, small_tmpfs)
        engine = store._tier.engine
        real_open, opens = engine._open, []  # type: ignore[attr-defined]

        def counted_open():  # type: ignore[no-untyped-def]
            opens.append(1)
            return real_open()
        engine._open = counted_open  # type: ignore[attr-defined]
        failures = 0
        for _ in range(20):  # a writer round each, all failing: the disk stays full
            _, error = put_until_error(store, f"still-full-{failures}", limit=1)
            failures += isinstance(error, TierError)
        assert failures == 20
        assert len(opens) <= 3, f"{len(opens)} reopens for 20 failed writes on a disk that stayed full"
        assert_readable(store, acked)
        filler.unlink()  # freed space: the next write reopens at once
        more, error = put_until_error(store, "after", limit=2)
        assert error is None, repr(error)
    finally:
        store.close()


def test_a_truncated_table_file_or_a_removed_blob_file_is_a_tier_error_or_a_miss(tmp_path: Path) -> None:
    """Before the audit a get over a truncated table file raised rocksdict's bare ``Exception`` ("Corruption:
    truncated block read"): the connector's load caught it as an unforeseen error, with a traceback each step."""
    store = _open(tmp_path / "store")
    try:
        acked, error = put_until_error(store, "acked", limit=40)
        assert error is None
        for family in store._tier.engine._families.values():  # type: ignore[attr-defined]
            family.flush(True)  # into table and blob files
        files = [f for f in (tmp_path / "store" / "rocksdb").iterdir() if f.suffix in (".sst", ".blob")]
        assert {f.suffix for f in files} == {".sst", ".blob"}
        for f in files:
            if f.suffix == ".sst":
                os.truncate(f, f.stat().st_size // 2)
            else:
                f.unlink()
        outcome: list[str] = []
        for start in range(0, len(acked), 8):
            batch = acked[start:start + 8]
            try:
                got = store.get(NS, batch)
            except TierError:
                outcome.append("tier error")
                continue
            for key, value in zip(batch, got):
                assert value is None or bytes(value) == payload_for(key, size_for(key, *SIZE_RANGE)), "wrong bytes"
            outcome.append("read")
        assert len(outcome) == 5
    finally:
        try:
            store.close()
        except TierError:
            pass  # its files are damaged: a close that cannot flush says so
