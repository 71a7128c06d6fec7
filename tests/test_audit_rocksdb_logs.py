"""RocksDB's own info logs stay bounded in the store directory.

Every writable open of a RocksDB database renames its info log ``LOG`` to
``LOG.old.<time>`` and starts a new one (the options of every table: about
140 KiB), and RocksDB keeps 1000 of them by default. Before the audit a
store opened by each vLLM start, each ``verify --fix``, ``compact`` and
``migrate`` kept them all: two more files per ``ucm_db.open``, 1.5 MB after
five opens of a fresh store, heading for 280 MB that no capacity, eviction
or ``compact`` ever took back (LMDB keeps no such files)."""

from __future__ import annotations

from pathlib import Path

import ucm_db
from ucm_db import Namespace, maintenance
from ucm_db.engines.rocksdb import KEEP_LOG_FILES

NS = Namespace(model="audit-rocksdb-logs", kv_dtype="bfloat16", block_size=4)


def test_info_logs_do_not_pile_up_across_opens(tmp_path: Path) -> None:
    path = tmp_path / "s"
    keys = NS.block_keys(list(range(8)))
    for i in range(12):
        with ucm_db.open(path, engine="rocksdb", codec="none") as store:
            store.put(NS, NS.block_keys([i] * 8), [b"x" * 8192] * 2)
    maintenance.verify(path, fix=True)
    maintenance.compact(path)
    logs = sorted(p.name for p in (path / "rocksdb").iterdir() if p.name.startswith("LOG"))
    assert len(logs) <= KEEP_LOG_FILES, logs
    with ucm_db.open(path) as store:  # the store is whole
        assert store.stats().blocks == 24 and store.lookup(NS, keys) == 0
