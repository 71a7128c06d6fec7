"""Scheduler-side rules of TP-independent blocks, with real vLLM request
objects, real workers and a real store (no engine): a hit needs every
unit of every pipeline stage (stores of the generations before units:
test_pre_unit_stores.py); keys are hashed once per request; the lookup's
only state is its memo and its record."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.v1.core.sched.output import CachedRequestData, KVConnectorBlockState, NewRequestData, SchedulerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from ucm_db.connector.identity import KVShape, grid, namespace, rank_spans, reader_spans  # noqa: E402
from ucm_db.connector.scheduler.hooks import UcmDbScheduler  # noqa: E402
from ucm_db.connector.settings import ConnectorSettings  # noqa: E402
from ucm_db.connector.worker.hooks import UcmDbWorker  # noqa: E402
from ucm_db.keys import Namespace  # noqa: E402
from ucm_db.keys.units import KVGrid, UnitSpan, plan_read  # noqa: E402

BS, NUM_BLOCKS, HEAD = 32, 16, 64


def _shape(tp: int = 1, heads: int = 4, layers: int = 2, pp: int = 1) -> KVShape:
    return KVShape(model="tp-sched", kv_dtype="bfloat16", block_size=BS, use_mla=False, layout="cpu-test",
                   tp_size=tp, pp_size=pp, kv_heads=heads, layers=layers)


def _request(req_id: str, tokens: list[int]) -> Request:
    return Request(req_id, tokens, SamplingParams(max_tokens=4), None)


def _step(req: Request, block_ids: list[int], num_tokens: int, new: bool = True) -> SchedulerOutput:
    out = SchedulerOutput(
        scheduled_new_reqs=[NewRequestData.from_request(req, (block_ids,))] if new else [],
        scheduled_cached_reqs=CachedRequestData.make_empty(),
        num_scheduled_tokens={req.request_id: num_tokens}, total_num_scheduled_tokens=num_tokens,
        scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={}, finished_req_ids=set(), free_encoder_mm_hashes=[],
    )
    out.kv_connector_block_state = KVConnectorBlockState({req.request_id}, lambda _rid: (block_ids,), {})
    return out


def _admit(sched: UcmDbScheduler, req: Request) -> int:
    ext, _ = sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, None, ext)  # type: ignore[arg-type]
    req.num_computed_tokens = ext
    return ext


def _model_kv(heads: int, layers: int = 2, first_layer: int = 0) -> dict[str, torch.Tensor]:
    return {f"model.layers.{i}.self_attn.attn": torch.randn(NUM_BLOCKS, heads, BS, 2 * HEAD).to(torch.bfloat16)
            for i in range(first_layer, first_layer + layers)}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def test_keys_are_hashed_once_per_request_across_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hashed: list[int] = []
    original = Namespace.block_keys

    def counting(self: Namespace, *args: object, **kwargs: object) -> list[bytes]:
        keys = original(self, *args, **kwargs)  # type: ignore[arg-type]
        hashed.append(len(keys))
        return keys

    monkeypatch.setattr(Namespace, "block_keys", counting)
    sched = UcmDbScheduler(ConnectorSettings.from_extra_config({"path": str(tmp_path / "s")}), _shape())
    tokens = list(range(1, 40 * BS + 7))  # 40 full blocks: two lookup segments
    req = _request("r", tokens)
    for _ in range(3):  # vLLM may look a waiting request up on every step
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    _admit(sched, req)
    block_ids = list(range(41))
    sched.build_connector_meta(_step(req, block_ids, 20 * BS))  # chunked prefill
    req.num_computed_tokens = 20 * BS
    sched.build_connector_meta(_step(req, block_ids, len(tokens) - 20 * BS, new=False))
    assert sum(hashed) == 40
    sched.shutdown()


def test_lookup_records_only_its_result(tmp_path: Path) -> None:
    sched = UcmDbScheduler(ConnectorSettings.from_extra_config({"path": str(tmp_path / "s")}), _shape())
    req = _request("r", list(range(1, 3 * BS + 2)))
    first = sched.get_num_new_matched_tokens(req, BS)
    record = sched._requests["r"].lookup
    assert sched.get_num_new_matched_tokens(req, BS) == first
    again = sched._requests["r"].lookup
    assert record is not None and again is not None and record.local_tokens == BS
    assert replace(again, seconds=0.0) == replace(record, seconds=0.0)  # replaced by an equal record
    sched.update_state_after_alloc(req, None, 0)  # type: ignore[arg-type]
    assert sched._requests["r"].lookup is None  # consumed
    sched.shutdown()


def test_pipeline_stages_are_layer_ranges_and_a_hit_needs_every_stage(tmp_path: Path) -> None:
    shape = _shape(tp=2, heads=2, layers=4, pp=2)
    assert [(s.head_start, s.layer_start, s.layer_stop) for s in reader_spans(shape)] == [
        (0, 0, 2), (1, 0, 2), (0, 2, 4), (1, 2, 4)]
    assert rank_spans(shape, 1, 1) == [UnitSpan(1, 2, 2, 4)]
    settings = ConnectorSettings.from_extra_config({"path": str(tmp_path / "s")})
    sched = UcmDbScheduler(settings, shape)
    tokens = list(range(1, 2 * BS + 3))
    req = _request("a", tokens)
    _admit(sched, req)
    meta = sched.build_connector_meta(_step(req, [0, 1, 2], len(tokens)))
    workers = []
    for pp in range(2):
        for tp in range(2):
            worker = UcmDbWorker(settings, shape, NUM_BLOCKS)
            worker.register_kv_caches(_model_kv(1, layers=2, first_layer=2 * pp), tp, pp)
            worker.save(meta)
            worker.drain()
            workers.append(worker)
            expected = 2 * BS if (pp, tp) == (1, 1) else 0  # the last unit completes the blocks
            assert sched.get_num_new_matched_tokens(_request(f"q{pp}{tp}", tokens), 0) == (expected, False)
    with pytest.raises(Exception, match="heads"):  # a rank whose caches do not match its heads
        UcmDbWorker(settings, shape, NUM_BLOCKS).register_kv_caches(_model_kv(2, layers=2), 0, 0)
    for part in (*workers, sched):
        part.shutdown()


def test_plan_read_assembles_any_partition() -> None:
    g = KVGrid(heads=4, layers=8)
    want = UnitSpan(2, 4, 2, 6)  # TP=2 rank 1, PP=2 stage ... of layers 2-5
    pp4 = [s for stage in ((0, 2), (2, 4), (4, 6), (6, 8)) for s in g.head_spans(stage)]
    pieces = plan_read(want, pp4)
    assert [(p.unit.head_start, p.unit.layer_start) for p in pieces] == [(2, 2), (3, 2), (2, 4), (3, 4)]
    assert all(p.head_offset == 0 and p.layer_offset == 0 and len(p.layers) == 2 for p in pieces)
    (whole,) = plan_read(want, [g.whole])
    assert (whole.head_offset, whole.layer_offset, len(whole.heads), len(whole.layers)) == (2, 2, 2, 4)
    with pytest.raises(Exception, match="cover"):
        plan_read(want, g.head_spans((0, 4)))


def test_unit_keys_and_readability() -> None:
    from ucm_db.keys.units import UnitKeys, readable_at, unit_key, unit_keys_of

    g = KVGrid(heads=2, layers=2)
    keys = Namespace(model="m", kv_dtype="bfloat16", block_size=4).block_keys(list(range(16)))
    head1 = UnitKeys(keys, g, g.head_spans()[1])
    assert list(head1) == [unit_key(k, g.head_spans()[1], g) for k in keys] and len(set(head1) | set(keys)) == 8
    assert list(UnitKeys(keys, g, g.whole)) == list(keys)  # a whole-grid unit is the block itself
    tail = head1[2:]
    assert list(tail) == list(head1)[2:] and tail.parent() == head1[1] and head1.parent() is None
    spans = [*g.head_spans(), g.whole]  # the batch derivation gives the same keys, block-major
    assert unit_keys_of(keys, spans, g) == [unit_key(k, s, g) for k in keys for s in spans]
    assert readable_at({"tp_size": 1, "pp_size": 1}) == "any TP size"
    assert readable_at({"tp_rank": 1, "tp_size": 2}).startswith("no TP size (per-rank blocks of TP=2 PP=1")


def test_grid_and_span_checks() -> None:
    assert grid(_shape(heads=8)).whole == UnitSpan(0, 8, 0, 2)
    with pytest.raises(ValueError, match="span"):
        UnitSpan(1, 1, 0, 2)
    with pytest.raises(ValueError, match="outside"):
        KVGrid(2, 2).check(UnitSpan(0, 3, 0, 2))
