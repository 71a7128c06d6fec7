"""Review reproduction (b3920f2): an epoch that moves during the inventory
replay drops the read and starts another in a new thread, while the
dropped one keeps reading. With reset_cache more often than a replay of a
large store takes, the reads pile up (one whole-namespace read per move,
all at once) and none is ever used: with every read outlasting the
interval between moves, no event was ever announced. The inventory holds
every epoch's records (each filtered by epoch when it is used), so the
running read is kept and relabelled with the new epoch: one read at a
time, and the first one to end announces the epoch served then.

Real parts: a real LMDB store and the connector's real ``FeedEvents``. The
one stand-in, as in test_audit_events_epoch_during_replay.py: the store's
``event_inventory`` is held until the test lets it go (a slow replay of a
large store, at a known step).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

import ucm_db
from ucm_db import BlockEventFields, Namespace

pytest.importorskip("vllm")

from vllm.distributed.kv_events import BlockStored  # noqa: E402
from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash  # noqa: E402

from ucm_db.connector.events import FeedEvents  # noqa: E402
from test_audit_events_epoch_during_replay import _HeldInventory  # noqa: E402

NS = Namespace(model="review-epoch-threads", kv_dtype="bfloat16", block_size=4)


def _replays() -> int:
    return sum(t.name == "ucm-db-events-replay" and t.is_alive() for t in threading.enumerate())


def test_epoch_moves_during_a_replay_read_the_inventory_once_at_a_time(tmp_path: Path) -> None:
    with ucm_db.open(tmp_path / "store") as store:
        keys = NS.block_keys(list(range(8)))
        store.put(NS, keys, [b"x" * 64] * 2, event_fields={
            k: BlockEventFields(bytes([i]) * 16, None, (1, 2, 3, 4), 4, None, None, 0, 0) for i, k in enumerate(keys)})
        held = _HeldInventory(store)
        epoch = [0]
        feed = FeedEvents(held, NS, lambda: epoch[0])  # type: ignore[arg-type]
        before = _replays()
        try:
            for _ in range(4):  # a reset_cache at each step while the replay is read
                assert feed.take() == []
                epoch[0] += 1
            assert feed.take() == []
            assert _replays() - before <= 1, f"{_replays() - before} inventory reads at once"
        finally:
            held.release.set()


class _SlowInventory:
    """The store, each ``event_inventory`` call held until the test releases
    it: a replay that outlasts the interval between two epoch moves."""

    def __init__(self, store: ucm_db.Store) -> None:
        self._store = store
        self.reads: list[threading.Event] = []

    def event_inventory(self, **kwargs: Any) -> Any:
        release = threading.Event()
        self.reads.append(release)
        assert release.wait(30)
        return self._store.event_inventory(**kwargs)

    def release_all(self) -> None:
        for release in list(self.reads):
            release.set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def _put_epoch(store: ucm_db.Store, epoch: int) -> list[Any]:
    """Two evented blocks saved at ``epoch``; their hashes as events carry them."""
    keys = NS.block_keys([epoch * 8 + t for t in range(8)])
    hashes = [bytes([epoch + 1, i]) * 8 for i in range(len(keys))]
    fields = {k: BlockEventFields(h, None, (1, 2, 3, 4), 4, None, None, 0, epoch) for k, h in zip(keys, hashes)}
    store.put(NS, keys, [b"x" * 64] * 2, event_fields=fields)
    return [maybe_convert_block_hash(BlockHash(h)) for h in hashes]


def test_a_replay_outlasting_each_epoch_move_still_announces_the_epoch_served(tmp_path: Path) -> None:
    with ucm_db.open(tmp_path / "store") as store:
        blocks = {0: _put_epoch(store, 0)}
        slow = _SlowInventory(store)
        epoch = [0]
        feed = FeedEvents(slow, NS, lambda: epoch[0])  # type: ignore[arg-type]
        before = _replays()
        announced: dict[int, list[Any]] = {}
        try:
            assert feed.take() == []  # the replay of epoch 0 is being read
            for _ in range(40):  # a reset_cache at every step; each read ends only after the next move
                epoch[0] += 1
                blocks[epoch[0]] = _put_epoch(store, epoch[0])
                slow.release_all()
                stored = [h for e in feed.take() if isinstance(e, BlockStored) for h in e.block_hashes]
                assert _replays() - before <= 1, f"{_replays() - before} inventory reads at once"
                if stored:
                    announced[epoch[0]] = stored
                    break
        finally:
            slow.release_all()
        assert announced, "no block announced in 40 steps of moving epochs"
        (served, stored), = announced.items()
        assert sorted(stored) == sorted(blocks[served])  # that epoch's blocks, none of an older one
