"""RocksDB engine specifics (the shared behaviour is in test_tier_conformance):
raw mode only, blob files for payloads, single-process refusal, persistence."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import ucm_db
from ucm_db import Namespace
from ucm_db.errors import LockedError
from ucm_db.engines.rocksdb import RocksDbEngine

NS = Namespace(model="test/rocks", kv_dtype="bfloat16", block_size=16)


def test_raw_mode_blob_files_and_reopen(tmp_path: Path) -> None:
    engine = RocksDbEngine(tmp_path / "db", sync=True)
    big = os.urandom(64 * 1024)
    odd = b"\x80\x04\x95 not a pickle"
    engine.write(lambda txn: (txn.put("blocks", b"k1", big), txn.put("info", b"k2", odd)))
    engine.close()
    config = json.loads((tmp_path / "db" / "rocksdict-config.json").read_text())
    assert config["raw_mode"] is True
    assert list((tmp_path / "db").glob("*.blob")), "large values should live in BlobDB blob files"
    engine = RocksDbEngine(tmp_path / "db", sync=True)
    try:
        assert engine.read(lambda txn: (txn.get("blocks", b"k1"), txn.get("info", b"k2"))) == (big, odd)
    finally:
        engine.close()


def test_second_process_gets_locked_error(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with ucm_db.open(path, engine="rocksdb", capacity_bytes=1 << 24) as store:
        store.put(NS, NS.block_keys(list(range(32))), [b"x" * 100, b"y" * 100])
        script = "import ucm_db, sys\ntry:\n    ucm_db.open(sys.argv[1])\nexcept ucm_db.LockedError as e:\n    print(e); sys.exit(3)\n"
        done = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=60)
        assert done.returncode == 3, done.stderr
        assert "single-process" in done.stdout and "LMDB" in done.stdout
        with pytest.raises(LockedError):
            ucm_db.open(path)  # a second handle in this process is refused too
    with ucm_db.open(path) as store:  # released on close
        assert store.lookup(NS, NS.block_keys(list(range(32)))) == 2


def test_forked_child_is_refused(tmp_path: Path) -> None:
    engine = RocksDbEngine(tmp_path / "db", sync=False)
    try:
        pid = os.fork()
        if pid == 0:  # child: must not touch the parent's handle
            try:
                engine.read(lambda txn: txn.get("info", b"x"))
                os._exit(1)
            except LockedError:
                os._exit(0)
            except BaseException:
                os._exit(2)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        engine.close()


def test_scan_floor_survives_aborts_and_low_puts(tmp_path: Path) -> None:
    """Scans skip the queue head of deleted keys, but never hide live ones."""
    import random

    engine = RocksDbEngine(tmp_path / "db", sync=False)
    model: dict[bytes, bytes] = {}
    rng = random.Random(7)
    try:
        for step in range(300):
            ops = [(rng.choice("pdd"), b"%04d" % rng.randrange(200)) for _ in range(rng.randrange(1, 8))]
            abort = rng.random() < 0.3

            def run(txn: object, ops: list[tuple[str, bytes]] = ops, abort: bool = abort) -> None:
                for op, key in ops:
                    if op == "p":
                        txn.put("lru", key, key)  # type: ignore[attr-defined]
                    else:
                        txn.delete("lru", key)  # type: ignore[attr-defined]
                    next(iter(txn.scan("lru")), None)  # type: ignore[attr-defined]  # moves the floor
                if abort:
                    raise KeyError("abort")

            try:
                engine.write(run)
            except KeyError:
                pass
            else:
                for op, key in ops:
                    if op == "p":
                        model[key] = key
                    else:
                        model.pop(key, None)
            assert engine.read(lambda txn: [k for k, _ in txn.scan("lru")]) == sorted(model), step
            prefix = b"%02d" % rng.randrange(20)
            got = engine.read(lambda txn: [k for k, _ in txn.scan("lru", prefix)])
            assert got == sorted(k for k in model if k.startswith(prefix)), step
    finally:
        engine.close()


def test_eviction_heavy_store_stays_consistent(tmp_path: Path) -> None:
    """A RocksDB store at capacity evicts for every put (each eviction scan
    starts at the LRU floor, past the tombstones of earlier evictions)."""
    payload = os.urandom(2048)
    with ucm_db.open(tmp_path / "s", engine="rocksdb", codec="none", capacity_bytes=1 << 20) as store:
        for c in range(300):  # ~2.4 MiB through a 1 MiB store
            keys = NS.block_keys([c * 1000 + t for t in range(4 * 16)])
            store.put(NS, keys, [payload] * 4)
            assert store.lookup(NS, keys) == 4
        assert store.stats().evictions > 600 and store._tier.check() == []
        newest = NS.block_keys([299 * 1000 + t for t in range(4 * 16)])
        assert store.get(NS, newest) == [bytearray(payload)] * 4
