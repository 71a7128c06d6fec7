"""Speculative decoding with a draft model (EAGLE, MTP): vLLM registers the
draft's attention layers beside the target's, numbered from the target's
layer count on. Where they share the target's KV cache group, the connector
stores and loads them with the target's, under a namespace naming the draft
(``connector/drafts.py``); in a group of their own they are left out, with a
warning. The engine proof (drafts over a hit accepted as cold) is
``tests/vllm/test_identity_engine.py``'s EAGLE test."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from ucm_db.connector.drafts import draft_shape  # noqa: E402
from ucm_db.connector.identity import namespace, stage_layers  # noqa: E402
from ucm_db.connector.metadata import BlockTransfer, UcmDbConnectorMetadata  # noqa: E402
from ucm_db.connector.settings import ConnectorSettings  # noqa: E402
from ucm_db.connector.worker.hooks import UcmDbWorker  # noqa: E402

from test_scheduler_worker import BS, NUM_BLOCKS, _shape  # noqa: E402


def _caches(layers: int, fill: bool) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {f"model.layers.{i}.self_attn.attn": (torch.randn(NUM_BLOCKS, 2, BS, 128, generator=gen) if fill
                                                  else torch.zeros(NUM_BLOCKS, 2, BS, 128)).to(torch.bfloat16)
            for i in range(layers)}


def test_a_draft_models_layers_in_a_group_of_their_own_are_left_out_and_the_targets_round_trip(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    shape = _shape()
    settings = ConnectorSettings.from_extra_config({"path": str(tmp_path / "s")})
    with_draft = _caches(shape.layers + 1, fill=True)  # the last one is the drafter's (index == the model's layer count)
    writer = UcmDbWorker(settings, shape, NUM_BLOCKS)
    with caplog.at_level(logging.WARNING):
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


def test_draft_layers_in_the_targets_group_round_trip_with_it(tmp_path: Path) -> None:
    shape = _shape()
    shape = dataclasses.replace(shape, layers=shape.layers + 1, draft_layers=1)  # as kv_shape reads a stored draft
    settings = ConnectorSettings.from_extra_config({"path": str(tmp_path / "s")})
    with_draft = _caches(shape.layers, fill=True)
    writer = UcmDbWorker(settings, shape, NUM_BLOCKS)
    writer.register_kv_caches(with_draft, 0, 0)
    keys = tuple(namespace(shape).block_keys(list(range(3 * BS))))
    writer.save(UcmDbConnectorMetadata(saves=[BlockTransfer("r", keys, (1, 2, 3))]))
    writer.drain()
    writer.shutdown()

    target = _caches(shape.layers, fill=False)
    reader = UcmDbWorker(settings, shape, NUM_BLOCKS)
    reader.register_kv_caches(target, 0, 0)
    reader.start_load(UcmDbConnectorMetadata(loads=[BlockTransfer("r", keys, (4, 5, 6))]))
    assert reader.take_load_errors() == set()
    for name in target:  # the drafter's layer too
        assert torch.equal(target[name][4:7].view(torch.int16), with_draft[name][1:4].view(torch.int16)), name
    reader.shutdown()


def _kv_config(*groups: list[str]) -> SimpleNamespace:
    return SimpleNamespace(kv_cache_groups=[SimpleNamespace(layer_names=names) for names in groups])


def _spec_config(method: str = "eagle") -> SimpleNamespace:
    spec = SimpleNamespace(method=method, quantization=None, use_eagle_block_drop=lambda: True,
                           draft_model_config=SimpleNamespace(model="/draft", dtype="torch.bfloat16", quantization=None))
    return SimpleNamespace(speculative_config=spec, load_config=None)


def test_a_stored_draft_is_named_by_its_method_files_and_layers() -> None:
    target = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    draft = ["model.layers.2.self_attn.attn"]
    files = {"/draft": "blake3:d1"}

    def by_files(config: object, _dir: object, _load: object) -> str:
        return files[config.model]  # type: ignore[attr-defined]

    layers, inputs = draft_shape(_spec_config(), _kv_config(target + draft), 2, by_files)
    assert layers == 1 and inputs == {"method": "eagle", "layers": 1, "model": "blake3:d1", "dtype": "bfloat16",
                                      "quantization": None}
    files["/draft"] = "blake3:d2"  # another head: another namespace
    assert draft_shape(_spec_config(), _kv_config(target + draft), 2, by_files)[1] != inputs
    assert draft_shape(_spec_config(), _kv_config(target, draft), 2, by_files) == (0, None)  # a group of its own
    assert draft_shape(SimpleNamespace(speculative_config=None), _kv_config(target), 2, by_files) == (0, None)
    assert draft_shape(_spec_config("ngram"), _kv_config(target), 2, by_files) == (0, None)  # no layers of its own


def test_the_last_pipeline_stage_holds_the_draft_layers() -> None:
    shape = dataclasses.replace(_shape(), pp_size=2, layers=5, draft_layers=1)  # 4 target layers and a draft's
    assert [stage_layers(shape, pp) for pp in (0, 1)] == [(0, 2), (2, 5)]
