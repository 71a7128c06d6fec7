"""Isolated reads (``maintenance.inspect``/``verify`` with ``isolated=True``,
what the CLI passes) of a RocksDB store, from a process with a RocksDB store
open: the read runs in this process.

Found by the suite: ``ucm-db inspect`` run in-process beside a live RocksDB
writer hung for good about one read in twenty: the forked child blocked in
RocksDB's ``ThreadPoolImpl::IncBackgroundThreadsIfNeeded`` on a mutex that a
background thread of the parent held at the fork.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import ucm_db
from ucm_db import maintenance

from cli_stores import NS_A, invoke_json, make_store, payload


def test_an_isolated_read_of_a_rocksdb_store_forks_no_child(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Deterministic guard of the hang below (which a run shows only now and
    then): ``os.fork`` replaced by one that fails the test (a mock: the
    deadlock depends on where the parent's RocksDB threads are at the fork)."""
    make_store(tmp_path / "r", engine="rocksdb")
    make_store(tmp_path / "l")

    def no_fork() -> int:
        raise AssertionError("forked for a RocksDB store")
    with ucm_db.open(tmp_path / "r"):
        monkeypatch.setattr(os, "fork", no_fork)
        assert maintenance.inspect(tmp_path / "r", isolated=True)["blocks"] == 23
        report = maintenance.verify(tmp_path / "r", isolated=True)
        assert report.checked == 23 and not report.corrupt and not report.index_problems
        with pytest.raises(AssertionError, match="forked"):  # LMDB stores are still read in a child
            maintenance.inspect(tmp_path / "l", isolated=True)


def test_inspect_beside_a_live_rocksdb_writer_never_hangs(tmp_path: Path) -> None:
    """The hang itself, tried 40 times (it hung now and then before): each
    read just after the writer put and flushed (RocksDB's background threads
    at work)."""
    make_store(tmp_path / "s", engine="rocksdb")
    with ucm_db.open(tmp_path / "s") as store:
        for i in range(40):
            keys = NS_A.block_keys([60000 + i] + list(range(2 * NS_A.block_size - 1)))  # a chain of its own
            store.put(NS_A, keys, [payload("w", i)] * 2)
            store.flush()
            assert invoke_json("inspect", tmp_path / "s")["blocks"] == 23 + 2 * (i + 1), i
