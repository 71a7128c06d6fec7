"""What another connector loads into a request is seen per lookup, whatever
this ucm-db child's earlier lookups of it claimed (connector/composition.py).

Under vLLM's MultiConnector a ucm-db child with ``load_mode: "async"``
claims a request asynchronously; the load fails (a block evicted between
the lookup and the load), vLLM sends the request back with nothing
computed and asks again, and another child claims it synchronously. The
async child used to skip that request's sibling loads for good (its
``async_tried`` is never cleared): its saves over the other child's blocks
were neither held nor voided, so when that load failed too, the stale KV
of the freshly allocated blocks was stored under the prompt's keys and
served later (audit F1). Its note as a ucm-db load stayed too, so a
request another kind of connector loaded after it was stored as well.

Real parts: vLLM's MultiConnector, config objects, Request and
SchedulerOutput; ucm-db's connectors, schedulers and workers; real stores;
CPU KV tensors.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, cast

import pytest
import torch

pytest.importorskip("vllm")

from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # noqa: E402
from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402

from test_scheduler_worker import BS, _new_step, _put_units, _request, _shape  # noqa: E402

from ucm_db.connector import composition  # noqa: E402
from ucm_db.connector.connector import UcmDbConnector  # noqa: E402
from ucm_db.connector.identity import grid, reader_spans  # noqa: E402
from ucm_db.connector.metadata import UcmDbConnectorMetadata, UcmDbWorkerMetadata  # noqa: E402
from ucm_db.connector.scheduler.hooks import UcmDbScheduler  # noqa: E402
from ucm_db.connector.settings import ConnectorSettings  # noqa: E402
from ucm_db.keys.units import UnitKeys  # noqa: E402

NB = 64
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
PROMPT = list(range(11, 11 + 5 * BS + 3))  # 5 whole blocks + 3 tokens


# -- helpers -----------------------------------------------------------------------


def _blocks(ids: list[int]) -> KVCacheBlocks:
    return KVCacheBlocks(([KVCacheBlock(i) for i in ids],))


def _idle() -> SchedulerOutput:
    return SchedulerOutput(scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData.make_empty(), num_scheduled_tokens={},
                           total_num_scheduled_tokens=0, scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
                           finished_req_ids=set(), free_encoder_mm_hashes=[])


def _evict(sched: UcmDbScheduler, req: Any, block: int) -> int:
    """Another engine evicts block ``block`` of ``req`` (and, by the prefix invariant, what follows) from ``sched``'s store."""
    keys = sched.keys_for(req, block + 1)[block:]
    units = [k for span in reader_spans(_shape()) for k in UnitKeys(keys, grid(_shape()), span)]
    return sched.store.delete(sched.namespace, units)


class _Out:
    """The fields of vLLM's KVConnectorOutput the connectors read."""

    def __init__(self, meta: object, invalid: set[int]) -> None:
        self.kv_connector_worker_meta, self.invalid_block_ids = meta, invalid
        self.failed_recving: set[str] = set()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig

    out = tmp_path_factory.mktemp("llama") / "llama"
    LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                head_dim=64, vocab_size=1000, max_position_embeddings=1024).save_pretrained(out)
    return out


def _kv_config() -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    return KVCacheConfig(num_blocks=NB, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)])


def _kv(fill: float | None = None, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: (torch.full((NB, 2, BS, 128), fill) if fill is not None else torch.randn((NB, 2, BS, 128), generator=g)).to(torch.bfloat16)
            for n in LAYERS}


def _child(path: Path, **extra: object) -> dict[str, Any]:
    return {"kv_connector": "UcmDbConnector", "kv_connector_module_path": "ucm_db.connector", "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {"path": str(path), **extra}}


def _config(model: Path, transfer: KVTransferConfig) -> VllmConfig:
    return VllmConfig(model_config=ModelConfig(model=str(model), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=1024),
                      cache_config=CacheConfig(block_size=BS), kv_transfer_config=transfer)


def _single(model: Path, path: Path) -> VllmConfig:
    extra = _child(path)["kv_connector_extra_config"]
    return _config(model, KVTransferConfig(kv_connector="UcmDbConnector", kv_connector_module_path="ucm_db.connector",
                                           kv_role="kv_both", kv_load_failure_policy="recompute", kv_connector_extra_config=extra))


def _seed_store(model: Path, path: Path, good: dict[str, torch.Tensor]) -> None:
    """A lone ucm-db engine computes the prompt (``good`` in blocks 1-6) and stores its 5 whole blocks."""
    sched = UcmDbConnector(_single(model, path), KVConnectorRole.SCHEDULER, _kv_config())
    worker = UcmDbConnector(_single(model, path), KVConnectorRole.WORKER, _kv_config())
    worker.register_kv_caches(good)
    req = _request("seed", PROMPT)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    sched.update_state_after_alloc(req, _blocks(list(range(1, 7))), 0)
    worker.bind_connector_metadata(sched.build_connector_meta(_new_step(req, list(range(1, 7)), len(PROMPT))))
    worker.start_load_kv(None)  # type: ignore[arg-type]
    worker.wait_for_save()
    worker.clear_connector_metadata()
    worker._worker.drain()
    sched.request_finished(req, list(range(1, 7)))
    worker.shutdown()
    sched.shutdown()


def _run(multi: MultiConnector, meta: Any) -> tuple[Any, set[int], Any]:
    """One step on the workers: (transfer results, load errors, worker metadata)."""
    multi.bind_connector_metadata(meta)
    multi.start_load_kv(None)  # type: ignore[arg-type]
    multi.wait_for_save()
    results = multi.get_transfer_results(set())
    invalid = multi.get_block_ids_with_load_errors()
    worker_meta = multi.build_connector_worker_meta()
    multi.clear_connector_metadata()
    for child in multi._connectors:
        child._worker.drain()  # type: ignore[attr-defined]
    return results, invalid, worker_meta


# -- tests -------------------------------------------------------------------------


def test_after_its_failed_async_load_a_child_holds_its_saves_over_a_sibling_s_load(model_dir: Path, tmp_path: Path) -> None:
    good = _kv(seed=1)
    for name in ("A", "B"):
        _seed_store(model_dir, tmp_path / name, good)
    config = _config(model_dir, KVTransferConfig(
        kv_connector="MultiConnector", kv_role="kv_both", kv_load_failure_policy="recompute",
        kv_connector_extra_config={"connectors": [_child(tmp_path / "A", load_mode="async"), _child(tmp_path / "B")]}))
    sched = MultiConnector(config, KVConnectorRole.SCHEDULER, _kv_config())
    cache = _kv(fill=0.0)
    worker = MultiConnector(config, KVConnectorRole.WORKER, _kv_config())
    worker.register_kv_caches(cache)
    a, b = sched._connectors
    req = _request("R", PROMPT)

    # 1. A (asked first) claims the 5 blocks asynchronously; its block 0 is
    #    evicted before the load, which fails whole.
    assert sched.get_num_new_matched_tokens(req, 0) == (5 * BS, True)
    sched.update_state_after_alloc(req, _blocks([20, 21, 22, 23, 24]), 5 * BS)
    req.num_computed_tokens = 5 * BS
    assert _evict(a._scheduler, req, 0) > 0  # type: ignore[attr-defined]
    deadline = time.monotonic() + 10
    while True:
        results, invalid, worker_meta = _run(worker, sched.build_connector_meta(_idle()))
        if results.finished_recving:
            break
        sched.update_connector_output(_Out(worker_meta, set()))  # type: ignore[arg-type]
        assert time.monotonic() < deadline, "the async load never finished"
    assert invalid == {20, 21, 22, 23, 24}
    req.num_computed_tokens = 0  # vLLM: truncated at the first invalid block
    sched.update_connector_output(_Out(worker_meta, invalid))  # type: ignore[arg-type]

    # 2. vLLM asks again: A has nothing now, B claims the 5 blocks synchronously;
    #    B's block 1 is evicted before the load, and the freshly allocated
    #    blocks hold another request's KV.
    assert sched.get_num_new_matched_tokens(req, 0) == (5 * BS, False)
    assert sched._requests_to_connector["R"] == 1
    ids = [30, 31, 32, 33, 34, 35]
    sched.update_state_after_alloc(req, _blocks(ids), 5 * BS)
    req.num_computed_tokens = 5 * BS
    assert _evict(b._scheduler, req, 1) > 0  # type: ignore[attr-defined]
    stale = _kv(seed=99)
    for name in LAYERS:
        cache[name][30:36] = stale[name][30:36]
    meta = sched.build_connector_meta(_new_step(req, ids, len(PROMPT) - 5 * BS))
    a_meta, b_meta = (cast(UcmDbConnectorMetadata, m) for m in meta.metadata)
    assert [t.block_ids for t in b_meta.loads] == [(30, 31, 32, 33, 34)]
    # A's save over B's loaded blocks waits for the step's outcome, as for a request A never loaded.
    ((save_blocks, after_loads, hold_id),) = [(t.block_ids, t.after_loads, t.hold_id) for t in a_meta.saves]
    assert save_blocks == (30, 31, 32, 33, 34) and after_loads == (30, 31, 32, 33, 34) and hold_id >= 0
    _, invalid, worker_meta = _run(worker, meta)
    assert invalid == {31, 32, 33, 34}
    req.num_computed_tokens = BS  # vLLM recomputes from block 1
    sched.update_connector_output(_Out(worker_meta, invalid))  # type: ignore[arg-type]
    verdicts = sched.build_connector_meta(_idle())
    a_verdicts = cast(UcmDbConnectorMetadata, verdicts.metadata[0])
    assert a_verdicts.held_drops == [hold_id] and a_verdicts.held_commits == []
    _run(worker, verdicts)
    worker.shutdown()
    sched.shutdown()

    # 3. An engine on A's store alone: whatever it loads of the prompt is the computed KV, never the stale.
    restarted = UcmDbConnector(_single(model_dir, tmp_path / "A"), KVConnectorRole.SCHEDULER, _kv_config())
    try:
        hit, _ = restarted.get_num_new_matched_tokens(_request("R2", PROMPT), 0)
        assert hit == 0  # A's block 0 was evicted and nothing computed over B's failed load was stored
    finally:
        restarted.shutdown()


def _async_claim_that_fails(tmp_path: Path) -> tuple[UcmDbScheduler, Any]:
    """A lone scheduler with ``load_mode: "async"`` claims PROMPT's 5 stored
    blocks asynchronously; the load fails, vLLM sends the request back with
    nothing computed; the blocks are gone from the store by the retry."""
    sched = UcmDbScheduler(ConnectorSettings.from_extra_config({"path": str(tmp_path / "s"), "load_mode": "async"}), _shape())
    req = _request("R-" + tmp_path.name, PROMPT)
    _put_units(sched.store, _shape(), sched.keys_for(req, 5))
    assert sched.get_num_new_matched_tokens(req, 0) == (5 * BS, True)
    sched.update_state_after_alloc(req, _blocks([20, 21, 22, 23, 24]), 5 * BS)
    req.num_computed_tokens = 5 * BS
    meta = sched.build_connector_meta(_idle())
    assert [t.block_ids for t in meta.async_loads] == [(20, 21, 22, 23, 24)]
    req.num_computed_tokens = 0
    sched.observe_output(UcmDbWorkerMetadata(meta.step), {20, 21, 22, 23, 24})
    assert _evict(sched, req, 0) > 0
    return sched, req


@pytest.mark.parametrize("sibling", ["ucm-db", "foreign"])
def test_after_a_failed_async_claim_another_connector_s_load_is_treated_as_such(tmp_path: Path, sibling: str) -> None:
    """The retry is claimed by another child: another ucm-db's load (noted
    when vLLM allocates it) is saved over, held for the step's outcome;
    another kind of connector's makes the request save nothing
    (``refuse_saves_over_foreign_load``), as for a request never claimed."""
    sched, req = _async_claim_that_fails(tmp_path)
    try:
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
        sched.update_state_after_alloc(req, _blocks([30, 31, 32, 33, 34, 35]), 0)
        if sibling == "ucm-db":
            composition.note_ucm_db_load(req.request_id)  # what the loading ucm-db child's update_state_after_alloc does
        req.num_computed_tokens = 5 * BS  # the sibling's hit
        meta = sched.build_connector_meta(_new_step(req, [30, 31, 32, 33, 34, 35], len(PROMPT) - 5 * BS))
        saves = [(t.block_ids, t.after_loads, t.hold_id >= 0) for t in meta.saves]
        if sibling == "foreign":
            assert saves == []
        else:
            assert saves == [((30, 31, 32, 33, 34), (30, 31, 32, 33, 34), True)]
    finally:
        sched.shutdown()


def test_an_async_load_of_its_own_is_no_sibling_load(tmp_path: Path) -> None:
    """Back from a successful async load, the request's first step saves past
    the hit over no load: the loaded blocks are this connector's own."""
    sched = UcmDbScheduler(ConnectorSettings.from_extra_config({"path": str(tmp_path / "s"), "load_mode": "async"}), _shape())
    try:
        req = _request("own", PROMPT)
        _put_units(sched.store, _shape(), sched.keys_for(req, 3))
        assert sched.get_num_new_matched_tokens(req, 0) == (3 * BS, True)
        ids = [20, 21, 22, 23, 24, 25]
        sched.update_state_after_alloc(req, _blocks(ids), 3 * BS)
        req.num_computed_tokens = 3 * BS
        meta = sched.build_connector_meta(_idle())
        sched.observe_output(UcmDbWorkerMetadata(meta.step), set())
        sched.update_state_after_alloc(req, _blocks(ids), 0)  # scheduled with no lookup: its hit is in place
        step = sched.build_connector_meta(_new_step(req, ids, len(PROMPT) - 3 * BS))
        assert [(t.block_ids, t.after_loads, t.hold_id) for t in step.saves] == [((23, 24), (), -1)]
    finally:
        sched.shutdown()
