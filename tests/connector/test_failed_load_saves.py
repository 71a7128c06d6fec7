"""A sync load that fails mid-step never leaves wrong KV in the store.

vLLM runs a step's forward pass before it learns that a block failed to
load, so the KV computed in that step after the failed block is wrong
(it attended to a stale slot). The connector must not store it under the
keys of the right tokens: the worker that saw the failure drops the save,
the other ranks delete theirs when the scheduler voids it a step later,
and the scheduler re-plans the save of what vLLM recomputes.

Real vLLM request objects, a real store, CPU KV tensors; no engine (the
failure is produced for real: a unit is deleted between lookup and load,
as an eviction by another engine would).
"""

from __future__ import annotations

import types
from typing import Any
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from test_scheduler_worker import BS, NUM_BLOCKS, _admit, _kv, _new_step, _request, _shape  # noqa: E402

from ucm_db.connector.identity import grid, namespace, reader_spans  # noqa: E402
from ucm_db.connector.metadata import UcmDbWorkerMetadata  # noqa: E402
from ucm_db.connector.roles import RolePolicy  # noqa: E402
from ucm_db.connector.scheduler.hooks import UcmDbScheduler  # noqa: E402
from ucm_db.connector.settings import ConnectorSettings  # noqa: E402
from ucm_db.connector.worker.hooks import UcmDbWorker  # noqa: E402
from ucm_db.keys.units import unit_key  # noqa: E402

PROMPT = [7 + i for i in range(5 * BS + 3)]  # 5 full blocks
IDS = [10, 11, 12, 13, 14, 15]  # the blocks vLLM allocates for it


def _random_kv() -> dict[str, torch.Tensor]:
    return {name: torch.randn(t.shape).to(torch.bfloat16) for name, t in _kv().items()}


def _worker(settings: ConnectorSettings, kv: dict[str, torch.Tensor], tp_size: int = 1, rank: int = 0, role: str = "kv_both") -> UcmDbWorker:
    worker = UcmDbWorker(settings, _shape(tp_size), NUM_BLOCKS, RolePolicy(role))
    worker.register_kv_caches(kv, rank, 0)
    return worker


def _seed(settings: ConnectorSettings, kv: dict[str, torch.Tensor], blocks: int) -> None:
    """A first engine computed and saved the prompt's first ``blocks`` blocks (ids 0..)."""
    sched = UcmDbScheduler(settings, _shape())
    worker = _worker(settings, kv)
    req = _request("seed", PROMPT[: blocks * BS + 1])
    assert _admit(sched, req) == 0
    ids = list(range(blocks + 1))
    worker.save(sched.build_connector_meta(_new_step(req, ids, blocks * BS + 1)))
    worker.drain()
    sched.request_finished(req, ids)
    worker.shutdown()
    # Its uploads land before this engine goes: a store's close abandons remote calls in flight, and one landing
    # after a later test step removed its object from the remote would bring the object back.
    sched.store.flush(upload_timeout_s=30)
    sched.shutdown()


def _output(step: int, invalid: set[int]) -> types.SimpleNamespace:
    from ucm_db.connector.metadata import UcmDbWorkerMetadata

    return types.SimpleNamespace(kv_connector_worker_meta=UcmDbWorkerMetadata(step), invalid_block_ids=invalid)


@pytest.fixture()
def settings(tmp_path: Path) -> ConnectorSettings:
    return ConnectorSettings.from_extra_config({"path": str(tmp_path / "store"), "codec": "none"})


def test_failed_load_drops_the_step_s_saves_and_the_recompute_is_saved(settings: ConnectorSettings) -> None:
    good = _random_kv()
    sched, (worker,), (kv,), req = _admitted(settings, seed_kv=good)
    ns, g, spans = namespace(_shape()), grid(_shape()), reader_spans(_shape())
    ids = IDS
    meta = sched.build_connector_meta(_new_step(req, ids, len(PROMPT) - 2 * BS))
    assert [t.block_ids for t in meta.loads] == [(10, 11)] and [t.block_ids for t in meta.saves] == [(12, 13, 14)]
    assert meta.saves[0].after_loads == (10, 11)
    assert not meta.saves[0].voidable, "one rank's save over its own loads is dropped by its worker, never voided"
    # Another engine evicts one head's unit of block 1 between lookup and load.
    assert sched.store.delete(ns, [unit_key(meta.loads[0].keys[1], spans[1], g)]) == 1
    worker.start_load(meta)
    for t in kv.values():
        t[12:15] = 99.0  # the forward pass: blocks 2-4 computed over the stale block 11
    worker.save(meta)
    worker.drain()
    assert worker.take_load_errors() == {11}
    assert worker.counters.take().data["saves_voided"] == 3
    keys = sched.keys_for(req, 5)
    assert sched.store.lookup(ns, [unit_key(k, spans[0], g) for k in keys], remote=False) == 2  # blocks 2-4 not stored

    # vLLM: recompute from block 1 (its output reports the failure after moving the request back).
    req.num_computed_tokens = 1 * BS
    sched.observe_output(_output(meta.step, {11}).kv_connector_worker_meta, {11})
    req.num_computed_tokens = len(PROMPT)  # the next step recomputes blocks 1-4 (and the tail)
    again = sched.build_connector_meta(_new_step(req, ids, len(PROMPT) - BS))
    assert [t.block_ids for t in again.saves] == [(11, 12, 13, 14)]
    assert again.void_saves == []  # one rank: its own drop was enough
    for t in kv.values():
        t[11:15] = good[next(iter(good))][0:1]  # stand-in for the right KV, now computed
    worker.start_load(again)
    worker.save(again)
    worker.drain()
    assert sched.store.lookup(ns, [unit_key(k, spans[1], g) for k in keys], remote=False) == 5
    worker.shutdown()
    sched.shutdown()


def test_with_several_ranks_a_save_over_a_load_waits_for_every_rank_s_verdict(settings: ConnectorSettings) -> None:
    """TP=2: rank 0 loads its heads, rank 1 fails. Rank 0 cannot know, and
    its heads' KV depends on rank 1's through the layers: it holds the
    step's save and discards it when the scheduler's verdict comes."""
    sched, workers, _, req = _admitted(settings, tp=2)
    ids = IDS
    meta = sched.build_connector_meta(_new_step(req, ids, len(PROMPT) - 2 * BS))
    ns, g, spans = namespace(_shape(2)), grid(_shape(2)), reader_spans(_shape(2))
    assert [t.hold_id for t in meta.saves] == [0]
    assert sched.store.delete(ns, [unit_key(meta.loads[0].keys[1], spans[1], g)]) == 1  # rank 1's head
    for worker in workers:
        worker.start_load(meta)
        worker.save(meta)
        worker.drain()
    assert [w.take_load_errors() for w in workers] == [set(), {11}]
    keys = sched.keys_for(req, 5)
    head0 = [unit_key(k, spans[0], g) for k in keys]
    assert sched.store.lookup(ns, head0, remote=False) == 2  # nothing committed yet

    req.num_computed_tokens = 1 * BS
    sched.observe_output(_output(meta.step, {11}).kv_connector_worker_meta, {11})
    nxt = sched.build_connector_meta(_new_step(req, ids, len(PROMPT) - BS))
    assert (nxt.held_commits, nxt.held_drops) == ([], [0])
    for worker in workers:
        worker.start_load(nxt)
        worker.drain()
    assert sched.store.lookup(ns, head0, remote=False) == 2  # rank 0's wrong blocks 2-4 were never stored
    assert workers[0].counters.take().data["saves_voided"] == 3
    for worker in workers:
        worker.shutdown()
    sched.shutdown()


def test_with_several_ranks_a_held_save_commits_when_every_load_held(settings: ConnectorSettings) -> None:
    sched, workers, _, req = _admitted(settings, tp=2)
    ids = IDS
    meta = sched.build_connector_meta(_new_step(req, ids, len(PROMPT) - 2 * BS))
    ns, g, spans = namespace(_shape(2)), grid(_shape(2)), reader_spans(_shape(2))
    for worker in workers:
        worker.start_load(meta)
        worker.save(meta)
    sched.observe_output(_output(meta.step, set()).kv_connector_worker_meta, set())
    req.num_computed_tokens = len(PROMPT)
    nxt = sched.build_connector_meta(_new_step(req, ids, 1))
    assert (nxt.held_commits, nxt.held_drops) == ([0], [])
    for worker in workers:
        worker.start_load(nxt)
        worker.drain()
    keys = sched.keys_for(req, 5)
    assert all(sched.store.lookup(ns, [unit_key(k, span, g) for k in keys], remote=False) == 5 for span in spans)
    for worker in workers:
        worker.shutdown()
    sched.shutdown()


def test_a_producer_s_save_over_another_rank_s_failed_load_is_deleted_a_step_later(settings: ConnectorSettings) -> None:
    """A kv_producer commits within the step (its consumers read what it
    announces), so it cannot hold: rank 0 commits, and deletes its units
    when the next step's metadata voids them. Rank 1's units of those
    blocks were never stored, so no reader could load them meanwhile."""
    sched, workers, _, req = _admitted(settings, tp=2, role="kv_producer")
    meta = sched.build_connector_meta(_new_step(req, IDS, len(PROMPT) - 2 * BS))
    assert [t.hold_id for t in meta.saves] == [-1]
    ns, g, spans = namespace(_shape(2)), grid(_shape(2)), reader_spans(_shape(2))
    assert sched.store.delete(ns, [unit_key(meta.loads[0].keys[1], spans[1], g)]) == 1  # rank 1's head
    for worker in workers:
        worker.start_load(meta)
        worker.save(meta)
    keys = sched.keys_for(req, 5)
    head0 = [unit_key(k, spans[0], g) for k in keys]
    assert sched.store.lookup(ns, head0, remote=False) == 5
    assert sched.store.lookup(ns, [unit_key(k, spans[1], g) for k in keys], remote=False) == 1
    req.num_computed_tokens = 1 * BS
    sched.observe_output(_output(meta.step, {11}).kv_connector_worker_meta, {11})
    nxt = sched.build_connector_meta(_new_step(req, IDS, len(PROMPT) - BS))
    assert [t.block_ids for t in nxt.void_saves] == [(12, 13, 14)]
    for worker in workers:
        worker.start_load(nxt)
        worker.drain()
    assert sched.store.lookup(ns, head0, remote=False) == 2
    for worker in workers:
        worker.shutdown()
    sched.shutdown()


def test_a_step_planned_before_the_last_output_does_not_save_over_its_failed_load(settings: ConnectorSettings) -> None:
    """Async scheduling: step N+1 is planned before step N's output is back.
    Its save is computed over N's load, which failed: the worker, which saw
    the failure in step N, drops it (TP=1: nothing is held)."""
    sched, (worker,), (kv,), req = _admitted(settings)
    ns, g, spans = namespace(_shape()), grid(_shape()), reader_spans(_shape())
    ids = IDS
    step_n = sched.build_connector_meta(_new_step(req, ids, 10))  # loads blocks 0-1, computes 10 tokens: no full block
    assert step_n.saves == []
    assert sched.store.delete(ns, [unit_key(step_n.loads[0].keys[0], spans[1], g)]) == 2  # head 1 of blocks 0 and 1
    worker.start_load(step_n)
    worker.save(step_n)
    assert worker.take_load_errors() == {10, 11}
    req.num_computed_tokens = 2 * BS + 10
    step_n1 = sched.build_connector_meta(_new_step(req, ids, len(PROMPT) - 2 * BS - 10))  # planned before N's output
    assert [t.block_ids for t in step_n1.saves] == [(12, 13, 14)] and step_n1.saves[0].after_loads == (10, 11)
    for t in kv.values():
        t[12:15] = 99.0
    worker.start_load(step_n1)
    worker.save(step_n1)
    worker.drain()
    keys = sched.keys_for(req, 5)
    assert sched.store.lookup(ns, [unit_key(k, spans[0], g) for k in keys], remote=False) == 2  # blocks 2-4 not stored
    worker.shutdown()
    sched.shutdown()


def test_a_step_whose_loads_hold_voids_nothing(settings: ConnectorSettings) -> None:
    sched, (worker,), _, req = _admitted(settings)
    ids = IDS
    meta = sched.build_connector_meta(_new_step(req, ids, len(PROMPT) - 2 * BS))
    worker.start_load(meta)
    worker.save(meta)
    worker.drain()
    assert worker.take_load_errors() == set()
    sched.observe_output(_output(meta.step, set()).kv_connector_worker_meta, set())
    req.num_computed_tokens = len(PROMPT)
    nxt = sched.build_connector_meta(_new_step(req, ids, 1))
    assert nxt.void_saves == [] and nxt.saves == []
    ns, g, spans = namespace(_shape()), grid(_shape()), reader_spans(_shape())
    assert sched.store.lookup(ns, [unit_key(k, spans[1], g) for k in sched.keys_for(req, 5)], remote=False) == 5
    worker.shutdown()
    sched.shutdown()


def _admitted(
    settings: ConnectorSettings, tp: int = 1, seed_kv: dict[str, torch.Tensor] | None = None, role: str = "kv_both",
) -> tuple[UcmDbScheduler, list[UcmDbWorker], list[dict[str, torch.Tensor]], Any]:
    """Blocks 0-1 of PROMPT stored by a first engine; then a TP=``tp``
    engine's scheduler and workers (with their caches) that admitted
    request "b" (a 2-block hit, to be loaded into blocks 10-11 of IDS)."""
    _seed(settings, seed_kv if seed_kv is not None else _random_kv(), blocks=2)
    sched = UcmDbScheduler(settings, _shape(tp), RolePolicy(role))
    caches = [_random_kv() if tp == 1 else _random_kv_rank() for _ in range(tp)]
    workers = [_worker(settings, kv, tp, rank, role) for rank, kv in enumerate(caches)]
    req = _request("b", PROMPT)
    assert _admit(sched, req) == 2 * BS
    return sched, workers, caches, req


def _random_kv_rank() -> dict[str, torch.Tensor]:
    """A TP=2 rank's caches: one of the two KV heads."""
    return {name: torch.randn(NUM_BLOCKS, 1, BS, 128).to(torch.bfloat16) for name in _kv()}


# -- vLLM's prefix cache after a failed load ---------------------------------------


def _prefix_cache() -> tuple[Any, Any]:
    """vLLM's own KV cache manager over the test caches' blocks (prefix
    caching on), and the block hasher its scheduler gives each request."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    init_none_hash(sha256)
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(list(_kv()), spec)])
    manager = KVCacheManager(config, max_model_len=NUM_BLOCKS * BS, scheduler_block_size=BS, hash_block_size=BS)
    return manager, get_request_block_hasher(BS, sha256)


def test_a_failed_loads_blocks_and_those_computed_over_them_leave_vllms_prefix_cache(settings: ConnectorSettings) -> None:
    """Under ``kv_load_failure_policy: "recompute"`` vLLM keeps a failed
    sync load's blocks hashed (its request writes them again), so a request
    preempted or aborted first would leave their stale KV to the next
    request of that prefix, as a local hit the connector saves: the
    scheduler evicts them from vLLM's prefix cache (settlement.py)."""
    _seed(settings, _random_kv(), blocks=2)
    manager, hasher = _prefix_cache()
    sched = UcmDbScheduler(settings, _shape())
    sched.kv_cache_manager = manager  # what vLLM's scheduler binds (bind_kv_cache_manager)
    worker = _worker(settings, _random_kv())
    req = _request("b", PROMPT, block_hasher=hasher)
    ext, _ = sched.get_num_new_matched_tokens(req, 0)
    assert ext == 2 * BS
    blocks = manager.allocate_slots(req, len(PROMPT) - ext, num_external_computed_tokens=ext)
    sched.update_state_after_alloc(req, blocks, ext)
    req.num_computed_tokens = ext
    (ids,) = manager.get_block_ids("b")
    meta = sched.build_connector_meta(_new_step(req, ids, len(PROMPT) - ext))
    ns, g, spans = namespace(_shape()), grid(_shape()), reader_spans(_shape())
    assert sched.store.delete(ns, [unit_key(meta.loads[0].keys[1], spans[1], g)]) == 1  # evicted before the load
    worker.start_load(meta)
    worker.save(meta)
    worker.drain()
    assert worker.take_load_errors() == {ids[1]}

    def local_hit_tokens() -> int:
        return int(manager.get_computed_blocks(_request("probe", PROMPT, block_hasher=hasher))[1])

    assert local_hit_tokens() == 5 * BS  # vLLM hashed the failed block and those computed over it at allocation
    req.num_computed_tokens = BS  # vLLM's recompute policy: from the failed block on
    sched.observe_output(UcmDbWorkerMetadata(meta.step), {ids[1]})
    assert local_hit_tokens() == BS  # only the block that loaded is left hashed
    assert manager.get_block_ids("b") == (ids,)  # still the request's, to compute again
    worker.shutdown()
    sched.shutdown()
