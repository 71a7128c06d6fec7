"""The connector's KV cache events (connector/events.py, FeedEvents) keep
their seq with the feed id of the inventory it came from: a feed started
again at 0 under the open store is a withdrawal and a replay, never records
read under a seq that names others now. Real LMDB store; vLLM's event
classes; no engine."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")

from vllm.distributed.kv_events import BlockRemoved, BlockStored  # noqa: E402
from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash  # noqa: E402

import ucm_db  # noqa: E402
from ucm_db.connector.events import FeedEvents  # noqa: E402
from ucm_db.index import changefeed  # noqa: E402
from tests.test_feed_identity import _evented_puts  # noqa: E402
from tests.test_changefeed import NS, stored_hashes  # noqa: E402

pytestmark = pytest.mark.usefixtures("feed_from_zero")  # a store of code before the random start: seqs from 0


def _announced(events: FeedEvents, seen: set[object]) -> set[object]:
    """A router's view of the STORAGE blocks after a few steps (the inventory is read in a thread)."""
    for _ in range(50):
        for event in events.take():
            if isinstance(event, BlockStored):
                seen.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                seen.difference_update(event.block_hashes)
    return seen


def _lose_the_feed(store: ucm_db.Store) -> None:
    """A damaged page: the feed's head fails its checksum and its records
    are gone (a fault we cannot make otherwise). The next append rebuilds
    the head from no records: the sequence starts again at 0."""
    def run(txn) -> None:  # type: ignore[no-untyped-def]
        txn.put(changefeed.INFO, changefeed.HEAD_KEY, b"\x07" * 16)
        for name, _ in list(txn.scan(changefeed.INFO, changefeed.FEED_PREFIX)):
            txn.delete(changefeed.INFO, bytes(name))
    store._engine.write(run)


def test_a_feed_started_again_under_the_open_store_is_withdrawn_and_replayed(tmp_path: Path) -> None:
    with ucm_db.open(tmp_path / "s", capacity_bytes=1 << 30) as store:
        _evented_puts(store, 1)  # seqs 0 and 1
        events = FeedEvents(store, NS)
        seen = _announced(events, set())
        assert len(seen) == 2
        feed_id = store.event_inventory().feed_id
        _lose_the_feed(store)
        _evented_puts(store, 5, first_token=100)  # seqs 0..9 of a new sequence: past the connector's seq 2
        assert store.event_inventory().feed_id != feed_id
        expected = {maybe_convert_block_hash(BlockHash(h)) for h in stored_hashes(store).values()}  # as vLLM publishes them
        assert _announced(events, seen) == expected and len(expected) == 12, "blocks read under seqs of the old feed"
