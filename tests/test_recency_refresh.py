"""A block read again soon after this process wrote its recency is not
written again at once: the maintenance rounds keep its touch back until
``RECENCY_REFRESH_S`` passed, then write the newest touch with every
round's hit; an evicting put, a flush and a close take what is kept back
(real LMDB and RocksDB stores; the rounds are called by hand, the thread's
interval is an hour; the refresh interval runs on a clock the test moves)."""

from __future__ import annotations

import time

import pytest

import ucm_db
from ucm_db import Namespace
from ucm_db.store import background

NS = Namespace(model="recency-refresh", kv_dtype="bfloat16", block_size=4)
BLOCK_BYTES = 256 << 10
REFRESH_S = 0.6


def chain(seed: int, blocks: int) -> ucm_db.BlockKeys:
    return NS.block_keys([seed * 1000 + t for t in range(4 * blocks)])


def block(i: int) -> bytes:
    return bytes([i % 251]) * BLOCK_BYTES


class _Clock:
    """The maintenance module's ``time``: ``monotonic`` stands still until
    the test moves it on, the rest is the real module's. The refresh
    halves rotate on this clock from the store's open, so what is kept
    back does not depend on how long the machine takes over the reads and
    puts between two rounds."""

    def __init__(self) -> None:
        self.now_s = time.monotonic()

    def monotonic(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(time, name)


@pytest.fixture()
def clock(monkeypatch) -> _Clock:
    fake = _Clock()
    monkeypatch.setattr(background, "time", fake)
    return fake


@pytest.fixture(params=["lmdb", "rocksdb"])
def store(tmp_path, request, monkeypatch, clock):
    monkeypatch.setattr(background, "RECENCY_REFRESH_S", REFRESH_S)
    options = dict(codec="none", capacity_bytes=6 * BLOCK_BYTES + 4000, engine=request.param, sync_interval_s=3600.0)
    with ucm_db.open(tmp_path / "s", **options) as s:
        yield s


def index_of(store, keys) -> list[tuple[int, int]]:
    """(recency ns, hits) of each block as the index holds them."""
    return [(meta.access_ns, meta.hits) for meta in store._tier.metas(list(keys))]


def round_(store) -> None:
    store._activity.flush_activity(keep_back_recent=True)  # a maintenance round


def test_a_block_read_again_is_written_once_a_refresh_interval_with_every_round_s_hit(store, clock) -> None:
    a = chain(1, 2)
    store.put(NS, a, [block(0), block(1)])
    store.get(NS, a)
    round_(store)
    (first_ns, hits), _ = index_of(store, a)
    assert hits == 1
    for _ in range(3):  # read again in three rounds, well within the refresh interval
        store.get(NS, a)
        round_(store)
    assert index_of(store, a)[0] == (first_ns, 1)  # kept back: nothing written
    last_read_ns = time.time_ns()
    clock.advance(REFRESH_S * 1.05)
    round_(store)  # now due: the newest touch, and the three rounds' hits
    access_ns, hits = index_of(store, a)[0]
    assert hits == 4 and first_ns < access_ns <= last_read_ns


def test_an_evicting_put_takes_the_touches_kept_back(store) -> None:
    old = chain(1, 1)
    store.put(NS, old, [block(0)])
    store.get(NS, old)
    round_(store)  # old's recency written: its next touches are kept back
    time.sleep(0.002)
    others = [chain(10 + j, 1) for j in range(5)]
    for j, keys in enumerate(others):
        store.put(NS, keys, [block(10 + j)])
        time.sleep(0.002)
    store.get(NS, old)  # read again: newer than every other block
    round_(store)
    assert index_of(store, old)[0][1] == 1  # kept back
    store.put(NS, chain(99, 1), [block(99)])  # full: one block goes, and not the one just read
    assert store.lookup(NS, old) == 1
    assert [store.lookup(NS, keys) for keys in others] == [0, 1, 1, 1, 1]
    assert index_of(store, old)[0][1] == 2


def test_a_flush_and_a_close_write_the_touches_kept_back(store, tmp_path) -> None:
    a = chain(1, 1)
    store.put(NS, a, [block(0)])
    store.get(NS, a)
    round_(store)
    store.get(NS, a)
    round_(store)
    assert index_of(store, a)[0][1] == 1
    store.flush()
    assert index_of(store, a)[0][1] == 2
    store.get(NS, a)
    round_(store)  # kept back: a round wrote its recency a moment ago
    engine = store.config.engine
    store.close()
    with ucm_db.open(tmp_path / "s", engine=engine) as reopened:
        assert [meta.hits for meta in reopened._tier.metas(list(a))] == [3]
