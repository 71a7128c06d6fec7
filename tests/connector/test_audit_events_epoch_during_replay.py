"""Audit (events): an epoch that moves on while the inventory replay is
still being read never announces the old epoch's blocks.

:class:`~ucm_db.connector.events.FeedEvents` reads the inventory in a
thread and waits for it at most ``_REPLAY_WAIT_S`` a step. If
``reset_cache`` (or ``ucm-db invalidate``) moves the namespace's epoch on
before that read ends, the inventory read for the old epoch arrived a step
later and its blocks were announced as ``BlockStored``, though they are
never served again (a lookup at the new epoch misses them); only the step
after withdrew them.

Real parts: a real LMDB store with evented blocks, the connector's real
``FeedEvents``. The one stand-in: the store's ``event_inventory`` is held
until the test lets it go (a wrapper that delegates everything), to make
the slow replay of a large store happen at a known step.
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

NS = Namespace(model="audit-epoch", kv_dtype="bfloat16", block_size=4)


class _HeldInventory:
    """The store, with ``event_inventory`` held until ``release`` is set."""

    def __init__(self, store: ucm_db.Store) -> None:
        self._store = store
        self.release = threading.Event()

    def event_inventory(self, **kwargs: Any) -> Any:
        assert self.release.wait(30)
        return self._store.event_inventory(**kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def _put(store: ucm_db.Store, tokens: list[int], epoch: int) -> list[bytes]:
    keys = NS.block_keys(tokens)
    fields, parent = {}, None
    for i, key in enumerate(keys):
        block_hash = bytes([epoch + 1, i]) * 8
        fields[key] = BlockEventFields(block_hash, parent, tuple(tokens[4 * i:4 * i + 4]), 4, None, None, 0, epoch)
        parent = block_hash
    store.put(NS, keys, [b"x" * 64] * len(keys), event_fields=fields)
    return [maybe_convert_block_hash(BlockHash(f.block_hash)) for f in fields.values()]  # as the events carry them


def _take_until(feed: FeedEvents, want: int) -> list[Any]:
    out: list[Any] = []
    for _ in range(400):
        out.extend(feed.take())
        if len(out) >= want:
            return out
    return out


def test_an_epoch_moved_during_the_replay_announces_no_block_of_the_old_one(tmp_path: Path) -> None:
    with ucm_db.open(tmp_path / "store") as store:
        old = _put(store, list(range(8)), epoch=0)
        held = _HeldInventory(store)
        epoch = [0]
        feed = FeedEvents(held, NS, lambda: epoch[0])  # type: ignore[arg-type]
        assert feed.take() == []  # the replay of epoch 0 is being read
        epoch[0] = 1  # reset_cache: the engine serves epoch 1 from now on
        new = _put(store, list(range(100, 108)), epoch=1)
        held.release.set()
        events = _take_until(feed, 2)
        stored = [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]
        assert not set(stored) & set(old), f"old epoch's blocks announced: {events}"
        assert sorted(stored) == sorted(new)
        for _ in range(5):  # and nothing else comes after
            assert feed.take() == []
