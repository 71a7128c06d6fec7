"""A failed load of a hybrid model, through vLLM's real scheduler (issue 27:
a damaged block is a miss, never a dead engine).

vLLM 0.32's ``Scheduler._handle_invalid_blocks`` raises for a model with
several KV cache groups when a connector reports failed block ids; the
connector loads such a model asynchronously and reports a failed load per
request (``failed_recving``), which vLLM recomputes (hybrid.py).

Real parts: vLLM's ``Scheduler`` (it makes ucm-db's scheduler half itself,
from the VllmConfig) over vLLM's real KVCacheConfig of a tiny Gemma 2 (a
sliding-window and a full-attention group), ucm-db's worker half with CPU KV
tensors, a real store whose block body is flipped between the lookup and the
load (as ``tests/test_store.py`` damages one). No model runs: each step's
output is the worker half's connector output and one sampled token per
finished prefill (tests/vllm/test_hybrid_engine.py runs an engine).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from ucm_db.connector.connector import UcmDbConnector  # noqa: E402
from ucm_db.connector.hybrid.hooks import group_shape  # noqa: E402
from ucm_db.connector.identity import grid, reader_spans  # noqa: E402
from ucm_db.keys.units import UnitKeys  # noqa: E402

from test_hybrid import BS, NUM_BLOCKS, TOKENS, _Engine, _groups, _kv, _request, _vllm_config, model_dir  # noqa: E402,F401


def _scheduler(model_dir: Path, store: Path, load_mode: str) -> Scheduler:
    config = _vllm_config(model_dir, {"path": str(store), "load_mode": load_mode})
    config.cache_config.enable_prefix_caching = False
    config.cache_config.num_gpu_blocks = NUM_BLOCKS
    return Scheduler(config, _groups(), StructuredOutputManager(config), BS)


def _run(sched: Scheduler, worker: UcmDbConnector, between: Any = None, max_steps: int = 500) -> dict[str, int]:
    """Steps until every request finished: schedule, the worker half's
    loads and saves, the output back (``between()`` runs once, after the
    first schedule and before the worker loads). Returns each request's
    computed tokens when it was first scheduled to compute (its hit)."""
    first: dict[str, int] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return first
        out = sched.schedule()
        for new_req in out.scheduled_new_reqs:
            first.setdefault(new_req.req_id, new_req.num_computed_tokens)
        if between is not None:
            between()
            between = None
        worker.bind_connector_metadata(out.kv_connector_metadata)
        worker.start_load_kv(None)  # type: ignore[arg-type]
        worker.wait_for_save()
        results = worker.get_transfer_results(out.finished_req_ids)
        kv_out = KVConnectorOutput(
            finished_sending=results.finished_sending or None, finished_recving=results.finished_recving or None,
            failed_recving=results.failed_recving, invalid_block_ids=worker.get_block_ids_with_load_errors(),
            kv_connector_worker_meta=worker.build_connector_worker_meta(),
        )
        worker.clear_connector_metadata()
        req_ids = list(out.num_scheduled_tokens)
        sampled = [[5] if sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens else [] for r in req_ids]
        sched.update_from_output(out, ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                                        sampled_token_ids=sampled, kv_connector_output=kv_out))
        if not out.num_scheduled_tokens:
            time.sleep(0.005)  # an async load in flight
    raise AssertionError(f"requests left unfinished after {max_steps} steps")


@pytest.mark.parametrize("load_mode", ["block", "async"])
def test_a_block_damaged_between_lookup_and_load_is_recomputed_not_an_engine_stop(
        model_dir: Path, tmp_path: Path, load_mode: str) -> None:  # noqa: F811
    store = tmp_path / "store"
    writer = _Engine(model_dir, store, _kv(3))
    writer.run(_request("a", TOKENS), (list(range(1, 8)), list(range(11, 18))))
    writer.close()

    sched = _scheduler(model_dir, store, load_mode)
    worker = UcmDbConnector(_vllm_config(model_dir, {"path": str(store), "load_mode": load_mode}), KVConnectorRole.WORKER, _groups())
    worker.register_kv_caches(_kv(None))
    ours = sched.connector._scheduler  # type: ignore[union-attr]
    full = ours.parts[1]
    held = sched.connector._held_store  # type: ignore[union-attr]
    damaged = _request("b", TOKENS)
    status_at_damage: list[RequestStatus] = []

    def flip_full_block_2() -> None:
        """The lookup claimed it; its body is flipped before the load reads it."""
        status_at_damage.append(damaged.status)
        shape = group_shape(worker.shape, ours.groups[1])
        key = full.keys_for(damaged, 3)[2]
        unit = next(iter(UnitKeys([key], grid(shape), reader_spans(shape)[0])))

        def flip(txn: Any) -> None:
            body = bytearray(txn.get("blocks", unit))
            body[-1] ^= 0xFF
            txn.put("blocks", unit, bytes(body))
        held._tier.engine.write(flip)

    sched.add_request(damaged)
    hits = _run(sched, worker, between=flip_full_block_2)  # vLLM 0.32 raised RuntimeError here before (block ids)
    assert status_at_damage == [RequestStatus.WAITING_FOR_REMOTE_KVS]  # every hybrid load is async
    assert damaged.status == RequestStatus.FINISHED_LENGTH_CAPPED and hits == {"b": 0}  # recomputed from its first token
    worker._worker.drain()  # type: ignore[union-attr]
    assert sorted(ns.blocks for ns in held.stats().namespaces.values()) == [6 * 2, 6 * 2]  # saved again
    again = _request("c", TOKENS)
    sched.add_request(again)
    assert _run(sched, worker) == {"c": 6 * BS}  # the recomputed blocks hit
    worker.shutdown()
    sched.connector.shutdown()  # type: ignore[union-attr]


def test_a_request_is_finished_once_every_groups_load_ended_and_failed_if_any_failed() -> None:
    """GroupLoads over two groups' real async loaders (the loads are the
    test's: group 1's waits for a release and fails one block)."""
    import threading
    from types import SimpleNamespace

    from ucm_db.connector.worker.async_loads import AsyncLoader
    from ucm_db.connector.hybrid.loads import GroupLoads
    from ucm_db.connector.metadata import BlockTransfer

    release = threading.Event()

    def slow_failing(load: BlockTransfer) -> set[int]:
        release.wait(10)
        return {load.block_ids[0]} if load.req_id == "r" else set()

    loaders = [AsyncLoader(lambda load: set()), AsyncLoader(slow_failing)]
    merged = GroupLoads([SimpleNamespace(finished_requests=loader.take_finished_requests) for loader in loaders])
    loaders[0].submit([BlockTransfer("r", (b"k",), (3,))])
    merged.submitted(0, ["r"])
    loaders[1].submit([BlockTransfer("r", (b"k",), (13,)), BlockTransfer("only-1", (b"k",), (14,))])
    merged.submitted(1, ["r", "only-1"])  # group 0 loads nothing of it (its blocks were null)
    deadline = time.monotonic() + 10
    while loaders[0].in_flight and time.monotonic() < deadline:
        assert merged.finished(0.01) == set()  # group 1 is still loading both
    assert merged.take_failed() == set()
    release.set()
    done: set[str] = set()
    while done != {"r", "only-1"} and time.monotonic() < deadline:
        done |= merged.finished(0.05)
    assert done == {"r", "only-1"} and merged.take_failed() == {"r"} and merged.take_failed() == set()
    for loader in loaders:
        loader.close()


def test_a_failed_load_of_a_request_already_finished_is_not_remembered(model_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    """A request aborted while its async load runs is finished (forgotten)
    before its load's failure comes back: that failure must not be kept."""
    sched = _scheduler(model_dir, tmp_path / "store", "async")
    ours = sched.connector._scheduler  # type: ignore[union-attr]
    ours.observe_output(None, set(), {"aborted-while-loading"})
    assert not ours._load_failed
    sched.connector.shutdown()  # type: ignore[union-attr]
