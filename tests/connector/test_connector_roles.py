"""The facade keeps its stated rule: a call reaching the wrong role is a no-op
with an empty answer, never an AssertionError or AttributeError.

Real vLLM config objects (a model directory holding only config.json: no
weights, no engine) and a real store; every scheduler-side method is called
on a worker-role connector and every worker-side method on a
scheduler-role one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from ucm_db.connector.connector import UcmDbConnector  # noqa: E402
from ucm_db.connector.metadata import BlockTransfer, UcmDbConnectorMetadata  # noqa: E402

BLOCK = 16
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]


@pytest.fixture(scope="module")
def configs(tmp_path_factory: pytest.TempPathFactory) -> tuple[VllmConfig, KVCacheConfig]:
    from transformers import LlamaConfig

    root = tmp_path_factory.mktemp("roles")
    model_dir = root / "model"
    LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                head_dim=64, vocab_size=1000, max_position_embeddings=512).save_pretrained(model_dir)
    transfer = KVTransferConfig(
        kv_connector="UcmDbConnector", kv_connector_module_path="ucm_db.connector", kv_role="kv_both",
        kv_load_failure_policy="recompute", kv_connector_extra_config={"path": str(root / "store")},
    )
    vllm_config = VllmConfig(
        model_config=ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=512),
        cache_config=CacheConfig(block_size=BLOCK), kv_transfer_config=transfer,
    )
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    kv_cache_config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)])
    return vllm_config, kv_cache_config


def _connector(configs: tuple[VllmConfig, KVCacheConfig], role: KVConnectorRole) -> UcmDbConnector:
    return UcmDbConnector(configs[0], role, configs[1])


def _empty_step() -> SchedulerOutput:
    return SchedulerOutput(
        scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData.make_empty(), num_scheduled_tokens={},
        total_num_scheduled_tokens=0, scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
        finished_req_ids=set(), free_encoder_mm_hashes=[],
    )


def test_scheduler_side_calls_on_a_worker_are_no_ops(configs: Any) -> None:
    worker = _connector(configs, KVConnectorRole.WORKER)
    try:
        request = Request("r0", list(range(3, 3 + 4 * BLOCK)), SamplingParams(max_tokens=1), None)  # type: ignore[arg-type]
        assert worker.get_num_new_matched_tokens(request, 0) == (0, False)
        assert worker.update_state_after_alloc(request, None, 0) is None  # type: ignore[arg-type]
        meta = worker.build_connector_meta(_empty_step())
        assert isinstance(meta, UcmDbConnectorMetadata) and meta.empty
        assert worker.request_finished(request, [0, 1]) == (False, None)
    finally:
        worker.shutdown()


def test_worker_side_calls_on_a_scheduler_are_no_ops(configs: Any) -> None:
    scheduler = _connector(configs, KVConnectorRole.SCHEDULER)
    try:
        kv = {name: torch.zeros(8, 2, BLOCK, 128, dtype=torch.bfloat16) for name in LAYERS}
        scheduler.register_kv_caches(kv)
        # Metadata naming a load: a worker would read the store and fill
        # block 0; the scheduler role must not touch anything.
        load = BlockTransfer(req_id="r0", keys=((bytes(32),),), block_ids=(0,))
        scheduler.bind_connector_metadata(UcmDbConnectorMetadata(loads=[load], saves=[load]))
        scheduler.start_load_kv(None)  # type: ignore[arg-type]
        for name in LAYERS:
            scheduler.wait_for_layer_load(name)
            scheduler.save_kv_layer(name, kv[name], None)  # type: ignore[arg-type]
        scheduler.wait_for_save()
        scheduler.clear_connector_metadata()
        assert scheduler.get_finished({"r0"}) == (None, None)
        assert scheduler.get_block_ids_with_load_errors() == set()
        assert all(not tensor.any() for tensor in kv.values())
    finally:
        scheduler.shutdown()
