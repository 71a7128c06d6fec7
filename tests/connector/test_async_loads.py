"""``load_mode: "async"``: the scheduler and worker halves with real vLLM
request objects, a real store and CPU KV tensors (no engine; the engine
test is tests/vllm/test_connector_e2e.py), and the loader thread's contract.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # noqa: E402
from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput  # noqa: E402

from ucm_db.connector.worker.async_loads import AsyncLoader  # noqa: E402
from ucm_db.connector.metadata import BlockTransfer, UcmDbWorkerMetadata  # noqa: E402
from ucm_db.connector.scheduler import planner  # noqa: E402
from ucm_db.connector.scheduler.hooks import UcmDbScheduler  # noqa: E402
from ucm_db.connector.settings import ConnectorSettings  # noqa: E402
from ucm_db.connector.worker.hooks import UcmDbWorker  # noqa: E402
from ucm_db.connector.identity import grid, namespace, reader_spans  # noqa: E402
from ucm_db.keys.units import unit_key  # noqa: E402

from test_scheduler_worker import BS, NUM_BLOCKS, _kv, _new_step, _request, _save_prompt, _shape, restarted  # noqa: E402


@pytest.fixture()
def settings(tmp_path: Path) -> ConnectorSettings:
    return ConnectorSettings.from_extra_config({"path": str(tmp_path / "store"), "load_mode": "async"})


def _idle_step() -> SchedulerOutput:
    """A step that schedules no tokens (only async loads are in flight)."""
    return SchedulerOutput(
        scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData.make_empty(), num_scheduled_tokens={},
        total_num_scheduled_tokens=0, scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
        finished_req_ids=set(), free_encoder_mm_hashes=[],
    )


def _blocks(ids: list[int]) -> KVCacheBlocks:
    return KVCacheBlocks(([KVCacheBlock(i) for i in ids],))


def _wait_finished(worker: UcmDbWorker, timeout_s: float = 10.0) -> set[str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done = worker.finished_loads(0.05)
        if done:
            return done
    raise AssertionError("the async load never finished")


def test_hit_loads_asynchronously_into_the_allocated_blocks(settings: ConnectorSettings) -> None:
    tokens = list(range(1, 5 * BS + 10))  # 5 full blocks + 9 tokens
    kv, sched, worker, fresh = restarted(settings, tokens)
    req = _request("b", tokens)
    # vLLM's local prefix cache had the first block; ucm-db claims 4 more, asynchronously.
    assert sched.get_num_new_matched_tokens(req, BS) == (4 * BS, True)
    sched.update_state_after_alloc(req, _blocks([9, 10, 11, 12, 13, 14]), 4 * BS)
    req.num_computed_tokens = 5 * BS  # what vLLM sets while the request waits

    meta = sched.build_connector_meta(_idle_step())
    assert meta.loads == [] and meta.saves == [] and meta.idle
    (load,) = meta.async_loads
    assert (load.req_id, load.block_ids) == ("b", (10, 11, 12, 13))
    worker.start_load(meta)
    assert _wait_finished(worker) == {"b"}
    assert worker.take_load_errors() == set()
    for name in kv:
        assert torch.equal(fresh[name][10:14].view(torch.int16), kv[name][1:5].view(torch.int16))
        assert not fresh[name][9].any() and not fresh[name][14].any()
    worker_meta = worker.take_worker_meta()
    assert worker_meta is not None and worker_meta.loads == {}
    ((tokens_loaded, seconds),) = worker_meta.background_loads.values()
    assert tokens_loaded == 4 * BS and seconds > 0

    # Back from the load, vLLM schedules it with no lookup: nothing loads again,
    # and only blocks past the hit are saved.
    sched.update_state_after_alloc(req, _blocks([9, 10, 11, 12, 13, 14]), 0)
    step = sched.build_connector_meta(_new_step(req, [9, 10, 11, 12, 13, 14], len(tokens) - 5 * BS))
    assert step.loads == [] and step.async_loads == [] and not step.idle
    assert sched.counters.totals.data["lookups"] == 1
    worker.shutdown()
    sched.shutdown()


ASYNC_IDS = [20, 21, 22, 23, 24]


def _failed_async_load(settings: ConnectorSettings) -> tuple[UcmDbScheduler, UcmDbWorker, Any, list[int]]:
    """A 4-block prompt stored, then claimed asynchronously by a new engine
    (blocks 20-23) whose load finds head 1 of blocks 2-3 gone: (its
    scheduler, its worker, the request, its tokens); the load has finished."""
    tokens = list(range(1, 4 * BS + 3))
    _save_prompt(settings, tokens, _kv())
    sched = UcmDbScheduler(settings, _shape())
    req = _request("b", tokens)
    assert sched.get_num_new_matched_tokens(req, 0) == (4 * BS, True)
    sched.update_state_after_alloc(req, _blocks(ASYNC_IDS), 4 * BS)
    meta = sched.build_connector_meta(_idle_step())
    shape = _shape()
    assert sched.store.delete(namespace(shape), [unit_key(meta.async_loads[0].keys[2], reader_spans(shape)[1], grid(shape))]) == 2
    worker = UcmDbWorker(settings, shape, NUM_BLOCKS)
    worker.register_kv_caches(_kv(), 0, 0)
    worker.start_load(meta)
    # vLLM asks get_finished, then the load errors, in the same step: a
    # request reported finished has its failed blocks in that same answer.
    assert _wait_finished(worker) == {"b"}
    return sched, worker, req, tokens


def test_missing_block_is_reported_with_its_request(settings: ConnectorSettings) -> None:
    sched, worker, req, _ = _failed_async_load(settings)
    assert worker.take_load_errors() == {22, 23}
    # vLLM keeps the good blocks and recomputes the rest. Had it freed them
    # all (nothing valid), it would ask again: that claim is synchronous,
    # so a block that keeps failing is recomputed, not retried forever.
    req.num_computed_tokens = 0
    assert sched.get_num_new_matched_tokens(req, 0) == (2 * BS, False)
    worker.shutdown()
    sched.shutdown()


def test_a_failed_async_load_rewinds_the_save_marks(settings: ConnectorSettings) -> None:
    """vLLM recomputes a failed async load from its first invalid block;
    the scheduler moves the request's save marks back with it, so the
    recomputed blocks are saved (they were counted as stored before)."""
    sched, worker, req, tokens = _failed_async_load(settings)
    invalid = worker.take_load_errors()
    assert invalid == {22, 23}
    req.num_computed_tokens = 2 * BS  # vLLM: recompute from block 2
    sched.observe_output(worker.take_worker_meta(), invalid)
    sched.update_state_after_alloc(req, _blocks(ASYNC_IDS), 0)  # scheduled again, no lookup
    step = sched.build_connector_meta(_new_step(req, ASYNC_IDS, len(tokens) - 2 * BS))
    assert [t.block_ids for t in step.saves] == [(22, 23)]
    worker.shutdown()
    sched.shutdown()


def test_block_mode_claims_synchronously(tmp_path: Path) -> None:
    settings = ConnectorSettings.from_extra_config({"path": str(tmp_path / "s")})
    tokens = list(range(1, 3 * BS + 3))
    _save_prompt(settings, tokens, _kv())
    sched = UcmDbScheduler(settings, _shape())
    assert sched.get_num_new_matched_tokens(_request("b", tokens), 0) == (3 * BS, False)
    assert sched.get_num_new_matched_tokens(_request("c", [7] * (3 * BS)), 0) == (0, False)
    sched.shutdown()


def test_background_loads_are_not_subtracted_from_the_step(settings: ConnectorSettings, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step's prefill sample is its round trip less its own loads; an async
    load ran beside it and must not shrink the sample. The planner's clock
    is the test's: the round trip is exactly 0.2 s, however long the
    machine takes (a real sleep left 50 ms of slack on a loaded host)."""
    now_s = [100.0]
    monkeypatch.setattr(planner, "time", SimpleNamespace(perf_counter=lambda: now_s[0]))
    per_token_s = {}
    for background in (False, True):
        sched = UcmDbScheduler(settings, _shape())
        meta = sched.build_connector_meta(_new_step(_request("r", list(range(1, 40))), [0, 1], 1000))
        now_s[0] += 0.2  # the step's round trip
        timings = {("ns", "local"): (64, 0.15)}
        sched.observe_output(UcmDbWorkerMetadata(meta.step, {} if background else timings, timings if background else {}))
        assert sched.cost.load_rate("ns", "local") == pytest.approx(64 / 0.15)
        per_token_s[background] = sched.cost.prefill.value
        sched.shutdown()
    # 1000 tokens in 0.05 s (0.2 s less the step's own 0.15 s load) against 0.2 s.
    assert per_token_s[False] == pytest.approx(0.05 / 1000)
    assert per_token_s[True] == pytest.approx(0.2 / 1000)


def test_loader_reports_every_request_once_even_when_a_load_raises() -> None:
    """The load function is the loader's parameter: one that raises stands
    for a fault inside the store (a real one is the missing-block test)."""
    started = threading.Event()
    release = threading.Event()

    def load(transfer: BlockTransfer) -> set[int]:
        if transfer.req_id == "boom":
            raise OSError("disk gone")
        if transfer.req_id == "slow":
            started.set()
            release.wait(5)
        return set()

    loader = AsyncLoader(load)
    try:
        loader.submit([BlockTransfer("boom", (b"k1", b"k2"), (3, 4)), BlockTransfer("ok", (b"k3",), (5,))])
        deadline = time.monotonic() + 5
        done: set[str] = set()
        failed: set[int] = set()
        while done != {"boom", "ok"} and time.monotonic() < deadline:
            more, bad = loader.take_finished(0.05)
            done |= more
            failed |= bad
        assert done == {"boom", "ok"} and failed == {3, 4}
        assert loader.in_flight == 0
        # An idle poll waits for the running load, and no longer than asked.
        loader.submit([BlockTransfer("slow", (b"k4",), (6,))])
        assert started.wait(5)
        t0 = time.monotonic()
        assert loader.take_finished(0.1) == (set(), set())
        assert 0.08 <= time.monotonic() - t0 < 2
        threading.Timer(0.05, release.set).start()
        assert loader.take_finished(5)[0] == {"slow"}
        t0 = time.monotonic()
        assert loader.take_finished(5) == (set(), set())  # nothing in flight: no wait
        assert time.monotonic() - t0 < 0.5
    finally:
        loader.close()


@pytest.mark.parametrize("mode", ["block", "layer"])
def test_loads_before_the_caches_are_registered_fail_and_are_reported(mode: str) -> None:
    """Before ``register_kv_caches`` binds a store, a step's loads fail, sync
    and async alike, and vLLM hears of each (none is dropped silently)."""
    from ucm_db.connector.metadata import UcmDbConnectorMetadata
    from ucm_db.connector.metrics import Counters
    from ucm_db.connector.worker.loads import WorkerLoads

    loads = WorkerLoads(mode, BS, Counters())
    loads.start(UcmDbConnectorMetadata(loads=[BlockTransfer("r", (b"k" * 32,), (5,))], step=0))
    loads.finish_loads()
    assert loads.take_load_errors() == {5}
    loads.start(UcmDbConnectorMetadata(async_loads=[BlockTransfer("s", (b"k" * 32,), (6,))], step=1))
    deadline = time.monotonic() + 5.0
    while not (finished := loads._async.take_finished())[0] and time.monotonic() < deadline:  # type: ignore[union-attr]
        time.sleep(0.01)
    assert finished == ({"s"}, {6})
    loads.close()
