"""The config vLLM parsed is the config a namespace keys
(``connector/config_parses.py``).

vLLM parses ``config.json`` when it builds its ``ModelConfig`` (the front
end), long before the connector hashes the model's files (after the load).
The namespace keys architecture hyper-parameters (hidden size, activation,
norm epsilon ...) only through ``config.json``'s content: a config
rewritten in between gave an engine computing with the old config the
namespace of an engine started later on the new one (other KV, one
namespace). ucm-db's plugin now records the config files' digest on each
``ModelConfig`` before vLLM parses it, and the start is refused where they
differ when the connector keys them.

Real vLLM configs and files; no engine (the load's own snapshot is
``test_identity_guards_audit.py``'s, the engine proof of a rewrite at load
``tests/vllm/test_weight_rewrite_engine.py``).
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from vllm.config import LoadConfig, ModelConfig  # noqa: E402

from ucm_db.connector.identity import kv_shape, namespace  # noqa: E402
from ucm_db.connector.weight_loads import refuse_changed_since_read  # noqa: E402
from ucm_db.errors import ConfigError  # noqa: E402

from tests.connector.test_identity_inputs import _namespace_of, _vllm_config, own_caches  # noqa: E402,F401

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]


@pytest.fixture()
def parses_watched(monkeypatch: pytest.MonkeyPatch) -> Any:
    """vLLM's config parse and loaders wrapped as the plugin wraps them in
    every vLLM process, undone after the test."""
    from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER, BaseModelLoader

    from ucm_db.connector import config_parses, plugin, weight_loads

    monkeypatch.setattr(ModelConfig, "__post_init__", ModelConfig.__dict__["__post_init__"])  # restored at teardown
    for cls in {BaseModelLoader, *_LOAD_FORMAT_TO_MODEL_LOADER.values()}:
        if "load_model" in cls.__dict__:
            monkeypatch.setattr(cls, "load_model", cls.__dict__["load_model"])
    monkeypatch.setattr(weight_loads, "_snapshots", {})
    monkeypatch.setattr(weight_loads, "_watching", False)
    plugin.register()  # what vLLM runs in every process before it builds its configs
    return config_parses


def _kv() -> Any:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)])


def _llama(path: Path, **config: Any) -> Path:
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                head_dim=64, vocab_size=1000, max_position_embeddings=512, **config).save_pretrained(path)
    save_file({"lm_head.weight": torch.zeros(4, 4)}, str(path / "model.safetensors"))
    return path


def test_a_config_rewritten_after_vllm_parsed_it_stops_the_start(tmp_path: Path, parses_watched: Any) -> None:
    """The hole: vLLM parses rms_norm_eps 1e-6, a trainer saves the
    checkpoint again with 1e-5 before the connector hashes it. Without the
    check the stale engine's namespace equals that of an engine started on
    the new config: one namespace, two computations."""
    model = _llama(tmp_path / "m", rms_norm_eps=1e-6)
    stale = _vllm_config(model)  # the front end parses config.json here
    _llama(model, rms_norm_eps=1e-5)  # saved in place before the connector starts
    fresh = _vllm_config(model)
    assert stale.model_config.hf_config.rms_norm_eps != fresh.model_config.hf_config.rms_norm_eps
    with pytest.raises(ConfigError, match="changed after vLLM parsed it") as refused:
        kv_shape(stale, _kv(), None)
    assert str(model) in str(refused.value) and "restart" in (refused.value.hint or "")
    kv_shape(fresh, _kv(), None)  # an engine that parsed the new config starts


def test_a_checkpoint_saved_again_with_the_same_config_is_no_change(tmp_path: Path, parses_watched: Any) -> None:
    """By content, not stat: ``save_pretrained`` rewrites config.json alike."""
    model = _llama(tmp_path / "m")
    config = _vllm_config(model)
    before = _namespace_of(_vllm_config(model))
    _llama(model)
    assert namespace(kv_shape(config, _kv(), None)) == before


def test_a_config_from_hf_config_path_rewritten_after_the_parse_stops_the_start(
        tmp_path: Path, parses_watched: Any) -> None:
    model = _llama(tmp_path / "m")
    configs = _llama(tmp_path / "cfg", hidden_act="silu")
    stale = _vllm_config(model, hf_config_path=str(configs))
    text = json.loads((configs / "config.json").read_text())
    (configs / "config.json").write_text(json.dumps({**text, "hidden_act": "gelu"}))
    with pytest.raises(ConfigError, match="changed after vLLM parsed it"):
        kv_shape(stale, _kv(), None)
    # Under model_id the model's files are not keyed, but hf_config_path's are: still checked.
    with pytest.raises(ConfigError, match="changed after vLLM parsed it"):
        kv_shape(stale, _kv(), "llama-2024-06")


def test_under_model_id_a_rewritten_model_config_is_not_the_connectors_to_judge(
        tmp_path: Path, parses_watched: Any) -> None:
    model = _llama(tmp_path / "m")
    config = _vllm_config(model)
    _llama(model, rms_norm_eps=1e-3)
    kv_shape(config, _kv(), "llama-2024-06")  # the operator's name keys the model, not its files


def test_the_record_travels_with_the_config_vllm_pickles_to_its_processes(tmp_path: Path, parses_watched: Any) -> None:
    model = _llama(tmp_path / "m")
    config = _vllm_config(model)
    record = getattr(config.model_config, parses_watched.PARSED_ATTRIBUTE)
    assert record[0] == str(model) and record[1].startswith("blake2b:")
    shipped = pickle.loads(pickle.dumps(config))  # what the engine core and the workers receive
    _llama(model, rms_norm_eps=1e-3)
    with pytest.raises(ConfigError, match="changed after vLLM parsed it"):
        kv_shape(shipped, _kv(), None)


def test_a_draft_config_rewritten_after_the_parse_stops_the_start(tmp_path: Path, parses_watched: Any) -> None:
    """A stored draft is keyed by its files too: its own parse is recorded."""
    draft_dir = _llama(tmp_path / "draft")
    draft = ModelConfig(model=str(draft_dir), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=512)
    target = _vllm_config(_llama(tmp_path / "target"))
    vllm = SimpleNamespace(model_config=target.model_config, load_config=None,
                           speculative_config=SimpleNamespace(draft_model_config=draft, draft_load_config=None,
                                                              method="eagle"))
    refuse_changed_since_read(vllm, None, LoadConfig())
    _llama(draft_dir, rms_norm_eps=1e-3)
    with pytest.raises(ConfigError, match="speculative draft"):
        refuse_changed_since_read(vllm, None, LoadConfig())
    refuse_changed_since_read(vllm, None, None)  # no draft stored: its files are not keyed


def test_without_the_plugin_nothing_is_recorded_and_nothing_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ucm_db.connector import config_parses

    original = ModelConfig.__dict__["__post_init__"]  # an earlier test's plugin may have wrapped it: undone here
    monkeypatch.setattr(ModelConfig, "__post_init__", getattr(original, "__wrapped__", original))
    model = _llama(tmp_path / "m")
    config = _vllm_config(model)
    assert not hasattr(config.model_config, config_parses.PARSED_ATTRIBUTE)
    _llama(model, rms_norm_eps=1e-3)
    kv_shape(config, _kv(), None)


def test_a_quantization_config_file_is_keyed_by_its_content(tmp_path: Path) -> None:
    """``hf_overrides`` ``quantization_config_file``: vLLM reads the
    quantization config from that file when it loads the weights (torchao's
    ``from_config_file``); the path alone was keyed."""
    from ucm_db.connector.weight_loads import watched_files

    quant = tmp_path / "torchao_config.json"
    quant.write_text('{"_type": "Float8WeightOnlyConfig"}')
    model = _llama(tmp_path / "m")
    first = _namespace_of(_vllm_config(model, hf_overrides={"quantization_config_file": str(quant)}))
    quant.write_text('{"_type": "Int8WeightOnlyConfig"}')  # other quantized weights, other KV
    assert _namespace_of(_vllm_config(model, hf_overrides={"quantization_config_file": str(quant)})).id != first.id
    config = _vllm_config(model, hf_overrides={"quantization_config_file": str(quant)})
    assert str(quant) in watched_files(config.model_config, config.load_config)  # in the load's snapshot too
