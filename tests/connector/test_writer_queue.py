"""The background writer's queue (connector/worker/writer.py): a job that fails
loses only itself, a void lands after the saves queued before it, and close
commits what is queued.

A real store throughout; the only stand-in is a wrapper around the real
``put_segments`` that counts calls and can hold the first one, so jobs
queue up behind it as they do behind a slow commit in an engine.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

import ucm_db
from ucm_db.connector.metrics import Counters
from ucm_db.connector.worker import writer as writer_module
from ucm_db.connector.worker.voids import KEEP_STEPS, VoidJob, VoidTag
from ucm_db.connector.worker.writer import BackgroundWriter, SaveJob
from ucm_db.errors import TierError
from ucm_db.keys import BlockKeys
from ucm_db.keys.units import KVGrid, UnitKeys

UNIT_BYTES = 4096
GRID = KVGrid(heads=2, layers=1)
NS = ucm_db.Namespace(model="writer-groups", kv_dtype="uint8", block_size=4, layout="units")


class HeldPuts:
    """The store's real ``put_segments``, counted; the first call waits for :meth:`release`."""

    def __init__(self, store: ucm_db.Store) -> None:
        self.calls = 0
        self.entered = threading.Event()
        self._gate = threading.Event()
        self._put = store.put_segments
        store.put_segments = self  # type: ignore[method-assign]

    def __call__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.calls += 1
        if self.calls == 1:
            self.entered.set()
            assert self._gate.wait(30), "the test never released the first commit"
        return self._put(*args, **kwargs)

    def release(self) -> None:
        self._gate.set()


@pytest.fixture
def store(tmp_path):
    with ucm_db.open(tmp_path / "s", codec="none", capacity_bytes=1 << 30) as opened:
        yield opened


def _chains(block_keys: list[bytes], start: int, stop: int) -> tuple[UnitKeys, ...]:
    return tuple(UnitKeys(block_keys, GRID, span, start, stop) for span in GRID.head_spans())


def _job(block_keys: list[bytes], start: int, stop: int, released: list[int], void_tag: VoidTag | None = None) -> SaveJob:
    staging = torch.from_numpy(np.full((stop - start, GRID.heads, UNIT_BYTES), start % 251, np.uint8))
    return SaveJob(NS, _chains(block_keys, start, stop), staging, release=lambda: released.append(start), void_tag=void_tag)


def _present(store: ucm_db.Store, block_keys: list[bytes], start: int, stop: int) -> list[bool]:
    """Per unit of blocks ``[start, stop)``, every head: stored or not."""
    return [got is not None for chain in _chains(block_keys, start, stop) for got in store.get(NS, list(chain))]


def _stored(store: ucm_db.Store, block_keys: list[bytes], start: int, stop: int) -> bool:
    return all(_present(store, block_keys, start, stop))


def _writer(store: ucm_db.Store, counters: Counters) -> BackgroundWriter:
    """A writer over ``store`` framing each staged unit as one frame, its queue bound out of the way."""
    return BackgroundWriter(store, lambda row: ucm_db.Framed(row, (UNIT_BYTES,)), counters, max_pending_bytes=1 << 30)


class Held:
    """A writer over ``store`` whose first job (blocks 0-1 of ``keys``) is
    committing and held there, so the jobs the test submits next queue up."""

    def __init__(self, store: ucm_db.Store, blocks: int) -> None:
        self.keys = NS.block_keys(list(range(4 * blocks)))
        self.puts, self.counters, self.released = HeldPuts(store), Counters(), []
        self.writer = _writer(store, self.counters)
        self.save(0, 2)
        assert self.puts.entered.wait(30)

    def save(self, start: int, stop: int, void_tag: VoidTag | None = None) -> None:
        self.writer.submit(_job(self.keys, start, stop, self.released, void_tag))

    def release_and_drain(self) -> None:
        self.puts.release()
        self.writer.drain()
        self.writer.close()


def test_queued_jobs_behind_a_commit_lose_only_the_orphan(store) -> None:
    held = Held(store, 12)
    held.save(2, 4)
    held.save(6, 8)  # its parent (block 5) is never saved
    held.save(4, 5)
    held.release_and_drain()
    assert _stored(store, held.keys, 0, 5)
    assert not any(_present(store, held.keys, 6, 8))
    assert held.counters.totals.data["saved_blocks"] == 5 and held.counters.totals.data["save_errors"] == 2
    assert sorted(held.released) == [0, 2, 4, 6]


def test_jobs_queued_behind_a_commit_take_one_transaction(store) -> None:
    """Issue 50 item 3: a backlog costs one commit per writer round, not
    one per engine step; every job's blocks land and each staging goes back."""
    held = Held(store, 8)
    for start in (2, 4, 6):
        held.save(start, start + 2)
    held.release_and_drain()
    assert held.puts.calls == 2  # the held job's, then one for the three queued behind it
    assert _stored(store, held.keys, 0, 8)
    assert held.counters.totals.data["saved_blocks"] == 8 and held.counters.totals.data["save_errors"] == 0
    assert sorted(held.released) == [0, 2, 4, 6]


def test_a_void_between_saves_keeps_queue_order(store) -> None:
    held = Held(store, 8)
    tag = VoidTag(("r", held.keys[2], 2), step=1)
    held.save(2, 4, tag)
    held.writer.void(VoidJob(NS, tag.save, blocks=2, step=2))  # after the save queued before it
    held.save(4, 6)  # after the void: its parent is gone, so it is skipped
    held.save(2, 3)
    held.release_and_drain()
    assert _stored(store, held.keys, 0, 3)
    assert not any(_present(store, held.keys, 3, 6))


def _others(store: ucm_db.Store, block_keys: list[bytes], start: int, stop: int) -> list[bytearray | None]:
    """Another engine stores every head's units of blocks ``[start, stop)`` (its bytes: 0xEE); returns them as read."""
    for chain in _chains(block_keys, start, stop):
        store.put_segments(NS, [(BlockKeys(list(chain), parent=chain.parent()), [b"\xee" * UNIT_BYTES] * len(chain))])
    return [got for chain in _chains(block_keys, start, stop) for got in store.get(NS, list(chain))]


def _units(store: ucm_db.Store, block_keys: list[bytes], start: int, stop: int) -> list[bytearray | None]:
    return [got for chain in _chains(block_keys, start, stop) for got in store.get(NS, list(chain))]


def test_a_void_deletes_only_what_its_save_stored(store) -> None:
    """First writer wins: blocks 2-3 were stored by another engine before
    our save of 2-5, which stored only 4-5; its void deletes 4-5 alone."""
    keys, released = NS.block_keys(list(range(4 * 8))), []
    writer = _writer(store, Counters())
    writer.submit(_job(keys, 0, 2, released))
    writer.drain()
    theirs = _others(store, keys, 2, 4)
    tag = VoidTag(("r", keys[2], 4), step=1)
    writer.submit(_job(keys, 2, 6, released, tag))
    writer.void(VoidJob(NS, tag.save, blocks=4, step=2))
    writer.drain()
    writer.close()
    assert _units(store, keys, 2, 4) == theirs
    assert not any(_present(store, keys, 4, 6))


def test_a_void_of_a_save_that_stored_nothing_deletes_nothing(store) -> None:
    """Every unit stored already (another engine's), or the save lost
    (its parent gone): its void leaves the store as it is."""
    keys, released = NS.block_keys(list(range(4 * 8))), []
    writer = _writer(store, Counters())
    writer.submit(_job(keys, 0, 2, released))
    writer.drain()
    theirs = _others(store, keys, 2, 6)
    present, orphan = VoidTag(("r", keys[2], 4), step=1), VoidTag(("o", keys[7], 1), step=1)
    writer.submit(_job(keys, 2, 6, released, present))
    writer.submit(_job(keys, 7, 8, released, orphan))  # block 6 is not stored: refused
    writer.void(VoidJob(NS, present.save, blocks=4, step=2))
    writer.void(VoidJob(NS, orphan.save, blocks=1, step=2))
    writer.drain()
    writer.close()
    assert _units(store, keys, 2, 6) == theirs


def test_a_put_that_raised_after_its_commit_counts_as_stored_for_its_void(store) -> None:
    """A write-through upload that fails raises after the local commit: the
    writer cannot know what that put stored, so its void deletes every
    unit the save named (wrong KV left stored is worse than a lost save)."""
    keys, released, counters = NS.block_keys(list(range(4 * 8))), [], Counters()
    writer = _writer(store, counters)
    writer.submit(_job(keys, 0, 2, released))
    writer.drain()
    real = store.put_segments

    def committed_then_failed(*args, **kwargs):  # type: ignore[no-untyped-def]
        real(*args, **kwargs)
        raise TierError("write-through upload of 4 block(s) failed", hint="")

    store.put_segments = committed_then_failed  # type: ignore[method-assign]
    tag = VoidTag(("r", keys[2], 2), step=1)
    writer.submit(_job(keys, 2, 4, released, tag))
    writer.drain()
    store.put_segments = real  # type: ignore[method-assign]
    assert _stored(store, keys, 2, 4) and counters.totals.data["save_errors"] == 2
    writer.void(VoidJob(NS, tag.save, blocks=2, step=2))
    writer.drain()
    writer.close()
    assert not any(_present(store, keys, 2, 4)) and _stored(store, keys, 0, 2)


def test_a_record_no_void_takes_is_forgotten_after_keep_steps(store) -> None:
    keys, released = NS.block_keys(list(range(4 * 8))), []
    writer = _writer(store, Counters())
    old, new = VoidTag(("a", keys[0], 2), step=1), VoidTag(("b", keys[2], 2), step=1 + KEEP_STEPS + 1)
    writer.submit(_job(keys, 0, 2, released, old))
    writer.submit(_job(keys, 2, 4, released, new))
    writer.drain()
    assert list(writer._voids._records) == [new.save]  # type: ignore[attr-defined]
    writer.void(VoidJob(NS, old.save, blocks=2, step=new.step))  # too late: nothing deleted
    writer.drain()
    writer.close()
    assert _stored(store, keys, 0, 4)


def test_close_behind_queued_jobs_commits_them_and_stops(store) -> None:
    held = Held(store, 6)
    held.save(2, 4)
    closer = threading.Thread(target=held.writer.close)
    closer.start()
    held.puts.release()
    closer.join(30)
    assert not closer.is_alive(), "close must return once the queue is committed"
    assert _stored(store, held.keys, 0, 4)


def _leased_job(pool: object, block_keys: list[bytes], start: int, stop: int) -> SaveJob:
    from ucm_db.connector.worker.staging import StagingPool

    assert isinstance(pool, StagingPool)
    lease = pool.take(stop - start)
    lease.staging.fill_(start % 251)
    return SaveJob(NS, _chains(block_keys, start, stop), lease.staging, release=lease.release, held_bytes=lease.held_bytes)


def test_the_queue_bound_counts_the_staging_buffers_the_jobs_hold(store) -> None:
    """Issue 46 finding 9: the bound counted lease views, not their
    power-of-two buffers (a 16 MiB bound held 28 MiB). Jobs of 3 blocks
    hold 4 blocks' buffers: a bound of 10 blocks' rows takes two of them."""
    from ucm_db.connector.worker.staging import StagingPool

    block_bytes = GRID.heads * UNIT_BYTES
    pool = StagingPool(lambda rows: torch.empty((rows, GRID.heads, UNIT_BYTES), dtype=torch.uint8), 1 << 30)
    keys = NS.block_keys(list(range(4 * 12)))
    puts, counters = HeldPuts(store), Counters()
    writer = BackgroundWriter(store, lambda row: ucm_db.Framed(row, (UNIT_BYTES,)), counters,
                              max_pending_bytes=10 * block_bytes)
    accepted = [writer.submit(_leased_job(pool, keys, start, start + 3)) for start in (0, 3, 6)]
    assert puts.entered.wait(30)
    assert accepted == [True, True, False]  # 3 x 4 blocks' buffers would exceed 10 blocks' rows
    assert counters.totals.data["saves_dropped"] == 3
    puts.release()
    writer.drain()
    writer.close()
    assert _stored(store, keys, 0, 6) and not any(_present(store, keys, 6, 9))


def test_a_save_larger_than_the_bound_is_logged_once_with_the_fix(store, caplog: pytest.LogCaptureFixture) -> None:
    """A save larger than the whole bound is dropped on every try: the first
    one says so, with the setting to raise; later ones only count."""
    import logging

    keys = NS.block_keys(list(range(4 * 8)))
    counters = Counters()
    writer = BackgroundWriter(store, lambda row: ucm_db.Framed(row, (UNIT_BYTES,)), counters,
                              max_pending_bytes=GRID.heads * UNIT_BYTES)
    released: list[int] = []
    with caplog.at_level(logging.WARNING):
        assert not writer.submit(_job(keys, 0, 4, released))
        assert not writer.submit(_job(keys, 4, 8, released))
    writer.close()
    said = [r.getMessage() for r in caplog.records if "max_pending_save_bytes" in r.getMessage()]
    assert len(said) == 1 and "raise max_pending_save_bytes above" in said[0], said
    assert counters.totals.data["saves_dropped"] == 8 and released == [0, 4]


def _puts_counted(store: ucm_db.Store) -> list[int]:
    """The store's real ``put_segments``, each call's job count appended (no holding)."""
    calls: list[int] = []
    real = store.put_segments

    def counted(namespace, segments, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(len(segments))
        return real(namespace, segments, **kwargs)

    store.put_segments = counted  # type: ignore[method-assign]
    return calls


def _lingering(store: ucm_db.Store) -> tuple[BackgroundWriter, list[bytes], list[int], list[int]]:
    """A writer given the job of blocks 0-1, 0.1 s ago: it took it and lingers.
    Returns the writer, the block keys, the released staging starts and the put calls."""
    calls = _puts_counted(store)
    keys, released = NS.block_keys(list(range(16))), []
    writer = _writer(store, Counters())
    writer.submit(_job(keys, 0, 2, released))
    time.sleep(0.1)
    return writer, keys, released, calls


def test_a_job_arriving_within_the_linger_shares_the_rounds_commit(store, monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps that each save a block (decoding) share one commit: the round
    waits for more jobs when its queue runs dry, and commits when the linger ends."""
    # The second job must arrive within the linger: 0.1 s after the writer
    # took the first (_lingering), plus however long a loaded host takes
    # over the submit. The round commits when the linger ends, so the test
    # waits it out: 2 s costs 2 s and leaves 1.9 s of slack.
    monkeypatch.setattr(writer_module, "LINGER_S", 2.0)
    writer, keys, released, calls = _lingering(store)
    try:
        writer.submit(_job(keys, 2, 4, released))
        deadline = time.monotonic() + 10
        # Staging goes back once the commit returned: a moment after the blocks are readable.
        while not (_stored(store, keys, 0, 4) and len(released) == 2) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _stored(store, keys, 0, 4)
        assert calls == [GRID.heads]  # one transaction: both jobs' chains, one segment a head (the second continues the first)
        assert sorted(released) == [0, 2]
    finally:
        writer.close()


def test_a_drain_ends_the_linger_at_once(store, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``kv_producer``'s step drains after its save: it must not wait for the linger."""
    monkeypatch.setattr(writer_module, "LINGER_S", 30.0)
    writer, keys, released, calls = _lingering(store)
    try:
        started = time.monotonic()
        writer.drain()
        assert time.monotonic() - started < 10, "drain waited for the linger"
        assert _stored(store, keys, 0, 2) and calls == [GRID.heads]
        writer.submit(_job(keys, 2, 4, released))  # the writer goes on after a drain
        writer.drain()
        assert _stored(store, keys, 0, 4) and calls == [GRID.heads, GRID.heads]
    finally:
        started = time.monotonic()
        writer.close()
        assert time.monotonic() - started < 10, "close waited for the linger"


def test_the_connector_setting_bounds_the_workers_queue(tmp_path) -> None:
    """``max_pending_save_bytes`` (README: beyond it saves are dropped and
    counted) reaches the worker's writer: a 40-block save (1.25 MiB of
    units) is dropped under a 1 MiB bound and committed under the default."""
    pytest.importorskip("vllm")
    from test_scheduler_worker import BS, NUM_BLOCKS, _admit, _kv, _new_step, _request, _shape

    from ucm_db.connector.scheduler.hooks import UcmDbScheduler
    from ucm_db.connector.settings import ConnectorSettings
    from ucm_db.connector.worker.hooks import UcmDbWorker

    def save_40_blocks(path, **bound: int) -> tuple[int, int]:
        settings = ConnectorSettings.from_extra_config({"path": str(path), "codec": "none", **bound})
        sched, worker = UcmDbScheduler(settings, _shape()), UcmDbWorker(settings, _shape(), NUM_BLOCKS)
        worker.register_kv_caches(_kv(), 0, 0)
        req = _request("big", list(range(40 * BS + 1)))
        assert _admit(sched, req) == 0
        worker.save(sched.build_connector_meta(_new_step(req, list(range(41)), 40 * BS + 1)))
        worker.drain()
        dropped = worker.counters.take().data.get("saves_dropped", 0)
        blocks = sched.store.stats().blocks
        worker.shutdown()
        sched.shutdown()
        return dropped, blocks

    assert ConnectorSettings.from_extra_config({"path": str(tmp_path)}).max_pending_save_bytes == 1 << 30
    assert save_40_blocks(tmp_path / "bounded", max_pending_save_bytes=1 << 20) == (40, 0)
    assert save_40_blocks(tmp_path / "default") == (0, 40 * 2)  # one unit per KV head
