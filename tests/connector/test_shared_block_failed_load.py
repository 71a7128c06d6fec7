"""A save dropped over another request's failed load is saved again (TP=1).

Request A loads its first two blocks into 10 and 11; R2, admitted in the same
step, reuses them through vLLM's own prefix cache. Block 11 fails to load:
vLLM recomputes it for A, and R2 keeps it as computed (A recomputes it) but
recomputes its own step. The one worker drops both requests' saves over the
failed block (connector/worker/hooks.py). The scheduler used to rewind only A,
whose own load failed: R2's saved marks stayed past the dropped blocks, its
recomputed blocks were never saved, and its next save named a parent never
stored (audit F4). Now a one-rank save over a load is tracked until its
step's outcome is back, and its request rewound if a load it depends on
failed (connector/scheduler/settlement.py), with no delete (nothing was stored).

Real parts: UcmDbScheduler, UcmDbWorker, vLLM Request and SchedulerOutput, a
real store (the failure is real: a unit evicted between lookup and load),
CPU KV tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.core.sched.output import CachedRequestData, KVConnectorBlockState, NewRequestData, SchedulerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from test_failed_load_saves import PROMPT, _seed  # noqa: E402
from test_scheduler_worker import BS, NUM_BLOCKS, _kv, _request, _shape  # noqa: E402

from ucm_db.connector.identity import grid, namespace, reader_spans  # noqa: E402
from ucm_db.connector.metadata import UcmDbWorkerMetadata  # noqa: E402
from ucm_db.connector.roles import RolePolicy  # noqa: E402
from ucm_db.connector.scheduler.hooks import UcmDbScheduler  # noqa: E402
from ucm_db.connector.settings import ConnectorSettings  # noqa: E402
from ucm_db.connector.worker.hooks import UcmDbWorker  # noqa: E402
from ucm_db.keys.units import unit_key  # noqa: E402

Scheduled = tuple[Request, list[int], int]  # (request, its block ids, tokens scheduled)


def _step(new: Sequence[Scheduled] = (), cached: Sequence[Scheduled] = ()) -> SchedulerOutput:
    table = {r.request_id: (ids,) for r, ids, _ in [*new, *cached]}
    cached_data = CachedRequestData.make_empty()
    cached_data.req_ids = [r.request_id for r, _, _ in cached]
    cached_data.new_block_ids = [None for _ in cached]
    cached_data.num_computed_tokens = [r.num_computed_tokens for r, _, _ in cached]
    scheduled = {r.request_id: n for r, _, n in [*new, *cached]}
    out = SchedulerOutput(scheduled_new_reqs=[NewRequestData.from_request(r, (ids,)) for r, ids, _ in new],
                          scheduled_cached_reqs=cached_data, num_scheduled_tokens=scheduled,
                          total_num_scheduled_tokens=sum(scheduled.values()), scheduled_spec_decode_tokens={},
                          scheduled_encoder_inputs={}, finished_req_ids=set(), free_encoder_mm_hashes=[])
    out.kv_connector_block_state = KVConnectorBlockState(set(scheduled), lambda rid: table[rid], {})
    return out


@pytest.mark.parametrize("role", ["kv_both", "kv_producer"])
def test_a_request_sharing_a_failed_block_saves_its_whole_prompt(tmp_path: Path, role: str) -> None:
    settings = ConnectorSettings.from_extra_config({"path": str(tmp_path / "store"), "codec": "none"})
    _seed(settings, {k: torch.randn(v.shape).to(torch.bfloat16) for k, v in _kv().items()}, blocks=2)  # PROMPT's blocks 0-1
    sched = UcmDbScheduler(settings, _shape(), RolePolicy(role))
    worker = UcmDbWorker(settings, _shape(), NUM_BLOCKS, RolePolicy(role))
    worker.register_kv_caches({k: torch.randn(v.shape).to(torch.bfloat16) for k, v in _kv().items()}, 0, 0)
    ns, g, spans = namespace(_shape()), grid(_shape()), reader_spans(_shape())
    try:
        # Step s: A claims blocks 0-1 (loaded into 10, 11) and computes the rest of PROMPT.
        a = _request("A", PROMPT)
        hit, _ = sched.get_num_new_matched_tokens(a, 0)
        assert hit == 2 * BS
        sched.update_state_after_alloc(a, None, hit)  # type: ignore[arg-type]
        a.num_computed_tokens = hit
        a_ids = [10, 11, 12, 13, 14, 15]
        # R2 (another prompt, the same first 2 blocks) is admitted in the same step
        # with vLLM's own prefix-cache hit on A's blocks 10, 11.
        r2_tokens = PROMPT[: 2 * BS] + [900 + i for i in range(3 * BS + 7)]
        r2 = _request("R2", r2_tokens)
        assert sched.get_num_new_matched_tokens(r2, 2 * BS) == (0, False)
        sched.update_state_after_alloc(r2, None, 0)  # type: ignore[arg-type]
        r2.num_computed_tokens = 2 * BS
        r2_ids = [10, 11, 20, 21, 22, 23]
        meta = sched.build_connector_meta(_step([(a, a_ids, len(PROMPT) - hit), (r2, r2_ids, len(r2_tokens) - 2 * BS)]))
        assert [(t.req_id, t.block_ids, t.after_loads, t.hold_id) for t in meta.saves] == [
            ("A", (12, 13, 14), (10, 11), -1), ("R2", (20, 21, 22), (10, 11), -1)]
        sched.store.delete(ns, [unit_key(meta.loads[0].keys[1], spans[1], g)])  # block 1 evicted between lookup and load
        worker.start_load(meta)
        worker.save(meta)
        worker.drain()
        invalid = worker.take_load_errors()
        assert invalid == {11}
        assert worker.counters.totals.data["saves_voided"] == 6  # the worker dropped both saves itself

        # vLLM: A recomputes from block 1; R2 (sharing block 11, which A recomputes) its step's tokens.
        a.num_computed_tokens = BS
        r2.num_computed_tokens = 2 * BS
        sched.observe_output(UcmDbWorkerMetadata(meta.step), invalid)

        # Step s+1: both recompute and save again; nothing is deleted (nothing over the failure was stored).
        meta2 = sched.build_connector_meta(_step(cached=[(a, a_ids, len(PROMPT) - BS), (r2, r2_ids, len(r2_tokens) - 2 * BS)]))
        assert meta2.void_saves == []
        assert [(t.req_id, t.block_ids) for t in meta2.saves] == [("A", (11, 12, 13, 14)), ("R2", (20, 21, 22))]
        worker.start_load(meta2)
        worker.save(meta2)
        worker.drain()
        sched.observe_output(UcmDbWorkerMetadata(meta2.step), set())

        # R2 decodes until its block 5 is whole: that save's parent is stored.
        r2.num_computed_tokens = len(r2_tokens)
        for _ in range(BS - 7 + 1):
            r2.append_output_token_ids(7)
        r2.num_computed_tokens = r2.num_tokens - 1
        meta3 = sched.build_connector_meta(_step(cached=[(r2, r2_ids, 1)]))
        assert [(t.req_id, t.block_ids) for t in meta3.saves] == [("R2", (23,))]
        worker.start_load(meta3)
        worker.save(meta3)
        worker.drain()
        assert worker.counters.totals.data.get("save_errors", 0) == 0
        keys = sched.keys_for(r2, 6)
        assert sched.store.lookup(ns, [unit_key(k, spans[0], g) for k in keys], remote=False) == 6  # R2's whole prompt, and more
    finally:
        worker.shutdown()
        sched.shutdown()
