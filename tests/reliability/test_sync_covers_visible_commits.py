"""A flush covers every commit a reader of the process could see.

A commit of a group store becomes visible when LMDB commits it, and the
engine counts it (``SnapshotPin.committed``) a little later, after the
walk ledger's update. A sync in that window found "no commit since the last
record" and did nothing: ``Store.flush`` waited for the uploader to empty
its queue (the removal visible), synced nothing, and a power cut then
brought every upload back (``tests/reliability/test_flush_uploads.py``
failed about 1 run in 8). Now a commit under way makes a sync record the
newest snapshot.

The window is widened by a stated stand-in for a preemption: the instance's
``Custody.committing`` (the step between LMDB's commit and the count) is
wrapped to wait for the test after the real one ran. The store, the commit,
the sync and its record are real.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import ucm_db
from ucm_db.engines.lmdb import records

from .harness import NS, chain_tokens, payload_for

STEP_S = 30.0


class _HeldAfterCommit:
    """``Custody.committing``'s context, held after its real exit until released (the commit is visible)."""

    def __init__(self, custody: Any) -> None:
        self._custody, self._real = custody, custody.committing
        self.visible, self.go = threading.Event(), threading.Event()

    def __call__(self) -> _HeldAfterCommit:
        self._inner = self._real()
        return self

    def __enter__(self) -> _HeldAfterCommit:
        self._inner.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._inner.__exit__(*exc)
        self.visible.set()
        assert self.go.wait(STEP_S), "the test did not release the commit"


def test_a_flush_during_a_commit_readers_already_see_records_it(tmp_path: Path) -> None:
    keys = NS.block_keys(chain_tokens("sync-covers", 2))
    with ucm_db.open(tmp_path / "s", durability="group", sync_interval_s=3600.0, codec="none") as store:
        store.put(NS, keys[:1], [payload_for(keys[0], 4096)])
        store.flush()
        engine = store._tier.engine
        held = _HeldAfterCommit(engine._custody)
        engine._custody.committing = held  # type: ignore[method-assign]
        writer = threading.Thread(target=store.put, args=(NS, keys, [payload_for(k, 4096) for k in keys]))
        writer.start()
        try:
            assert held.visible.wait(STEP_S), "the put did not commit"
            assert store.lookup(NS, keys) == 2  # readers see the commit
            committed_txnid = engine._environment().info()["last_txnid"]
            engine.sync()  # Store.flush's sync, in the window
            recorded = records.newest(engine.path)
            assert recorded is not None and recorded.txnid >= committed_txnid, (
                f"the sync recorded snapshot {recorded and recorded.txnid}, not the visible commit {committed_txnid}")
        finally:
            held.go.set()
            writer.join(STEP_S)
            engine._custody.committing = held._real  # type: ignore[method-assign]
