"""The background writer outlives exceptions no branch of it expects
(connector/worker/writer.py; the worker audit's F5: one ``Store.stats()``
failure ended the thread, and a ``kv_producer``'s next step hung in
``drain()`` for good).

A real store throughout; the faults are injected by wrapping the store's
own ``put_segments`` and ``stats``: a store never raises them on demand.
Every wait on the writer runs in a thread with a deadline, so a writer
that died fails the test instead of hanging it."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

import ucm_db  # noqa: E402
from ucm_db.connector.metadata import BlockTransfer, UcmDbConnectorMetadata  # noqa: E402
from ucm_db.connector.metrics import Counters  # noqa: E402
from ucm_db.connector.roles import RolePolicy  # noqa: E402
from ucm_db.connector.settings import ConnectorSettings  # noqa: E402
from ucm_db.connector.worker import writer as writer_module  # noqa: E402
from ucm_db.connector.worker.hooks import UcmDbWorker  # noqa: E402
from ucm_db.connector.worker.writer import BackgroundWriter, SaveJob  # noqa: E402
from ucm_db.errors import StoreFullError, TierError  # noqa: E402
from ucm_db.keys.units import KVGrid, UnitKeys  # noqa: E402

from test_scheduler_worker import BS, _shape  # noqa: E402

UNIT_BYTES = 4096
GRID = KVGrid(heads=2, layers=1)
NS = ucm_db.Namespace(model="writer-faults", kv_dtype="uint8", block_size=4, layout="units")


def _returns(call: Callable[[], object], timeout_s: float = 30.0) -> bool:
    """Whether ``call`` returned within ``timeout_s`` (it runs on a daemon thread)."""
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(timeout_s)
    return not thread.is_alive()


def test_a_failed_stats_read_after_a_commit_leaves_a_producers_steps_going(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    settings = ConnectorSettings.from_extra_config({"path": str(tmp_path / "s"), "codec": "none", "save_process": False})
    worker = UcmDbWorker(settings, _shape(), 64, RolePolicy("kv_producer"))
    worker.register_kv_caches({f"layers.{i}.attn": torch.randn(64, 2, BS, 128).to(torch.bfloat16) for i in range(2)}, 0, 0)
    store, writer = worker._store, worker._writer
    assert store is not None and writer is not None
    real_stats, calls = store.stats, []

    def stats_failing_once() -> object:
        calls.append(1)
        if len(calls) == 1:
            raise TierError("stats: I/O error reading the info table")
        return real_stats()
    store.stats = stats_failing_once  # type: ignore[method-assign]
    writer._last_ratio_s = -10.0  # the first round reads the compression ratio

    def step(number: int, tag: int) -> None:
        keys = tuple(bytes([tag, i]) * 16 for i in range(2))
        meta = UcmDbConnectorMetadata(step=number, saves=[BlockTransfer(f"r{tag}", keys, (2 * tag, 2 * tag + 1))])
        worker.start_load(meta)
        worker.save(meta)  # a kv_producer drains the writer inside its step

    with caplog.at_level(logging.ERROR):
        assert _returns(lambda: step(0, 1))  # the stats read after this commit fails
        assert writer._thread.is_alive()
        assert _returns(lambda: step(1, 2))
    assert calls  # the fault was hit
    lost = [r.message for r in caplog.records if "the writer's round failed" in r.message]
    assert len(lost) == 1 and lost[0].startswith("ucm-db: the writer's round failed (0 blocks not saved) and it goes on: stats:")
    totals = worker.counters.totals.data
    assert totals["saved_blocks"] == 4  # both steps' saves committed; the first was counted before the stats read
    assert totals["save_errors"] == 0
    assert _returns(worker.shutdown)


def _chains(block_keys: list[bytes], start: int, stop: int) -> tuple[UnitKeys, ...]:
    return tuple(UnitKeys(block_keys, GRID, span, start, stop) for span in GRID.head_spans())


def _job(block_keys: list[bytes], start: int, stop: int, released: list[int]) -> SaveJob:
    staging = torch.from_numpy(np.full((stop - start, GRID.heads, UNIT_BYTES), start % 251, np.uint8))
    return SaveJob(NS, _chains(block_keys, start, stop), staging, release=lambda: released.append(start))


def _stored(store: ucm_db.Store, block_keys: list[bytes], start: int, stop: int) -> list[bool]:
    return [got is not None for chain in _chains(block_keys, start, stop) for got in store.get(NS, list(chain))]


class ScriptedPuts:
    """The store's real ``put_segments``, except that call ``i`` raises ``faults[i]`` where one is given."""

    def __init__(self, store: ucm_db.Store, faults: dict[int, Exception]) -> None:
        self.calls = 0
        self._faults = faults
        self._put = store.put_segments
        store.put_segments = self  # type: ignore[method-assign]

    def __call__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.calls += 1
        if self.calls in self._faults:
            raise self._faults[self.calls]
        return self._put(*args, **kwargs)


def test_an_unexpected_put_error_loses_only_the_rest_of_its_round(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(writer_module, "LINGER_S", 30.0)  # the two jobs share a round; the drain's wake ends it
    with ucm_db.open(tmp_path / "s", codec="none", capacity_bytes=1 << 30) as store:
        # Call 1 (the round's one transaction) finds the store full, so each job commits alone:
        # call 2 (blocks 0-1) commits, call 3 (blocks 2-3) raises what no branch expects.
        puts = ScriptedPuts(store, {1: StoreFullError("full"), 3: RuntimeError("a bug in a put")})
        counters, released, keys = Counters(), [], NS.block_keys(list(range(4 * 6)))
        writer = BackgroundWriter(store, lambda row: ucm_db.Framed(row, (UNIT_BYTES,)), counters, max_pending_bytes=1 << 30)
        with caplog.at_level(logging.ERROR):
            writer.submit(_job(keys, 0, 2, released))
            writer.submit(_job(keys, 2, 4, released))
            assert _returns(writer.drain)
        assert puts.calls == 3 and writer._thread.is_alive()
        assert counters.totals.data["saved_blocks"] == 2 and counters.totals.data["save_errors"] == 2
        assert sorted(released) == [0, 2]  # both stagings back, the failed job's too
        lost = [r for r in caplog.records if "the writer's round failed" in r.message]
        assert len(lost) == 1 and "2 blocks" in lost[0].message and lost[0].exc_info is not None
        # The writer goes on: a later save (blocks 2-3 again, their parent stored) commits.
        writer.submit(_job(keys, 2, 4, released))
        assert _returns(writer.drain)
        assert all(_stored(store, keys, 0, 4))
        assert counters.totals.data["saved_blocks"] == 4 and counters.totals.data["save_errors"] == 2
        assert _returns(writer.close)
