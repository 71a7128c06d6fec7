"""A void deletes only the units its own save stored.

A ``kv_producer`` commits within the step, so its save over another rank's
failed load is deleted a step later (a void, metadata.py). The store's put
is first-writer-wins: where another engine stored those units first (the
right KV), the producer's put wrote nothing, and deleting the keys would
take the other engine's blocks (and their descendants) with it. The
audit's lost saves: the void deleted ``chain[0]`` of every save it named.

Real parts: the scheduler, the workers (TP=2), another engine's worker, a
real LMDB store, in-process and through a commit process; CPU KV tensors.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from test_failed_load_saves import _output, _random_kv_rank, _seed  # noqa: E402
from test_scheduler_worker import BS, NUM_BLOCKS, _admit, _kv, _new_step, _request, _shape  # noqa: E402

from ucm_db.connector.identity import grid, namespace, reader_spans  # noqa: E402
from ucm_db.connector.metadata import BlockTransfer, UcmDbConnectorMetadata  # noqa: E402
from ucm_db.connector.roles import RolePolicy  # noqa: E402
from ucm_db.connector.scheduler.hooks import UcmDbScheduler  # noqa: E402
from ucm_db.connector.settings import ConnectorSettings  # noqa: E402
from ucm_db.connector.worker.hooks import UcmDbWorker  # noqa: E402
from ucm_db.keys.units import unit_key  # noqa: E402

PROMPT = [7 + i for i in range(5 * BS + 3)]  # 5 full blocks
IDS = [10, 11, 12, 13, 14, 15]


def _settings(path: Path, save_process: bool, **extra: object) -> ConnectorSettings:
    return ConnectorSettings.from_extra_config({"path": str(path), "codec": "none", "save_process": save_process, **extra})


def _rank_worker(settings: ConnectorSettings, rank: int, role: str, num_blocks: int = NUM_BLOCKS) -> UcmDbWorker:
    """A TP=2 engine's rank ``rank`` (one KV head of 16 KiB a block), with random KV."""
    worker = UcmDbWorker(settings, _shape(2), num_blocks, RolePolicy(role))
    kv = _random_kv_rank() if num_blocks == NUM_BLOCKS else {name: torch.randn(num_blocks, 1, BS, 128).to(torch.bfloat16) for name in _kv()}
    worker.register_kv_caches(kv, rank, 0)
    return worker


def _kept(store: object, ns: object, units: list[bytes], theirs: list[bytearray | None]) -> list[bool]:
    """Per unit: still stored, with the bytes another engine stored."""
    return [got is not None and got == want for got, want in zip(store.get(ns, units), theirs)]  # type: ignore[attr-defined]


def _other_engine_saves(settings: ConnectorSettings, keys: list[bytes], first: int, stop: int) -> None:
    """Another engine (TP=2, rank 0: head 0) computed blocks ``[first, stop)``
    right and stored them (its own KV, so its own bytes)."""
    other = _rank_worker(settings, 0, "kv_both", max(NUM_BLOCKS, stop - first))
    transfer = BlockTransfer("other", tuple(keys[first:stop]), tuple(range(stop - first)), parent=keys[first - 1])
    other.start_load(UcmDbConnectorMetadata(step=0))
    other.save(UcmDbConnectorMetadata(step=0, saves=[transfer]))
    other.drain()
    assert other.counters.totals.data["saved_blocks"] == stop - first
    other.shutdown()


@pytest.mark.parametrize("save_process", [False, True], ids=["in-process", "commit-process"])
def test_a_producer_s_void_keeps_the_units_another_engine_stored_first(tmp_path: Path, save_process: bool) -> None:
    """TP=2 producer: rank 1's load fails, rank 0 commits its save of
    blocks 2-4, of which another engine stored 2-3 first: the void a step
    later deletes rank 0's block 4 only."""
    settings = _settings(tmp_path / "s", save_process)
    _seed(settings, {name: torch.randn(t.shape).to(torch.bfloat16) for name, t in _kv().items()}, blocks=2)
    sched = UcmDbScheduler(settings, _shape(2), RolePolicy("kv_producer"))
    workers = [_rank_worker(settings, rank, "kv_producer") for rank in (0, 1)]
    req = _request("b", PROMPT)
    assert _admit(sched, req) == 2 * BS
    meta = sched.build_connector_meta(_new_step(req, IDS, len(PROMPT) - 2 * BS))
    assert [t.block_ids for t in meta.saves] == [(12, 13, 14)] and meta.saves[0].hold_id == -1
    ns, g, spans = namespace(_shape(2)), grid(_shape(2)), reader_spans(_shape(2))
    keys = sched.keys_for(req, 5)
    head0 = [unit_key(k, spans[0], g) for k in keys]
    # Another engine stores head 0 of blocks 2-3 while ours computes them.
    _other_engine_saves(settings, keys, 2, 4)
    theirs = sched.store.get(ns, head0[2:4])
    assert all(unit is not None for unit in theirs)
    assert sched.store.delete(ns, [unit_key(keys[1], spans[1], g)]) == 1  # rank 1's load of block 1 fails
    for worker in workers:
        worker.start_load(meta)
        worker.save(meta)  # rank 0 commits block 4 (2-3 are stored); rank 1 drops its save
    assert workers[1].take_load_errors() == {11}
    assert sched.store.lookup(ns, head0, remote=False) == 5
    req.num_computed_tokens = 1 * BS
    sched.observe_output(_output(meta.step, {11}).kv_connector_worker_meta, {11})
    nxt = sched.build_connector_meta(_new_step(req, IDS, len(PROMPT) - BS))
    assert [t.block_ids for t in nxt.void_saves] == [(12, 13, 14)]
    for worker in workers:
        worker.start_load(nxt)
        worker.drain()
    assert _kept(sched.store, ns, head0[2:4], theirs) == [True, True], "the void deleted units another engine stored before our save"
    assert sched.store.lookup(ns, head0, remote=False) == 4  # our own block 4 (wrong KV) is gone
    for worker in workers:
        worker.shutdown()
    sched.shutdown()


def test_a_void_of_a_save_never_committed_deletes_nothing(tmp_path: Path) -> None:
    """A voidable save the writer never committed (too large for
    ``max_pending_save_bytes``: dropped) stored nothing: its void leaves
    the same keys, stored by another engine, as they are."""
    settings = _settings(tmp_path / "s", False, max_pending_save_bytes=1 << 20)
    _seed(settings, {name: torch.randn(t.shape).to(torch.bfloat16) for name, t in _kv().items()}, blocks=2)
    sched = UcmDbScheduler(settings, _shape(2), RolePolicy("kv_producer"))
    req = _request("b", [7 + i for i in range(100 * BS + 3)])
    assert _admit(sched, req) == 2 * BS
    keys = sched.keys_for(req, 100)
    sched.shutdown()
    ns, g, spans = namespace(_shape(2)), grid(_shape(2)), reader_spans(_shape(2))
    head0 = [unit_key(k, spans[0], g) for k in keys]
    _other_engine_saves(_settings(tmp_path / "s", False), keys, 2, 100)
    worker = _rank_worker(settings, 0, "kv_producer", 128)
    store = worker._store
    assert store is not None
    theirs = store.get(ns, head0[2:])
    assert all(unit is not None for unit in theirs)
    save = BlockTransfer("b", tuple(keys[2:]), tuple(range(12, 110)), parent=keys[1], after_loads=(10, 11), voidable=True)
    worker.start_load(UcmDbConnectorMetadata(step=1))
    worker.save(UcmDbConnectorMetadata(step=1, saves=[save]))  # 98 units of 16 KiB: over the 1 MiB bound, dropped
    assert worker.counters.totals.data["saves_dropped"] == 98
    worker.start_load(UcmDbConnectorMetadata(step=2, void_saves=[save]))
    worker.drain()
    assert all(_kept(store, ns, head0[2:], theirs)), "a void of a save never committed deleted another engine's units"
    worker.shutdown()
