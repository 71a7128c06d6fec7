"""`ucm-db compact`: shrinks a store with deletions by the expected amount,
loses no live block, evicts to a target, and is safe beside a live writer."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import time
from pathlib import Path

import pytest

import ucm_db
from ucm_db import Namespace

import writer_proc
from cli_stores import invoke, invoke_json, make_store

NS = Namespace(model="test/compact", kv_dtype="bfloat16", block_size=16)
RAW_BYTES = 16384


def noise(i: int, j: int) -> bytes:
    return hashlib.shake_256(b"c%d/%d" % (i, j)).digest(RAW_BYTES)  # incompressible


def chain_keys(i: int) -> list[bytes]:
    return NS.block_keys([i * 1000 + j for j in range(8 * NS.block_size)])


def test_compact_shrinks_by_the_deleted_bytes_and_keeps_live_blocks(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with ucm_db.open(path, capacity_bytes=1 << 30, codec="none") as store:
        for i in range(64):
            store.put(NS, chain_keys(i), [noise(i, j) for j in range(8)])
        deleted_before = store.stats().stored_bytes
        for i in range(64):
            if i % 4:
                store.delete(NS, [chain_keys(i)[0]])
        live_stored = store.stats().stored_bytes
        block_stored = store._tier.metas([chain_keys(0)[0]])[0].stored_bytes  # type: ignore[union-attr]
    deleted = deleted_before - live_stored
    # LMDB keeps each large value in whole 4 KiB overflow pages (plus a page header).
    live_pages_bytes = 16 * 8 * -(-(block_stored + 16) // 4096) * 4096
    assert deleted > 5 << 20

    r = invoke_json("compact", path)
    assert r["exclusive"] and r["rewrite"] == "rewritten"
    assert r["blocks_before"] == r["blocks_after"] == 16 * 8 and r["evicted_blocks"] == 0
    shrunk = r["file_bytes_before"] - r["file_bytes_after"]
    assert shrunk >= 0.9 * deleted, (shrunk, deleted)
    assert r["file_bytes_after"] <= live_pages_bytes * 1.05 + (256 << 10), (r["file_bytes_after"], live_pages_bytes)
    # The stale reader table (lock.mdb) is gone; what remains is the new data file and small records beside it.
    assert not (path / "lmdb" / "lock.mdb").exists()
    assert sum(f.stat().st_size for f in (path / "lmdb").iterdir()) == r["file_bytes_after"]
    assert (path / "lmdb" / "data.mdb").stat().st_size >= r["file_bytes_after"] - (64 << 10)
    assert not list(path.glob("lmdb.compact-*"))

    with ucm_db.open(path) as store:
        assert store._tier.check() == []
        for i in range(0, 64, 4):
            assert store.get(NS, chain_keys(i)) == [bytearray(noise(i, j)) for j in range(8)]
        store.put(NS, chain_keys(99), [noise(99, j) for j in range(8)])  # still writable after the switch


def test_compact_evicts_to_target_and_drops_quarantine_records(tmp_path: Path) -> None:
    make_store(tmp_path / "s")
    with ucm_db.open(tmp_path / "s") as store:
        target = store.stats().stored_bytes // 2
        store._tier.quarantine(b"q" * 32, "test record", lambda head, body: True)
    r = invoke_json("compact", tmp_path / "s", "--target-bytes", target)
    assert r["stored_bytes_after"] <= target and r["evicted_blocks"] > 0
    assert r["blocks_after"] == r["blocks_before"] - r["evicted_blocks"]
    assert r["quarantine_records_dropped"] == 1 and r["index_problems"] == []
    assert invoke_json("verify", tmp_path / "s")["checked"] == r["blocks_after"]


def test_compact_rocksdb(tmp_path: Path) -> None:
    make_store(tmp_path / "s", engine="rocksdb")
    r = invoke_json("compact", tmp_path / "s", "--target-bytes", 0)
    assert r["blocks_after"] == 0 and r["rewrite"] == "rocksdb compaction"
    with ucm_db.open(tmp_path / "s") as store:
        with_lock = invoke("compact", tmp_path / "s", expect=2)
        assert "single-process" in with_lock.stderr
        assert store.stats().blocks == 0


def start_writer(path: Path, stop: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, writer_proc.__file__, str(path), str(stop)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    assert proc.stdout is not None
    for _ in range(5):  # wait for a few committed chains
        assert proc.stdout.readline(), proc.stderr.read() if proc.stderr else ""
    return proc


@pytest.mark.multiprocess
def test_compact_beside_a_running_writer_is_safe(tmp_path: Path) -> None:
    path = tmp_path / "s"
    ucm_db.open(path, capacity_bytes=1 << 30).close()
    stop = tmp_path / "stop"
    writer = start_writer(path, stop)
    try:
        r = invoke_json("compact", path)
        assert not r["exclusive"] and r["rewrite"] == "skipped" and writer.pid in r["held_by"]
        refused = invoke("compact", path, "--require-exclusive", expect=2)
        assert f"pid {writer.pid}" in refused.stderr
        time.sleep(0.2)
        r = invoke_json("compact", path, "--target-bytes", 200_000)
        assert r["index_problems"] == [] and r["evicted_blocks"] > 0
        time.sleep(0.2)
    finally:
        stop.touch()
        out, err = writer.communicate(timeout=60)
    assert writer.returncode == 0, err
    last = int(out.split()[-1])
    with ucm_db.open(path) as store:
        assert store._tier.check() == []
        present = [store.lookup(writer_proc.NS, writer_proc.chain(i)[0]) for i in range(last + 1)]
        assert all(n in (0, writer_proc.BLOCKS) for n in present)  # whole chains or evicted tails first
        survivors = [i for i, n in enumerate(present) if n]
        assert survivors and survivors[-1] == last  # the newest chains were not evicted
        for i in survivors:
            keys, payloads = writer_proc.chain(i)
            assert store.get(writer_proc.NS, keys) == [bytearray(p) for p in payloads]
    assert invoke_json("verify", path)["corrupt"] == []


def test_target_bytes_takes_sizes_with_units_as_pin_and_gc_do(tmp_path: Path) -> None:
    """Audit F16: `--target-bytes 10GiB` was "'10GiB' is not a valid integer range"."""
    make_store(tmp_path / "s")
    before = invoke_json("inspect", tmp_path / "s")
    r = invoke_json("compact", tmp_path / "s", "--target-bytes", "10GiB")
    assert r["evicted_blocks"] == 0 and r["blocks_after"] == before["blocks"]
    for bad in ("-1", "10XB", "0.5"):
        error = invoke_json("compact", tmp_path / "s", "--target-bytes", bad, expect=2)["error"]
        assert error["type"] == "ConfigError" and repr(bad) in error["message"] and "10GiB" in error["hint"]
    assert invoke_json("inspect", tmp_path / "s")["blocks"] == before["blocks"]
    r = invoke_json("compact", tmp_path / "s", "--target-bytes", "8KiB")
    assert r["stored_bytes_after"] <= 8192 < r["stored_bytes_before"] and r["evicted_blocks"] > 0
