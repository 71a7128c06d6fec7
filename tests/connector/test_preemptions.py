"""Preemption (connector/worker/preemptions.py) with the real scheduler and worker
halves, a real store and CPU KV tensors: vLLM's ``handle_preemptions`` hook
is the guard that keeps every save off the blocks a preemption freed."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from ucm_db.connector.metadata import BlockTransfer, UcmDbConnectorMetadata  # noqa: E402
from ucm_db.connector.worker.preemptions import PendingSaves  # noqa: E402
from ucm_db.connector.scheduler.hooks import UcmDbScheduler  # noqa: E402
from ucm_db.connector.settings import ConnectorSettings  # noqa: E402
from ucm_db.connector.worker.hooks import UcmDbWorker  # noqa: E402

from test_scheduler_worker import BS, NUM_BLOCKS, _admit, _kv, _new_step, _request, _shape  # noqa: E402

TOKENS = list(range(1, 4 * BS + 1))  # 4 blocks: 3 claimable


@pytest.fixture()
def settings(tmp_path: Path) -> ConnectorSettings:
    return ConnectorSettings.from_extra_config({"path": str(tmp_path / "store")})


def _transfer(req_id: str, first_block: int, blocks: int = 2) -> BlockTransfer:
    keys = tuple(bytes([first_block + i]) * 32 for i in range(blocks))
    return BlockTransfer(req_id, keys, tuple(range(first_block, first_block + blocks)))


def test_drop_removes_queued_saves_and_waits_for_copies_in_flight() -> None:
    pending = PendingSaves()
    pending.add([_transfer("a", 0), _transfer("b", 2), _transfer("a", 4, 3)])
    copying = pending.take()
    assert copying is not None and copying.req_id == "a"
    dropped: list[int] = []
    guard = threading.Thread(target=lambda: dropped.append(pending.drop({"a"})))
    guard.start()
    guard.join(0.2)
    assert guard.is_alive()  # a copy of "a" is reading its blocks: the guard waits for it
    pending.done(copying)
    guard.join(30)
    assert dropped == [3]  # the queued save of "a"; the one in flight finished its copy first
    assert [pending.take().req_id, pending.take()] == ["b", None]  # type: ignore[union-attr]
    assert pending.drop(set()) == 0


def test_worker_drops_a_pending_save_of_a_preempted_request(settings: ConnectorSettings) -> None:
    worker = UcmDbWorker(settings, _shape(), NUM_BLOCKS)
    worker.register_kv_caches(_kv(), 0, 0)
    # A save whose copy left its step (what a deferred copy would queue) ...
    worker._pending.add([_transfer("gone", 3), _transfer("kept", 8)])
    worker.handle_preemptions(UcmDbConnectorMetadata(preempted=("gone",)))
    # ... is dropped before vLLM's next step may write the freed blocks.
    assert worker.counters.totals.data["saves_preempted"] == 2
    assert [t.req_id for t in [worker._pending.take()]] == ["kept"]
    worker.shutdown()


def test_saves_copied_in_their_step_keep_their_kv_when_the_freed_blocks_are_rewritten(settings: ConnectorSettings) -> None:
    sched = UcmDbScheduler(settings, _shape())
    kv = {name: torch.randn(t.shape).to(torch.bfloat16) for name, t in _kv().items()}
    worker = UcmDbWorker(settings, _shape(), NUM_BLOCKS)
    worker.register_kv_caches(kv, 0, 0)
    original = {name: t[0:4].clone() for name, t in kv.items()}
    req = _request("r", TOKENS)
    _admit(sched, req)
    block_ids = [0, 1, 2, 3, 4]
    meta = sched.build_connector_meta(_new_step(req, block_ids, 3 * BS))
    worker.start_load(meta)
    worker.save(meta)  # wait_for_save: the copy happens here
    req.num_computed_tokens = 3 * BS
    # The next step preempts it: vLLM frees its blocks, another request's KV lands there.
    step = _new_step(_request("other", TOKENS), [9], 1)
    step.preempted_req_ids = {"r"}
    req.num_computed_tokens = 0
    meta2 = sched.build_connector_meta(step)
    assert meta2.preempted == ("r",)
    worker.handle_preemptions(meta2)
    for t in kv.values():
        t[0:4] = torch.randn(t[0:4].shape).to(torch.bfloat16)
    worker.drain()
    assert worker.counters.totals.data["saves_preempted"] == 0  # copied within its step: nothing was pending
    # A restarted engine loads exactly the KV computed before the preemption.
    fresh_sched, fresh_worker, fresh = UcmDbScheduler(settings, _shape()), UcmDbWorker(settings, _shape(), NUM_BLOCKS), _kv()
    fresh_worker.register_kv_caches(fresh, 0, 0)
    back = _request("r2", TOKENS)
    assert _admit(fresh_sched, back) == 3 * BS
    load = fresh_sched.build_connector_meta(_new_step(back, [10, 11, 12, 13], BS))
    fresh_worker.start_load(load)
    assert fresh_worker.take_load_errors() == set()
    for name in kv:
        assert torch.equal(fresh[name][10:13].view(torch.int16), original[name][0:3].view(torch.int16))
    for part in (worker, fresh_worker, sched, fresh_sched):
        part.shutdown()


def test_a_preempted_request_is_rewound_and_saves_again_after_its_lookup(settings: ConnectorSettings) -> None:
    sched = UcmDbScheduler(settings, _shape())
    req = _request("p", TOKENS)
    _admit(sched, req)
    meta = sched.build_connector_meta(_new_step(req, [0, 1, 2, 3, 4], 2 * BS))
    assert [s.block_ids for s in meta.saves] == [(0, 1)]  # never copied: a worker would drop it
    step = _new_step(_request("q", TOKENS), [9], 1)
    step.preempted_req_ids = {"p"}
    req.num_computed_tokens = 0
    assert sched.build_connector_meta(step).preempted == ("p",)
    assert sched.counters.totals.data["preempted_requests"] == 1
    # Back from the waiting queue: nothing stored, so it is computed and saved from block 0 again.
    assert _admit(sched, req) == 0
    meta = sched.build_connector_meta(_new_step(req, [5, 6, 7, 8, 9], len(TOKENS)))
    assert [s.block_ids for s in meta.saves] == [(5, 6, 7, 8)]
    sched.shutdown()
