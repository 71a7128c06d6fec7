"""A stored unit of another size than this worker's unit (a writer of
another layout under the same namespace: a bug, or a vLLM upgrade that
changed the CPU kernel's block layout under one ISA tag) is never loaded
partly: in place and through staging (layer mode: every GPU layout's
path), the worker reports its block failed and vLLM recomputes it. Real
scheduler and worker halves on one store; only the KV tensors' head size
differs between writer and reader."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from tests.connector.test_request_controls import BS, NUM_BLOCKS, SHAPE, Engine, _prefill_step, _request  # noqa: E402
from ucm_db.connector.scheduler.hooks import UcmDbScheduler  # noqa: E402
from ucm_db.connector.settings import ConnectorSettings  # noqa: E402
from ucm_db.connector.worker.hooks import UcmDbWorker  # noqa: E402


@pytest.mark.parametrize("load_mode", ["block", "layer"])
def test_a_unit_of_another_size_fails_its_block_and_writes_nothing(tmp_path: Path, load_mode: str) -> None:
    settings = ConnectorSettings.from_extra_config({"path": str(tmp_path / "store"), "load_policy": "always",
                                                    "load_mode": load_mode})
    tokens = list(range(1, 4 * BS + 10))
    writer = Engine(settings)
    assert writer.prefill(_request(tokens))[0] == 0  # 128-wide rows of K and V per token
    writer.close()

    scheduler = UcmDbScheduler(settings, SHAPE)
    worker = UcmDbWorker(settings, SHAPE, NUM_BLOCKS)
    kv = {f"layers.{i}.attn": torch.full((NUM_BLOCKS, 2, BS, 256), 3, dtype=torch.bfloat16) for i in range(2)}
    worker.register_kv_caches(kv, 0, 0)  # the same namespace, twice the unit: the stored ones are short
    try:
        req = _request(tokens + [3] * BS)
        hit, _ = scheduler.get_num_new_matched_tokens(req, 0)
        assert hit == 4 * BS
        scheduler.update_state_after_alloc(req, None, hit)  # type: ignore[arg-type]
        req.num_computed_tokens = hit
        meta = scheduler.build_connector_meta(_prefill_step(req, list(range(6)), req.num_tokens - hit))
        worker.start_load(meta)
        for name in kv:
            worker.wait_for_layer(name)
        worker.finish_loads()
        assert worker.take_load_errors() == {0, 1, 2, 3}
        assert all((cache == 3).all() for cache in kv.values())  # not a byte of the others' units
    finally:
        worker.shutdown()
        scheduler.shutdown()
