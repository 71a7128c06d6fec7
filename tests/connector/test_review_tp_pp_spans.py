"""Review of "any TP reads any TP" and pipeline parallelism against vLLM's own
split of heads and layers (docs/tp.md; not covered by test_tp_units.py,
which has one stage and hand-made shapes, nor test_tp_scheduler.py, which
has even splits and one head per rank).

What is checked, each through vLLM's real config objects (``VllmConfig``
and ``ModelConfig`` of a model directory with ``L`` layers and ``H`` KV
heads, via ``stand_in_engine.vllm_config``), the real connector facade of
both roles (``UcmDbConnector``: ``kv_shape``, ``stage_layers``,
``rank_spans``, ``_check_layout``, the scheduler's lookup and async
claim), real LMDB stores and CPU KV tensors:

* a stage's layers are the ones vLLM builds (``ModelConfig.
  get_layers_start_end_indices``) for uneven layer counts and under
  ``VLLM_PP_LAYER_PARTITION``, and every stage's units tile the KV grid;
* each rank's KV cache is shaped as vLLM sizes it (``ModelConfig.
  get_num_kv_heads``) and holds the heads vLLM's ``QKVParallelLinear``
  gives it (``shard_rank = tp_rank // num_kv_head_replicas``);
* a store written at TP=4 x PP=2 with 2 KV heads (each head replicated on
  two ranks; 5 layers split 3+2) holds every unit once, is claimed only
  once the last writer's unit is in, serves readers at TP 1, 2 and 4 at
  PP=2 bit for bit, asynchronously (a pipeline's batch queue), and is a
  miss, never other bytes, at PP=1 or under another layer partition;
  the same for MLA's latent at TP=2 x PP=2 (written by TP rank 0 only);
* a block one stage never wrote is no hit, and the next engine that
  computes the prompt stores only the missing units.

The one stand-in: ``engine_facts.ranks`` is patched to each rank (no
torch.distributed groups in one process); every rank's connector is built
from its own ``VllmConfig`` and the ``KVCacheConfig`` vLLM would project
onto that rank (its stage's layer names). The MLA case uses a Llama config
with vLLM's ``MLAAttentionSpec``: the connector reads MLA from the spec.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.config import ModelConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from stand_in_engine import vllm_config  # noqa: E402
from test_async_loads import _idle_step  # noqa: E402
from test_tp_scheduler import _step  # noqa: E402

from ucm_db.connector import UcmDbConnector, engine_facts  # noqa: E402
from ucm_db.connector.identity import reader_spans, stage_layers  # noqa: E402
from ucm_db.keys.units import KVGrid, UnitSpan, plan_read  # noqa: E402

BS, NUM_BLOCKS, HEAD, LATENT = 32, 8, 32, 48
LAYER = "model.layers.{}.self_attn.attn"
PROMPT = list(range(1, 3 * BS + 2))  # 3 whole blocks
SRC, DST = [5, 1, 6], [2, 7, 3]  # block ids written from, loaded into


def _model(root: Path, layers: int, kv_heads: int) -> Path:
    out = root / f"llama-{layers}l-{kv_heads}h"
    if not out.exists():
        out.mkdir(parents=True)
        (out / "config.json").write_text(json.dumps({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8 * HEAD, "intermediate_size": 256,
            "num_hidden_layers": layers, "num_attention_heads": 8, "num_key_value_heads": kv_heads, "head_dim": HEAD,
            "vocab_size": 1000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "torch_dtype": "float32",
            "tie_word_embeddings": False}))
    return out


def _config(root: Path, layers: int, kv_heads: int, tp: int, pp: int, load_mode: str = "block") -> VllmConfig:
    config = vllm_config(root, root / "store", {"load_mode": load_mode})
    config.model_config = ModelConfig(model=str(_model(root, layers, kv_heads)), skip_tokenizer_init=True, dtype="float32",
                                      max_model_len=4096)
    config.parallel_config.tensor_parallel_size = tp
    config.parallel_config.pipeline_parallel_size = pp
    return config


def _vllm_stage(config: VllmConfig, stage: int) -> tuple[int, int]:
    """The layers vLLM builds on ``stage`` (the worker of global rank stage * tp, its layout DP x PP x TP)."""
    parallel = config.parallel_config
    saved, parallel.rank = parallel.rank, stage * parallel.tensor_parallel_size
    try:
        return config.model_config.get_layers_start_end_indices(parallel)
    finally:
        parallel.rank = saved


def _vllm_heads(kv_heads: int, tp: int, rank: int) -> tuple[int, int]:
    """The KV heads vLLM's QKVParallelLinear loads on ``rank`` (its weight loader's rule)."""
    if tp >= kv_heads:
        head = rank // (tp // kv_heads)  # shard_rank = tp_rank // num_kv_head_replicas
        return head, head + 1
    per_rank = kv_heads // tp
    return rank * per_rank, (rank + 1) * per_rank


def _kv_cache_config(config: VllmConfig, stage: int, mla: bool) -> KVCacheConfig:
    """What vLLM hands a worker of ``stage``: its layers in the model's one group."""
    start, stop = _vllm_stage(config, stage)
    if mla:
        spec: Any = MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=LATENT, dtype=torch.float32)
    else:
        spec = FullAttentionSpec(block_size=BS, num_kv_heads=config.model_config.get_num_kv_heads(config.parallel_config),
                                 head_size=HEAD, dtype=torch.float32)
    group = KVCacheGroupSpec([LAYER.format(i) for i in range(start, stop)], spec)
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[group])


def _scheduler(config: VllmConfig, mla: bool = False) -> UcmDbConnector:
    return UcmDbConnector(config, KVConnectorRole.SCHEDULER, _kv_cache_config(config, 0, mla))  # vLLM: stage 0's config


def _worker(config: VllmConfig, tp_rank: int, stage: int, model_kv: list[torch.Tensor], mla: bool,
            fill: bool) -> tuple[UcmDbConnector, dict[str, torch.Tensor]]:
    """A rank's connector over its share of ``model_kv`` (copied, or zeroed to load into)."""
    tp = config.parallel_config.tensor_parallel_size
    start, stop = _vllm_stage(config, stage)
    first, last = (0, 1) if mla else _vllm_heads(len(model_kv[0][0]), tp, tp_rank)
    caches = {LAYER.format(i): model_kv[i][:, first:last].clone() if fill else torch.zeros_like(model_kv[i][:, first:last])
              for i in range(start, stop)}
    with mock.patch.object(engine_facts, "ranks", return_value=(tp_rank, stage)):
        connector = UcmDbConnector(config, KVConnectorRole.WORKER, _kv_cache_config(config, stage, mla))
        connector.register_kv_caches(caches)
    return connector, caches


def _request(req_id: str) -> Request:
    return Request(req_id, PROMPT, SamplingParams(max_tokens=1), None)


def _model_kv(layers: int, kv_heads: int, mla: bool) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(layers * 10 + kv_heads)
    shape = (NUM_BLOCKS, 1, BS, LATENT) if mla else (NUM_BLOCKS, kv_heads, BS, 2 * HEAD)
    return [torch.randn(*shape, generator=gen) for _ in range(layers)]


def _claim(scheduler: UcmDbConnector, req_id: str) -> tuple[int | None, bool]:
    return scheduler.get_num_new_matched_tokens(_request(req_id), 0)


def _write(root: Path, layers: int, kv_heads: int, tp: int, pp: int, model_kv: list[torch.Tensor], mla: bool,
           stages: range | None = None) -> list[tuple[int, int, int | None]]:
    """Runs one engine's prefill of PROMPT at ``tp`` x ``pp`` (every rank's
    save, ranks in order; only ``stages`` given), its scheduler asked for a
    hit after each rank: [(stage, tp rank, tokens claimed)]."""
    config = _config(root, layers, kv_heads, tp, pp)
    scheduler = _scheduler(config, mla)
    request = _request("prefill")
    assert _claim(scheduler, "prefill") == (0, False)
    scheduler.update_state_after_alloc(request, KVCacheBlocks(([],)), 0)
    meta = scheduler.build_connector_meta(_step(request, SRC + [0], len(PROMPT)))
    claims = []
    for stage in stages if stages is not None else range(pp):
        for rank in range(tp):
            worker, _ = _worker(config, rank, stage, model_kv, mla, fill=True)
            worker.bind_connector_metadata(meta)
            worker.wait_for_save()
            worker.clear_connector_metadata()
            worker.shutdown()  # drains its writer
            claims.append((stage, rank, _claim(scheduler, f"probe-{stage}-{rank}")[0]))
    scheduler.shutdown()
    return claims


def _read(root: Path, layers: int, kv_heads: int, tp: int, pp: int, model_kv: list[torch.Tensor], mla: bool) -> int:
    """A fresh engine at ``tp`` x ``pp`` claims PROMPT; every rank loads the
    claim; each rank's blocks must equal its share of ``model_kv`` bit for
    bit. Returns the tokens claimed (0: nothing loaded)."""
    config = _config(root, layers, kv_heads, tp, pp)
    scheduler = _scheduler(config, mla)
    request = _request("reader")
    claimed, is_async = scheduler.get_num_new_matched_tokens(request, 0)
    assert claimed is not None
    if not claimed:
        scheduler.shutdown()
        return 0
    assert is_async, "a pipeline-parallel engine overlaps its steps: every claim is async"
    scheduler.update_state_after_alloc(request, KVCacheBlocks(([KVCacheBlock(b) for b in DST],)), claimed)
    meta = scheduler.build_connector_meta(_idle_step())
    assert [t.block_ids for t in meta.async_loads] == [tuple(DST[: claimed // BS])] and not meta.loads
    for stage in range(pp):
        for rank in range(tp):
            worker, caches = _worker(config, rank, stage, model_kv, mla, fill=False)
            worker.bind_connector_metadata(meta)
            worker.start_load_kv(None)  # type: ignore[arg-type]
            assert _finished(worker) == {"reader"} and worker.get_block_ids_with_load_errors() == set()
            first, last = (0, 1) if mla else _vllm_heads(kv_heads, tp, rank)
            for name, cache in caches.items():
                want = model_kv[int(name.split(".")[2])][SRC, first:last]
                assert torch.equal(cache[DST].view(torch.int32), want.view(torch.int32)), (tp, pp, stage, rank, name)
            worker.clear_connector_metadata()
            worker.shutdown()
    scheduler.shutdown()
    return claimed


def _finished(worker: UcmDbConnector, timeout_s: float = 10.0) -> set[str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        _, done = worker.get_finished(set())
        if done:
            return done
        time.sleep(0.01)
    raise AssertionError("the async load never finished")


def _units(root: Path) -> int:
    import ucm_db

    with ucm_db.open(root / "store") as store:
        return store.stats().blocks


@pytest.fixture()
def partition(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    def set_partition(value: str | None) -> None:
        if value is None:
            monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
        else:
            monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", value)
    yield set_partition


@pytest.mark.parametrize(("layers", "pp", "layer_partition"), [
    (5, 2, None), (7, 3, None), (6, 4, None), (5, 2, "1,4"), (7, 3, "3,1,3"), (5, 2, "3,2")])
def test_stage_layers_are_the_ones_vllm_builds_and_the_stages_tile_the_grid(
        tmp_path: Path, partition: Any, layers: int, pp: int, layer_partition: str | None) -> None:
    partition(layer_partition)
    config = _config(tmp_path, layers, 2, 2, pp)
    connector = _scheduler(config)
    try:
        shape = connector.shape
        assert (shape.layers, shape.kv_heads, shape.pp_size) == (layers, 2, pp)
        assert [stage_layers(shape, s) for s in range(pp)] == [_vllm_stage(config, s) for s in range(pp)]
        # Every (head, layer) cell of the block lies in exactly one unit a hit needs, one unit a head and stage.
        cells = [(h, layer) for span in reader_spans(shape) for h in span.heads for layer in span.layers]
        assert sorted(cells) == [(h, layer) for h in range(2) for layer in range(layers)]
        assert len(plan_read(KVGrid(2, layers).whole, reader_spans(shape))) == 2 * pp
    finally:
        connector.shutdown()


def test_another_layer_partition_names_other_units(tmp_path: Path, partition: Any) -> None:
    """Default 5-layer split 3+2 and VLLM_PP_LAYER_PARTITION "3,2" are the same
    bytes (same keys); "1,4" is not (no key in common)."""
    spans = {}
    for name in (None, "3,2", "1,4"):
        partition(name)
        connector = _scheduler(_config(tmp_path, 5, 2, 1, 2))
        spans[name] = set(reader_spans(connector.shape))
        connector.shutdown()
    assert spans[None] == spans["3,2"] and not spans[None] & spans["1,4"]
    assert UnitSpan(0, 1, 0, 3) in spans[None] and UnitSpan(1, 2, 1, 5) in spans["1,4"]


@pytest.mark.parametrize(("kv_heads", "writer_tp", "mla"), [(2, 4, False), (1, 2, True)],
                         ids=["gqa-2heads-tp4", "mla-tp2"])
def test_a_pp2_store_serves_any_tp_at_pp2_and_is_a_miss_at_pp1_or_another_split(
        tmp_path: Path, partition: Any, kv_heads: int, writer_tp: int, mla: bool) -> None:
    layers = 5  # split 3 + 2 by vLLM: uneven
    model_kv = _model_kv(layers, kv_heads, mla)
    claims = _write(tmp_path, layers, kv_heads, writer_tp, 2, model_kv, mla)
    # One writer per head and stage (replicated heads: the first rank holding one; MLA: TP rank 0):
    # the claim appears with the last unit, written by stage 1's last writer.
    last_writer = max((s, r) for s, r, _ in claims if r % (writer_tp // kv_heads) == 0)
    assert [(s, r) for s, r, tokens in claims if tokens] == [(s, r) for s, r, _ in claims if (s, r) >= last_writer]
    assert claims[-1][2] == 3 * BS
    assert _units(tmp_path) == 3 * kv_heads * 2  # blocks x heads x stages, each unit once
    for tp in (1, 2, 4):
        assert _read(tmp_path, layers, kv_heads, tp, 2, model_kv, mla) == 3 * BS, tp
    assert _read(tmp_path, layers, kv_heads, 1, 1, model_kv, mla) == 0  # another stage split: other units
    partition("1,4")
    assert _read(tmp_path, layers, kv_heads, 2, 2, model_kv, mla) == 0
    assert _units(tmp_path) == 3 * kv_heads * 2


def test_a_stage_that_never_wrote_is_no_hit_and_the_next_prefill_stores_only_its_units(tmp_path: Path) -> None:
    """TP=2 x PP=2, 2 heads: stage 1's ranks die before saving. Nothing is
    claimed; the next engine computing the prompt saves every unit again,
    and only stage 1's are new."""
    model_kv = _model_kv(4, 2, False)
    claims = _write(tmp_path, 4, 2, 2, 2, model_kv, False, stages=range(1))
    assert [tokens for *_, tokens in claims] == [0, 0] and _units(tmp_path) == 3 * 2
    claims = _write(tmp_path, 4, 2, 2, 2, model_kv, False)
    assert claims[-1][2] == 3 * BS and _units(tmp_path) == 3 * 2 * 2
    assert _read(tmp_path, 4, 2, 1, 2, model_kv, False) == 3 * BS
