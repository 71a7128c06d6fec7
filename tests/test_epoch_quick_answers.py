"""``Store.epoch`` answers from memory while nothing was committed to the
store (ucm_db/store/epoch_gate.py, module invariants): the connector's
scheduler asks it every step, and a read transaction there cost 40-130 us
of the engine core's step.

Invariants checked, on real LMDB stores in ``tmp_path``:
    * Asked again with no commit since, ``epoch()`` opens no read
      transaction (a spy counts the engine's reads).
    * Any commit since the last answer, this process's or another's (a bump
      in a child process, the way ``ucm-db invalidate`` bumps), makes the
      next call read the record: a bump is seen at the very next call.
    * After :data:`~ucm_db.store.epoch_gate.QUICK_RECHECK_S` the record is
      read again without any commit.
    * LMDB's commit ids (the meta pages' mapped transaction ids) are what
      LMDB reports, and move with every commit, never with a read.
    * A read whose snapshot is older than the commit the meta pages name (inside LMDB's window between the two)
      is never answered from memory.
    * A RocksDB store, whose engine gives no commit id, reads every time.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import ucm_db
from ucm_db import Namespace
from ucm_db.engines.lmdb.commit_ids import CommitIds, commit_ids_of
from ucm_db.store import epoch_gate

NS = Namespace(model="test/quick-epochs", kv_dtype="bfloat16", block_size=4)
TOKENS = list(range(3, 3 + 4 * 3))


class ReadCounter:
    """Counts the read transactions of a store's real engine."""

    def __init__(self, store: ucm_db.Store, monkeypatch: pytest.MonkeyPatch) -> None:
        engine = store._engine
        real_read = engine.read
        self.reads = 0

        def counted(fn):  # type: ignore[no-untyped-def]
            self.reads += 1
            return real_read(fn)

        monkeypatch.setattr(engine, "read", counted)

    def during(self, call) -> int:  # type: ignore[no-untyped-def]
        before = self.reads
        call()
        return self.reads - before


@pytest.fixture
def store(tmp_path: Path) -> Iterator[ucm_db.Store]:
    with ucm_db.open(tmp_path / "s", codec="none") as opened:
        yield opened


def test_an_unchanged_store_answers_from_memory(store: ucm_db.Store, monkeypatch: pytest.MonkeyPatch) -> None:
    counter = ReadCounter(store, monkeypatch)
    assert store.epoch(NS) == 0
    assert [counter.during(lambda: store.epoch(NS)) for _ in range(5)] == [0] * 5


def test_a_commit_of_this_process_makes_the_next_call_read(store: ucm_db.Store,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    counter = ReadCounter(store, monkeypatch)
    keys = NS.block_keys(TOKENS, epoch=store.epoch(NS))
    store.put(NS, keys, [bytes([i]) * 64 for i in range(len(keys))])
    assert counter.during(lambda: store.epoch(NS)) >= 1
    assert counter.during(lambda: store.epoch(NS)) == 0


def test_another_process_bump_is_seen_at_the_next_call(store: ucm_db.Store) -> None:
    assert store.epoch(NS) == 0 and store.epoch(NS) == 0  # the second answered from memory
    code = (f"import ucm_db; from ucm_db import Namespace; s = ucm_db.open({str(store.path)!r}); "
            f"print(s.bump_epoch(Namespace(**{NS.to_dict()!r})))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert store.epoch(NS) == int(done.stdout) == 1


def test_an_own_bump_is_answered_at_once(store: ucm_db.Store) -> None:
    assert store.epoch(NS) == 0
    assert store.bump_epoch(NS) == 1
    assert store.epoch(NS) == 1


def test_the_record_is_read_again_once_the_recheck_time_passed(store: ucm_db.Store,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    counter = ReadCounter(store, monkeypatch)
    monkeypatch.setattr(epoch_gate, "QUICK_RECHECK_S", 0.0)
    store.epoch(NS)
    assert [counter.during(lambda: store.epoch(NS)) for _ in range(3)] == [1] * 3


def test_an_engine_without_commit_ids_reads_every_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with ucm_db.open(tmp_path / "r", codec="none", engine="rocksdb") as rocks:
        assert commit_ids_of(rocks._engine) is None
        counter = ReadCounter(rocks, monkeypatch)
        assert [counter.during(lambda: rocks.epoch(NS)) for _ in range(3)] == [1] * 3


def test_lmdb_commit_ids_are_lmdbs_transaction_ids(store: ucm_db.Store) -> None:
    """The meta-page map reads what LMDB itself reports, and moves with every commit, not with reads."""
    ids = commit_ids_of(store._engine)
    assert ids is not None
    env = store._engine._environment()
    before = ids.last()
    assert before == env.info()["last_txnid"]
    store.epoch(NS)
    assert ids.last() == before  # a read commits nothing
    for i in range(3):  # both meta pages take their turn
        keys = NS.block_keys([i] * 4, epoch=0)
        store.put(NS, keys, [b"x" * 64])
        assert ids.last() == env.info()["last_txnid"] > before
        before = ids.last()
    ids.close()
    assert ids.last() is None


class AheadOfReaders:
    """LMDB's commit ids inside a commit's window: the meta page names the new commit while read transactions
    still begin at the one before (commit_ids.py). A stand-in for a window a test cannot hold open on demand
    (tests/test_review_todays_changes2.py holds it with strace where strace is installed)."""

    def __init__(self, ids: CommitIds) -> None:
        self._ids = ids

    def last(self) -> int | None:
        last = self._ids.last()
        return None if last is None else last + 1

    def seen_by(self, txn) -> int | None:  # type: ignore[no-untyped-def]
        return self._ids.seen_by(txn)


def test_a_read_older_than_the_last_commit_is_never_answered_from_memory(store: ucm_db.Store,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    ids = commit_ids_of(store._engine)
    assert ids is not None
    monkeypatch.setattr(store._state.epochs, "_commits", AheadOfReaders(ids))
    counter = ReadCounter(store, monkeypatch)
    assert [counter.during(lambda: store.epoch(NS)) for _ in range(3)] == [1] * 3
    ids.close()
