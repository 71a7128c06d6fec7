"""The change feed's identity (ucm_db.index.changefeed, ``feed-id``): a seq
means something only in the feed it came from. A reader that keeps a seq
across opens keeps the batch's ``feed_id`` and passes it back; a feed that
may hand its seqs out again (a store created again at the same path, a
sequence started again at 0) has another id, and the reader is told to
resync whatever the seq says. Real LMDB and RocksDB stores."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import ucm_db
from ucm_db import ChangeBatch, ConfigError, maintenance
from ucm_db.index import changefeed, records
from tests.test_changefeed import NS, FeedView, fields_for, stored_hashes

ENGINES = ["lmdb", "rocksdb"]


def _evented_puts(store: ucm_db.Store, chains: int, first_token: int = 0) -> None:
    """``chains`` chains of 2 evented blocks each (2 feed records a chain)."""
    for n in range(first_token, first_token + chains):
        tokens = [n] * 8
        keys = NS.block_keys(tokens)
        store.put(NS, keys, [b"x"] * 2, event_fields=fields_for(keys, tokens))


class CursorView(FeedView):
    """A router that keeps its cursor as (seq, feed_id), as it would in a
    file across its own restarts."""

    def _replay(self) -> int:
        inventory = self.store.event_inventory(namespace=self.namespace)
        self.hashes = {r.key: r.fields.block_hash for r in inventory.records}
        self.feed_id = inventory.feed_id
        return inventory.next_seq

    def catch_up(self) -> None:
        while True:
            batch = self.store.changes_since(self.seq, 256, namespace=self.namespace, feed_id=self.feed_id)
            if batch.resync:
                self.resyncs += 1
                self.seq = self._replay()
                continue
            for record in batch.records:
                self.apply(record)
            if batch.next_seq == self.seq:
                return
            self.seq = batch.next_seq


@pytest.fixture
def same_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every new store's feed draws the same random start: two stores made
    at one path in turn collide in seq space, as they do once in 2**20
    recreations (a chance a test cannot wait for; the start is otherwise
    the real code's). The feed ids are drawn as ever."""
    monkeypatch.setattr(changefeed.secrets, "randbelow", lambda n: 41)


@pytest.mark.parametrize("engine", ENGINES)
def test_the_feed_keeps_its_id_across_reopens(tmp_path: Path, engine: str) -> None:
    path = tmp_path / "s"
    with ucm_db.open(path, capacity_bytes=1 << 30, engine=engine) as store:
        _evented_puts(store, 1)
        inventory = store.event_inventory()
        feed_id = inventory.feed_id
        assert len(feed_id) == 32 and int(feed_id, 16) >= 0
        _evented_puts(store, 1, first_token=1)
        batch = store.changes_since(inventory.next_seq, feed_id=feed_id)
        assert not batch.resync and len(batch.records) == 2 and batch.feed_id == feed_id
        saved = batch.next_seq
    with ucm_db.open(path, engine=engine) as store:  # the same store: the cursor reads on
        _evented_puts(store, 1, first_token=2)
        batch = store.changes_since(saved, feed_id=feed_id)
        assert not batch.resync and [r.seq for r in batch.records] == [saved, saved + 1]
        assert store.event_inventory().feed_id == feed_id
    with ucm_db.open(path, engine=engine, read_only=True) as store:
        assert store.changes_since(saved, feed_id=feed_id).feed_id == feed_id


@pytest.mark.usefixtures("same_start")
@pytest.mark.parametrize("engine", ENGINES)
def test_a_cursor_saved_from_a_deleted_store_resyncs_on_the_one_made_at_its_path(tmp_path: Path, engine: str) -> None:
    """The old store handed out 4 seqs; the new one, at the same start,
    holds 10 records. The seq alone reads the new store's records from the
    cursor on: the reader misses the 4 before it and keeps the old store's
    blocks in its view. The feed id tells it to resync."""
    path = tmp_path / "s"
    with ucm_db.open(path, capacity_bytes=1 << 30, engine=engine) as store:
        _evented_puts(store, 1)
        view = CursorView(store)
        _evented_puts(store, 1, first_token=1)
        view.catch_up()
        saved_seq, saved_id = view.seq, view.feed_id
    shutil.rmtree(path)
    with ucm_db.open(path, capacity_bytes=1 << 30, engine=engine) as store:
        _evented_puts(store, 5, first_token=100)
        assert store.feed_position() > saved_seq  # the new feed passed the cursor
        assert not store.changes_since(saved_seq).resync, "the seq alone cannot tell (the default call is unchanged)"
        batch = store.changes_since(saved_seq, feed_id=saved_id)
        assert batch.resync and batch.records == () and batch.feed_id not in ("", saved_id)
        view.store = store
        view.catch_up()
        assert view.resyncs == 1 and view.hashes == stored_hashes(store) and len(view.hashes) == 10
    events = list(maintenance.iter_events(path, since_seq=saved_seq, feed_id=saved_id))  # `ucm-db events --since --feed-id`
    assert events[0] == {"type": "AllBlocksCleared", "medium": "STORAGE", "feed_id": batch.feed_id}
    assert len(events) == 11 and all(e["feed_id"] == batch.feed_id for e in events)


@pytest.mark.usefixtures("same_start")
def test_a_follower_meets_the_store_made_again_between_two_polls(tmp_path: Path) -> None:
    """``ucm-db events --follow`` opens the store anew at each poll: the
    store deleted and made again between two polls is another feed, told as
    AllBlocksCleared and the new store's inventory, even without --feed-id."""
    path = tmp_path / "s"
    with ucm_db.open(path, capacity_bytes=1 << 30) as store:
        start = store.feed_position()
        _evented_puts(store, 1)
        first_id = store.changes_since(start).feed_id
    follower = maintenance.iter_events(path, since_seq=start, follow=True, poll_interval_s=0.01, max_polls=2, with_feed_id=True)
    assert [next(follower)["seq"], next(follower)["seq"]] == [start, start + 1]
    shutil.rmtree(path)
    with ucm_db.open(path, capacity_bytes=1 << 30) as store:
        _evented_puts(store, 5, first_token=100)
        expected = {key.hex() for key in stored_hashes(store)}
    rest = list(follower)
    assert rest[0]["type"] == "AllBlocksCleared" and rest[0]["feed_id"] != first_id
    assert {e["key"] for e in rest[1:]} == expected and len(rest) == 11


def _forget_feed_id(store: ucm_db.Store) -> None:
    """The store as ucm-db before feed ids left it: no ``feed-id`` record."""
    store._engine.write(lambda txn: records.delete_checked(txn, changefeed.ID_KEY))


@pytest.mark.parametrize("engine", ENGINES)
def test_a_store_without_a_feed_id_reads_and_gets_one_at_its_first_writable_open(tmp_path: Path, engine: str) -> None:
    path = tmp_path / "s"
    with ucm_db.open(path, capacity_bytes=1 << 30, engine=engine) as store:
        start = store.feed_position()
        _evented_puts(store, 1)
        _forget_feed_id(store)
    with ucm_db.open(path, engine=engine, read_only=True) as store:  # a read-only open writes nothing, reads the feed
        inventory = store.event_inventory()
        assert inventory.feed_id == "" and len(inventory.records) == 2
        batch = store.changes_since(start, feed_id="")
        assert not batch.resync and len(batch.records) == 2 and batch.feed_id == ""
    with ucm_db.open(path, engine=engine) as store:
        feed_id = store.event_inventory().feed_id
        assert len(feed_id) == 32
        assert store.changes_since(start, feed_id="").resync, "a reader of the id-less feed resyncs once"
        assert not store.changes_since(start, feed_id=feed_id).resync
    with ucm_db.open(path, engine=engine) as store:
        assert store.event_inventory().feed_id == feed_id, "drawn once, not at every open"


def test_a_damaged_feed_id_is_named_by_verify_and_renewed_by_fix(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with ucm_db.open(path, capacity_bytes=1 << 30) as store:
        _evented_puts(store, 1)
        feed_id = store.event_inventory().feed_id
        store._engine.write(lambda txn: txn.put("info", changefeed.ID_KEY, bytes(16)))  # a flipped page: sum disagrees
        assert store.event_inventory().feed_id == ""
    problems = maintenance.verify(path).index_problems
    assert any("change feed: feed id is damaged" in line for line in problems), problems
    maintenance.verify(path, fix=True)
    with ucm_db.open(path, read_only=True) as store:
        assert store.event_inventory().feed_id not in ("", feed_id)


def test_changes_since_refuses_a_feed_id_that_is_not_a_str(tmp_path: Path) -> None:
    with ucm_db.open(tmp_path / "s", capacity_bytes=1 << 30) as store:
        with pytest.raises(ConfigError, match="feed_id must be a str or None, got bytes"):
            store.changes_since(store.feed_position(), feed_id=bytes(16))  # type: ignore[arg-type]
        position = store.feed_position()
        assert store.changes_since(position) == ChangeBatch((), position, False)  # compared as before feed ids
    with pytest.raises(ConfigError, match="without since_seq it does nothing"):
        list(maintenance.iter_events(tmp_path / "s", feed_id="ab"))
