"""Speculative decoding with a draft model (EAGLE, MTP): vLLM registers the
draft's attention layers beside the target's, numbered from the target's
layer count on. The connector stores and loads the target model's layers
under its namespace and leaves the draft's out, with one log line; before,
its layer check refused the engine with a "report this model" hint
(issue 48 item 3)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from ucm_db.connector.identity import namespace  # noqa: E402
from ucm_db.connector.metadata import BlockTransfer, UcmDbConnectorMetadata  # noqa: E402
from ucm_db.connector.settings import ConnectorSettings  # noqa: E402
from ucm_db.connector.worker.hooks import UcmDbWorker  # noqa: E402

from test_scheduler_worker import BS, NUM_BLOCKS, _shape  # noqa: E402


def _caches(layers: int, fill: bool) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {f"model.layers.{i}.self_attn.attn": (torch.randn(NUM_BLOCKS, 2, BS, 128, generator=gen) if fill
                                                  else torch.zeros(NUM_BLOCKS, 2, BS, 128)).to(torch.bfloat16)
            for i in range(layers)}


def test_a_draft_models_layers_are_left_out_and_the_targets_round_trip(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    shape = _shape()
    settings = ConnectorSettings.from_extra_config({"path": str(tmp_path / "s")})
    with_draft = _caches(shape.layers + 1, fill=True)  # the last one is the drafter's (index == the model's layer count)
    writer = UcmDbWorker(settings, shape, NUM_BLOCKS)
    with caplog.at_level(logging.INFO):
        writer.register_kv_caches(with_draft, 0, 0)
    assert any("draft model" in r.getMessage() for r in caplog.records)
    keys = tuple(namespace(shape).block_keys(list(range(3 * BS))))
    writer.save(UcmDbConnectorMetadata(saves=[BlockTransfer("r", keys, (1, 2, 3))]))
    writer.drain()
    writer.shutdown()

    target = _caches(shape.layers + 1, fill=False)
    reader = UcmDbWorker(settings, shape, NUM_BLOCKS)
    reader.register_kv_caches(target, 0, 0)
    reader.start_load(UcmDbConnectorMetadata(loads=[BlockTransfer("r", keys, (4, 5, 6))]))
    assert reader.take_load_errors() == set()
    for i in range(shape.layers):
        name = f"model.layers.{i}.self_attn.attn"
        assert torch.equal(target[name][4:7].view(torch.int16), with_draft[name][1:4].view(torch.int16))
    assert not target[f"model.layers.{shape.layers}.self_attn.attn"].any()  # the drafter's KV is its own
    reader.shutdown()
