"""A new store's change feed starts at a random seq (ucm_db.index.changefeed.start):
a position a reader saved from a store that was deleted and created again at
the same path is never a seq the new store hands out for other blocks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import ucm_db
from ucm_db import maintenance
from ucm_db.index import changefeed
from tests.test_changefeed import NS, FeedView, fields_for, stored_hashes

ENGINES = ["lmdb", "rocksdb"]


def _evented_puts(store: ucm_db.Store, chains: int, first_token: int = 0) -> None:
    for n in range(first_token, first_token + chains):
        tokens = [n] * 8
        keys = NS.block_keys(tokens)
        store.put(NS, keys, [b"x"] * 2, event_fields=fields_for(keys, tokens))


@pytest.mark.parametrize("engine", ENGINES)
def test_a_new_store_starts_its_feed_at_a_random_multiple_of_the_restart_gap(tmp_path: Path, engine: str) -> None:
    starts = []
    for n in range(3):
        with ucm_db.open(tmp_path / str(n), capacity_bytes=1 << 30, engine=engine) as store:
            starts.append(store.feed_position())
            _evented_puts(store, 1)
            assert store.feed_position() == starts[-1] + 2
            assert [r.seq for r in store.changes_since(starts[-1]).records] == [starts[-1], starts[-1] + 1]
    for start in starts:
        assert start % changefeed.RESTART_GAP == 0 and changefeed.RESTART_GAP <= start < 2**52
        assert json.loads(json.dumps(start)) == start and float(start) == start  # exact as a JSON number anywhere
    assert len(set(starts)) > 1, f"three new stores drew the same start {starts}"


@pytest.mark.parametrize("engine", ENGINES)
def test_a_position_saved_from_a_deleted_store_resyncs_on_the_new_one(tmp_path: Path, engine: str) -> None:
    """The old store handed out 3 seqs; the new one at the same path holds
    more records than that. With both feeds starting at 0 the reader's
    saved position read the new store's records from there on: it missed
    the ones before and was never told the old store's blocks were gone."""
    path = tmp_path / "s"
    with ucm_db.open(path, capacity_bytes=1 << 30, engine=engine) as store:
        _evented_puts(store, 1)
        view = FeedView(store)  # a router: the inventory, then the feed
        _evented_puts(store, 1, first_token=1)
        view.catch_up()
        saved = view.seq
        assert len(view.hashes) == 4
    shutil.rmtree(path)
    with ucm_db.open(path, capacity_bytes=1 << 30, engine=engine) as store:
        _evented_puts(store, 5, first_token=100)
        assert store.changes_since(saved).resync
        view.store = store
        view.catch_up()
        assert view.resyncs == 1 and view.hashes == stored_hashes(store) and len(view.hashes) == 10
    events = list(maintenance.iter_events(path, since_seq=saved))  # `ucm-db events --since SAVED`
    assert events[0]["type"] == "AllBlocksCleared" and len(events) == 11
