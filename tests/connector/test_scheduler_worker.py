"""Scheduler and worker halves with real vLLM request objects, a real store
and CPU KV tensors, without an engine (fast; the engine tests are in
tests/vllm).

The scheduler plans; the worker executes the plan against KV tensors shaped
like vLLM CPU's; a second worker with zeroed tensors stands for a restarted
engine.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.v1.core.sched.output import CachedRequestData, KVConnectorBlockState, NewRequestData, SchedulerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from ucm_db.connector.identity import KVShape, grid, namespace, reader_spans  # noqa: E402
from ucm_db.connector.metadata import UcmDbConnectorMetadata  # noqa: E402
from ucm_db.connector.scheduler.hooks import UcmDbScheduler  # noqa: E402
from ucm_db.connector.settings import ConnectorSettings  # noqa: E402
from ucm_db.connector.worker.hooks import UcmDbWorker  # noqa: E402
from ucm_db.keys.units import UnitKeys, unit_key, unit_keys_of  # noqa: E402

BS = 32
NUM_BLOCKS = 64


def _shape(tp_size: int = 1, use_mla: bool = False, model: str = "tiny", kv_heads: int = 2, layers: int = 2) -> KVShape:
    return KVShape(
        model=model, kv_dtype="bfloat16", block_size=BS, use_mla=use_mla, layout="cpu-test", tp_size=tp_size, pp_size=1,
        kv_heads=kv_heads, layers=layers,
    )


def _put_units(store: object, shape: KVShape, keys: list[bytes]) -> None:
    """Stores a payload for every unit of ``keys`` (what all ranks save)."""
    for span in reader_spans(shape):
        store.put(namespace(shape), list(UnitKeys(keys, grid(shape), span)), [b"kv"] * len(keys), parent=None)  # type: ignore[attr-defined]


def _request(req_id: str, tokens: list[int], **kwargs: object) -> Request:
    return Request(req_id, tokens, SamplingParams(max_tokens=4), None, **kwargs)  # type: ignore[arg-type]


def _kv() -> dict[str, torch.Tensor]:
    return {f"layers.{i}.attn": torch.zeros(NUM_BLOCKS, 2, BS, 128, dtype=torch.bfloat16) for i in range(2)}


def _new_step(req: Request, block_ids: list[int], num_tokens: int) -> SchedulerOutput:
    new = NewRequestData.from_request(req, (block_ids,))
    out = SchedulerOutput(
        scheduled_new_reqs=[new], scheduled_cached_reqs=CachedRequestData.make_empty(),
        num_scheduled_tokens={req.request_id: num_tokens}, total_num_scheduled_tokens=num_tokens,
        scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={}, finished_req_ids=set(), free_encoder_mm_hashes=[],
    )
    out.kv_connector_block_state = KVConnectorBlockState({req.request_id}, lambda _rid: (block_ids,), {})
    return out


def _admit(sched: UcmDbScheduler, req: Request, local_tokens: int = 0) -> int:
    """What vLLM's scheduler does for a new request: lookup, alloc, set computed."""
    ext, is_async = sched.get_num_new_matched_tokens(req, local_tokens)
    assert is_async is False
    sched.update_state_after_alloc(req, None, ext)  # type: ignore[arg-type]
    req.num_computed_tokens = local_tokens + ext
    return ext


@pytest.fixture()
def settings(tmp_path: Path) -> ConnectorSettings:
    return ConnectorSettings.from_extra_config({"path": str(tmp_path / "store")})


@pytest.fixture(params=["zstd", "none", "zstd+save_process", "none+save_process"])
def each_codec(tmp_path: Path, request: pytest.FixtureRequest) -> ConnectorSettings:
    """Settings of a store in each codec: a ``none`` store's units are
    loaded straight into the caches' slabs, a zstd one's staged; each also
    with saves committed by a commit process (``save_process``)."""
    codec, _, process = request.param.partition("+")
    return ConnectorSettings.from_extra_config({"path": str(tmp_path / "store"), "codec": codec, "save_process": bool(process)})


def _save_prompt(settings: ConnectorSettings, tokens: list[int], kv: dict[str, torch.Tensor], **req_kwargs: object) -> None:
    """A first engine: computes nothing, but saves `kv` blocks 0.. for `tokens`."""
    sched = UcmDbScheduler(settings, _shape())
    worker = UcmDbWorker(settings, _shape(), NUM_BLOCKS)
    worker.register_kv_caches(kv, 0, 0)
    req = _request("a", tokens, **req_kwargs)
    assert _admit(sched, req) == 0
    block_ids = list(range(len(tokens) // BS + 1))
    meta = sched.build_connector_meta(_new_step(req, block_ids, len(tokens)))
    assert meta.loads == [] and len(meta.saves) == 1
    worker.save(meta)
    worker.drain()
    sched.request_finished(req, block_ids)
    worker.shutdown()
    sched.shutdown()


def restarted(settings: ConnectorSettings, tokens: list[int]) -> tuple[dict[str, torch.Tensor], UcmDbScheduler, UcmDbWorker, dict[str, torch.Tensor]]:
    """Random KV saved for ``tokens`` by a first engine, then a restarted
    engine's halves: (the saved KV, scheduler, worker, its zeroed KV caches)."""
    kv = {name: torch.randn(t.shape).to(torch.bfloat16) for name, t in _kv().items()}
    _save_prompt(settings, tokens, kv)
    sched = UcmDbScheduler(settings, _shape())
    worker = UcmDbWorker(settings, _shape(), NUM_BLOCKS)
    fresh = _kv()
    worker.register_kv_caches(fresh, 0, 0)
    return kv, sched, worker, fresh


def test_round_trip_restart_loads_at_allocated_blocks(each_codec: ConnectorSettings) -> None:
    settings = each_codec
    tokens = list(range(1, 5 * BS + 10))  # 5 full blocks + 9 tokens
    kv, sched, worker, fresh = restarted(settings, tokens)
    assert worker.layout.writes_units_in_place
    in_place: list[object] = []
    real_slabs = worker.layout.unit_slabs
    worker.layout.unit_slabs = lambda ids: in_place.append(ids) or real_slabs(ids)  # type: ignore[method-assign]
    req = _request("b", tokens)
    assert sched.get_num_new_matched_tokens(req, 0) == (5 * BS, False)
    assert sched.get_num_new_matched_tokens(req, 0) == (5 * BS, False)  # no side effects
    assert _admit(sched, req) == 5 * BS
    targets = [10, 11, 12, 13, 14, 15]
    meta = sched.build_connector_meta(_new_step(req, targets, len(tokens) - 5 * BS))
    (load,) = meta.loads
    assert load.block_ids == (10, 11, 12, 13, 14)
    worker.start_load(meta)
    assert worker.take_load_errors() == set()
    assert in_place  # either codec: decoded into the caches' slabs, no staging
    for name in kv:
        assert torch.equal(fresh[name][10:15].view(torch.int16), kv[name][0:5].view(torch.int16))
    assert not fresh[name][15].any()
    worker.shutdown()
    sched.shutdown()


def test_never_claims_the_whole_prompt(settings: ConnectorSettings) -> None:
    tokens = list(range(1, 4 * BS + 1))  # exactly 4 blocks
    _save_prompt(settings, tokens, _kv())
    sched = UcmDbScheduler(settings, _shape())
    # The last block holds the last token, which must be computed.
    assert sched.get_num_new_matched_tokens(_request("b", tokens), 0) == (3 * BS, False)
    # Beyond vLLM's own hit only.
    assert sched.get_num_new_matched_tokens(_request("c", tokens), 2 * BS) == (BS, False)
    assert sched.get_num_new_matched_tokens(_request("d", tokens), 3 * BS) == (0, False)
    sched.shutdown()


def test_partial_prefix_and_extras(settings: ConnectorSettings) -> None:
    tokens = list(range(1, 6 * BS + 1))
    _save_prompt(settings, tokens, _kv())
    sched = UcmDbScheduler(settings, _shape())
    branched = tokens[: 3 * BS] + [7] * (3 * BS)
    assert sched.get_num_new_matched_tokens(_request("p", branched), 0) == (3 * BS, False)
    assert sched.get_num_new_matched_tokens(_request("s", tokens, cache_salt="other"), 0) == (0, False)
    from vllm.lora.request import LoRARequest

    lora = LoRARequest("adapter", 1, "/nonexistent")
    assert sched.get_num_new_matched_tokens(_request("l", tokens, lora_request=lora), 0) == (0, False)
    other_model = UcmDbScheduler(settings, _shape(model="another"))
    assert other_model.get_num_new_matched_tokens(_request("m", tokens), 0) == (0, False)
    other_model.shutdown()
    sched.shutdown()


def test_salted_request_hits_its_own_salt(settings: ConnectorSettings) -> None:
    tokens = list(range(1, 3 * BS + 5))
    _save_prompt(settings, tokens, _kv(), cache_salt="tenant-a")
    sched = UcmDbScheduler(settings, _shape())
    assert sched.get_num_new_matched_tokens(_request("a2", tokens, cache_salt="tenant-a"), 0) == (3 * BS, False)
    assert sched.get_num_new_matched_tokens(_request("n", tokens), 0) == (0, False)
    sched.shutdown()


def test_saves_are_incremental_across_steps(settings: ConnectorSettings) -> None:
    sched = UcmDbScheduler(settings, _shape())
    tokens = list(range(1, 3 * BS + 20))
    req = _request("r", tokens)
    _admit(sched, req)
    block_ids = [5, 6, 7, 8]
    # Chunked prefill: 40 tokens, then the rest.
    meta = sched.build_connector_meta(_new_step(req, block_ids, 40))
    assert [s.block_ids for s in meta.saves] == [(5,)]
    assert meta.saves[0].parent is None
    req.num_computed_tokens = 40
    step2 = _new_step(req, block_ids, len(tokens) - 40)
    step2.scheduled_new_reqs = []
    meta2 = sched.build_connector_meta(step2)
    (save,) = meta2.saves
    assert save.block_ids == (6, 7)
    first_key = meta.saves[0].keys[0]
    assert save.parent == first_key
    sched.shutdown()


def test_missing_block_is_reported_as_load_error(each_codec: ConnectorSettings) -> None:
    settings = each_codec
    tokens = list(range(1, 4 * BS + 3))
    _save_prompt(settings, tokens, _kv())
    sched = UcmDbScheduler(settings, _shape())
    req = _request("b", tokens)
    assert _admit(sched, req) == 4 * BS
    meta = sched.build_connector_meta(_new_step(req, [20, 21, 22, 23, 24], 2))
    ns, g = namespace(_shape()), grid(_shape())
    # Both halves share the process's one handle of the store. One head's
    # unit of block 2 (and, prefix invariant, that head's unit of block 3).
    assert sched.store.delete(ns, [unit_key(meta.loads[0].keys[2], reader_spans(_shape())[1], g)]) == 2
    worker = UcmDbWorker(settings, _shape(), NUM_BLOCKS)
    worker.register_kv_caches(_kv(), 0, 0)
    worker.start_load(meta)
    assert worker.take_load_errors() == {22, 23}
    assert worker.counters.totals.data["load_errors"] == 2
    worker.shutdown()
    sched.shutdown()


def test_layer_mode_waits_per_layer(tmp_path: Path) -> None:
    settings = ConnectorSettings.from_extra_config({"path": str(tmp_path / "s"), "load_mode": "layer"})
    tokens = list(range(1, 3 * BS + 3))
    kv = {name: torch.randn(t.shape).to(torch.bfloat16) for name, t in _kv().items()}
    _save_prompt(settings, tokens, kv)
    sched = UcmDbScheduler(settings, _shape())
    req = _request("b", tokens)
    _admit(sched, req)
    meta = sched.build_connector_meta(_new_step(req, [30, 31, 32, 33], 2))
    worker = UcmDbWorker(settings, _shape(), NUM_BLOCKS)
    fresh = _kv()
    worker.register_kv_caches(fresh, 0, 0)
    worker.start_load(meta)
    for name in fresh:  # what each attention layer does before running
        worker.wait_for_layer(name)
        assert torch.equal(fresh[name][30:33].view(torch.int16), kv[name][0:3].view(torch.int16))
    assert worker.take_load_errors() == set()
    worker.shutdown()
    sched.shutdown()


def test_namespace_is_the_same_at_every_tp_size_and_mla_has_one_unit() -> None:
    assert len({namespace(_shape(tp_size=tp, kv_heads=8)).digest for tp in (1, 2, 4, 8)}) == 1
    assert [(s.head_start, s.head_stop) for s in reader_spans(_shape(tp_size=4, kv_heads=2))] == [(0, 1), (1, 2)]
    mla = _shape(tp_size=4, use_mla=True)
    assert reader_spans(mla) == [grid(mla).whole]


def test_hit_requires_every_tp_rank(tmp_path: Path) -> None:
    settings = ConnectorSettings.from_extra_config({"path": str(tmp_path / "s")})
    shape = _shape(tp_size=2, kv_heads=4)  # two heads per rank, as _kv() holds
    tokens = list(range(1, 3 * BS + 3))
    sched = UcmDbScheduler(settings, shape)
    req = _request("a", tokens)
    _admit(sched, req)
    meta = sched.build_connector_meta(_new_step(req, [0, 1, 2, 3], len(tokens)))
    rank0 = UcmDbWorker(settings, shape, NUM_BLOCKS)
    rank0.register_kv_caches(_kv(), 0, 0)
    rank0.save(meta)
    rank0.drain()
    assert sched.get_num_new_matched_tokens(_request("b", tokens), 0) == (0, False)  # rank 1 has nothing yet
    rank1 = UcmDbWorker(settings, shape, NUM_BLOCKS)
    rank1.register_kv_caches(_kv(), 1, 0)
    rank1.save(meta)
    rank1.drain()
    assert sched.get_num_new_matched_tokens(_request("c", tokens), 0) == (3 * BS, False)
    for part in (rank0, rank1, sched):
        part.shutdown()


def test_full_writer_queue_drops_and_counts(tmp_path: Path) -> None:
    settings = ConnectorSettings.from_extra_config({"path": str(tmp_path / "s"), "max_pending_save_bytes": 1 << 20})
    worker = UcmDbWorker(settings, _shape(kv_heads=8, layers=4), NUM_BLOCKS)
    big = {f"layers.{i}.attn": torch.zeros(NUM_BLOCKS, 8, BS, 128, dtype=torch.bfloat16) for i in range(4)}
    worker.register_kv_caches(big, 0, 0)  # 256 KiB per block
    sched = UcmDbScheduler(settings, _shape(kv_heads=8, layers=4))
    req = _request("a", list(range(1, 8 * BS + 2)))
    _admit(sched, req)
    meta = sched.build_connector_meta(_new_step(req, list(range(9)), 8 * BS + 1))
    worker.save(meta)  # 8 blocks = 2 MiB > 1 MiB: dropped, never blocking
    worker.drain()
    assert worker.counters.totals.data["saves_dropped"] == 8
    worker.shutdown()
    sched.shutdown()


@pytest.mark.parametrize("fails", ["queueing", "on the device"])
def test_a_failed_copy_out_of_the_kv_cache_loses_that_save_not_the_step(settings: ConnectorSettings,
                                                                        monkeypatch: pytest.MonkeyPatch, fails: str) -> None:
    """A device out of memory while a save queues its gather (the model's
    thread), or a copy that fails on the device once queued (seen by the
    writer when it waits for it): counted and logged, nothing of that save
    committed, its staging back in the pool, and the next save lands. The
    faults are raised by stand-ins: a real device fault cannot be produced
    on a CPU host."""
    from ucm_db.connector.device_saves import SaveCopy

    worker = UcmDbWorker(settings, _shape(), NUM_BLOCKS)
    worker.register_kv_caches(_kv(), 0, 0)
    sched = UcmDbScheduler(settings, _shape())
    real_gather = worker.layout.gather_units_async

    class _FailedOnDevice:
        def query(self) -> bool:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def faulty(block_ids: list[int], staging: torch.Tensor) -> SaveCopy:
        if fails == "queueing":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        real_gather(block_ids, staging).wait()
        return SaveCopy(_FailedOnDevice())  # type: ignore[arg-type]

    monkeypatch.setattr(worker.layout, "gather_units_async", faulty)
    req = _request("a", list(range(1, 3 * BS + 2)))
    _admit(sched, req)
    worker.save(sched.build_connector_meta(_new_step(req, [0, 1, 2, 3], 3 * BS + 1)))  # no exception out of the step
    worker.drain()
    assert worker.counters.totals.data["save_errors"] == 3 and worker.counters.totals.data.get("saved_blocks", 0) == 0
    assert worker._store.stats().blocks == 0
    monkeypatch.setattr(worker.layout, "gather_units_async", real_gather)
    again = _request("b", list(range(1000, 1000 + 3 * BS + 1)))
    _admit(sched, again)
    worker.save(sched.build_connector_meta(_new_step(again, [4, 5, 6, 7], 3 * BS + 1)))
    worker.drain()
    assert worker.counters.totals.data["saved_blocks"] == 3
    worker.shutdown()
    sched.shutdown()


def test_lookup_of_a_32k_prompt_is_fast(settings: ConnectorSettings) -> None:
    # Not a benchmark (see connector/bench_overhead.py): a guard against an
    # accidental O(n^2) or per-block store read.
    sched = UcmDbScheduler(settings, _shape())
    tokens = list(range(32 * 1024))
    started = time.perf_counter()
    assert sched.get_num_new_matched_tokens(_request("big", tokens), 0) == (0, False)
    assert time.perf_counter() - started < 0.5
    sched.shutdown()


def test_metadata_is_plain() -> None:
    assert UcmDbConnectorMetadata().empty


def test_request_extras_cover_salt_and_lora(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.lora.request import LoRARequest

    from ucm_db.connector import fingerprints
    from ucm_db.connector.request_keys import request_extras

    monkeypatch.setattr(fingerprints, "_adapters", {})  # what this process loaded before: none
    monkeypatch.setattr(fingerprints, "_adapter_ids", {})
    assert request_extras(_request("a", [1, 2, 3])) == {}
    assert request_extras(_request("b", [1, 2, 3], cache_salt="s")) == {"cache_salt": "s"}
    # A LoRA adapter by its files, not its name (issue 48; tests/connector/test_identity_inputs.py) ...
    (tmp_path / "adapter_config.json").write_text('{"r": 8}')
    (tmp_path / "adapter_model.safetensors").write_bytes(b"lora")
    lora = request_extras(_request("c", [1, 2, 3], lora_request=LoRARequest("ad", 1, str(tmp_path))))["lora"]
    assert lora.startswith("blake3:")
    assert request_extras(_request("d", [1, 2, 3], lora_request=LoRARequest("alias", 2, str(tmp_path)))) == {"lora": lora}
    # ... by name and path only where the path is no local directory (a hub id).
    assert request_extras(_request("e", [1, 2, 3], lora_request=LoRARequest("ad", 1, "/x"))) == {"lora": 'unhashed:["ad", "/x"]'}


def _mm(identifier: str, offset: int, length: int) -> object:
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    return MultiModalFeatureSpec(data=None, modality="image", identifier=identifier, mm_position=PlaceholderRange(offset, length))


def test_multimodal_prompts_share_the_text_prefix_before_their_first_item(settings: ConnectorSettings) -> None:
    """Per-block multimodal extras: blocks before an image keep plain keys
    (hits for a shared system prompt), the image's blocks and every block
    after them depend on the image's identity."""
    sched = UcmDbScheduler(settings, _shape())
    tokens = list(range(10 * BS))
    plain = sched.keys_for(_request("plain", tokens), 10)
    cat = sched.keys_for(_request("cat", tokens, mm_features=[_mm("cat", 3 * BS + 5, 2 * BS)]), 10)
    dog = sched.keys_for(_request("dog", tokens, mm_features=[_mm("dog", 3 * BS + 5, 2 * BS)]), 10)
    cat_later = sched.keys_for(_request("cat2", tokens, mm_features=[_mm("cat", 4 * BS + 5, 2 * BS)]), 10)
    assert cat[:3] == dog[:3] == plain[:3]
    assert all(len({a, b, c}) == 3 for a, b, c in zip(cat[3:], dog[3:], plain[3:]))
    assert cat_later[:4] == plain[:4] and cat_later[4] not in (cat[4], plain[4])
    # Incremental hashing (the scheduler extends a request's chain block by
    # block as it grows) gives the same keys as hashing at once.
    grown = _request("grown", tokens, mm_features=[_mm("cat", 3 * BS + 5, 2 * BS)])
    assert sched.keys_for(grown, 2) == cat[:2]
    assert sched.keys_for(grown, 4) == cat[:4]
    assert sched.keys_for(grown, 10) == cat
    # A stored multimodal prompt: the same image hits all of it, another image
    # only the text blocks before it.
    _put_units(sched.store, _shape(), cat)
    assert sched.get_num_new_matched_tokens(_request("cat3", tokens + [1], mm_features=[_mm("cat", 3 * BS + 5, 2 * BS)]), 0)[0] == 10 * BS
    assert sched.get_num_new_matched_tokens(_request("dog2", tokens + [1], mm_features=[_mm("dog", 3 * BS + 5, 2 * BS)]), 0)[0] == 3 * BS
    sched.shutdown()


def test_prompt_embeds_key_each_block_by_its_own_rows(settings: ConnectorSettings) -> None:
    sched = UcmDbScheduler(settings, _shape())
    embeds = torch.randn(4 * BS, 16)
    changed = embeds.clone()
    changed[2 * BS + 1] += 1  # a row of block 2

    def keys(req_id: str, rows: torch.Tensor) -> list[bytes]:
        return sched.keys_for(Request(req_id, None, SamplingParams(max_tokens=1), None, prompt_embeds=rows), 4)

    same, again, other = keys("e1", embeds), keys("e2", embeds.clone()), keys("e3", changed)
    assert same == again and len(same) == 4
    assert other[:2] == same[:2] and all(a != b for a, b in zip(other[2:], same[2:]))
    assert keys("e4", embeds + 1)[0] != same[0]
    sched.shutdown()


def test_blocks_vllm_serves_whole_are_not_saved_again_when_stored(settings: ConnectorSettings) -> None:
    """A request whose every full block vLLM's own prefix cache holds (a
    second pass on a cache big enough) claims nothing; its stored blocks
    are not planned for saving again, while a prompt the store lacks is
    still saved."""
    tokens = list(range(1, 3 * BS + 20))
    kv = {name: torch.randn(t.shape).to(torch.bfloat16) for name, t in _kv().items()}
    _save_prompt(settings, tokens, kv)
    sched = UcmDbScheduler(settings, _shape())
    block_ids = [5, 6, 7, 8]
    served = _request("served", tokens)
    assert _admit(sched, served, local_tokens=3 * BS) == 0
    meta = sched.build_connector_meta(_new_step(served, block_ids, len(tokens) - 3 * BS))
    assert meta.saves == [] and meta.loads == []
    fresh = _request("fresh", [t + 10_000 for t in tokens])
    assert _admit(sched, fresh, local_tokens=3 * BS) == 0
    meta = sched.build_connector_meta(_new_step(fresh, block_ids, len(tokens) - 3 * BS))
    assert [s.block_ids for s in meta.saves] == [(5, 6, 7)], "blocks the store lacks are saved"
    sched.shutdown()


def test_the_scheduler_touches_what_it_plans_to_load_and_the_worker_reads_without_touching(settings: ConnectorSettings) -> None:
    """A load's recency is written from the scheduler's process: the
    worker's store buffers the read's hits but no touches (so its
    maintenance thread never takes the GIL from the model's thread), and
    touches a transfer no scheduler touched."""
    tokens = list(range(1, 5 * BS + 10))
    _kv_saved, sched, worker, _fresh = restarted(settings, tokens)
    store = sched._store  # one handle per process: the worker's too
    store._activity.take()  # the first engine's activity: not this test's
    req = _request("b", tokens)
    assert _admit(sched, req) == 5 * BS
    meta = sched.build_connector_meta(_new_step(req, [10, 11, 12, 13, 14, 15], len(tokens) - 5 * BS))
    (load,) = meta.loads
    units = set(unit_keys_of(load.keys, reader_spans(_shape()), grid(_shape())))
    assert load.touched and len(units) == 5 * len(reader_spans(_shape()))
    assert set(store._activity.take().touched) == units  # touched when planned, before any worker read
    worker.start_load(meta)
    assert worker.take_load_errors() == set()
    read = store._activity.take()
    assert (read.hits, read.misses, read.touched) == (len(units), 0, {})
    worker.start_load(UcmDbConnectorMetadata(loads=[dataclasses.replace(load, touched=False)], step=meta.step + 1))
    assert worker.take_load_errors() == set()
    assert set(store._activity.take().touched) == units
    worker.shutdown()
    sched.shutdown()
