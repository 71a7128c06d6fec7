"""The identity audit's findings (``/tmp/audit_identity/``), each a config
ucm-db keyed wrongly, and the tripwires that keep them from coming back:

1. A checkpoint written in place while vLLM loads it: the files are hashed
   after the load (vLLM 0.32 makes the connector after ``load_model``), so
   ucm-db keyed the new files while the engine computed with the old ones
   (``load_then_hash_race.py``). The plugin now snapshots the files' stat
   before every load (``connector/weight_loads.py``) and the start is
   refused where they moved.
2. A KV cache spec whose blocks are no function of their prefix (R-SWA:
   ``rswa_single_group.py``) was stored like full attention. Specs are now
   an allow-list (``connector/kv_specs.py``).
3. Tensorizer (and other formats reading weights from elsewhere) was keyed
   by its URI string (``tensorizer_uri.py``). A local file is now keyed by
   content; remote and streamed weights are refused without ``model_id``.
4. Tripwires over ``VllmConfig``'s own fields, ``SpeculativeConfig`` and the
   small configs they hold; ``additional_config`` is keyed.

Real vLLM configs, specs and loader classes; the engine-level proof of 1
is ``tests/vllm/test_weight_rewrite_engine.py``.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

import vllm  # noqa: E402
from vllm.config import LoadConfig  # noqa: E402

from ucm_db.connector.identity import kv_shape, namespace  # noqa: E402
from ucm_db.errors import ConfigError  # noqa: E402

from tests.connector.test_identity_inputs import _namespace_of, _vllm_config, model_dir, own_caches  # noqa: E402,F401

VLLM = Path(vllm.__file__).parent
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]


def _kv(spec: Any) -> Any:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)])


def _full(**changes: Any) -> Any:
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, **changes)


def _save_llama(path: Path, seed: int) -> Path:
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    path.mkdir(parents=True, exist_ok=True)
    save_file({"lm_head.weight": torch.randn(4, 4)}, str(path / "model.safetensors"))
    return path


# -- 1. weights rewritten while vLLM loads them ------------------------------------------


@pytest.fixture()
def watched_loaders(monkeypatch: pytest.MonkeyPatch) -> Any:
    """vLLM's loaders wrapped as the plugin wraps them in an engine process,
    undone after the test (a fresh snapshot record, too)."""
    from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER, BaseModelLoader

    from ucm_db.connector import weight_loads

    for cls in {BaseModelLoader, *_LOAD_FORMAT_TO_MODEL_LOADER.values()}:
        if "load_model" in cls.__dict__:
            monkeypatch.setattr(cls, "load_model", cls.__dict__["load_model"])  # restored at teardown
    monkeypatch.setattr(weight_loads, "_snapshots", {})
    monkeypatch.setattr(weight_loads, "_watching", False)
    from ucm_db.connector import plugin

    plugin.register()  # what vLLM runs in every process before it loads a model
    return weight_loads


def _load(vllm_config: Any, monkeypatch: pytest.MonkeyPatch, while_loading: Any = None) -> None:
    """vLLM's own ``DefaultModelLoader.load_model`` for ``vllm_config``, with
    the model's construction and the reading of its weights stood in for
    (no distributed state here); ``while_loading`` runs where vLLM reads them."""
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    monkeypatch.setattr(BaseModelLoader, "create_model", lambda self, **kw: torch.nn.Linear(2, 2))
    monkeypatch.setattr(torch.accelerator, "empty_cache", lambda: None)  # no accelerator here
    monkeypatch.setattr(DefaultModelLoader, "load_weights",
                        lambda self, model, model_config: while_loading() if while_loading else None)
    DefaultModelLoader(vllm_config.load_config).load_model(vllm_config=vllm_config, model_config=vllm_config.model_config)


def test_a_checkpoint_rewritten_while_vllm_loads_it_stops_the_start(
        tmp_path: Path, watched_loaders: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The audit's race, at the real loader: vLLM reads weights A, a trainer
    saves B over them, then the connector is made and hashes B."""
    model = _model_copy(tmp_path)
    config = _vllm_config(model)
    _load(config, monkeypatch, while_loading=lambda: _save_llama(model, seed=2))
    with pytest.raises(ConfigError, match="changed after vLLM began loading") as refused:
        kv_shape(config, _kv(_full()), None)
    assert "model.safetensors" in str(refused.value) and "restart" in (refused.value.hint or "")


def test_a_checkpoint_left_alone_starts_and_a_later_engine_is_checked_against_its_own_load(
        tmp_path: Path, watched_loaders: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model_copy(tmp_path)
    config = _vllm_config(model)
    _load(config, monkeypatch)
    first = namespace(kv_shape(config, _kv(_full()), None))
    _save_llama(model, seed=3)  # a new checkpoint written between two engines of one process: no race
    _load(config, monkeypatch)
    assert namespace(kv_shape(config, _kv(_full()), None)) != first


def test_a_directory_loaded_twice_must_be_the_same_both_times(
        tmp_path: Path, watched_loaders: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """An MTP draft loads the target's directory again: a checkpoint saved
    between the two loads leaves target and draft with other weights."""
    model = _model_copy(tmp_path)
    config = _vllm_config(model)
    _load(config, monkeypatch)
    _save_llama(model, seed=4)
    _load(config, monkeypatch)
    with pytest.raises(ConfigError, match="changed after vLLM began loading"):
        kv_shape(config, _kv(_full()), None)


def test_a_tensorizer_file_rewritten_while_vllm_loads_it_stops_the_start(
        model_dir: Path, tmp_path: Path, watched_loaders: Any) -> None:
    uri = tmp_path / "model.tensors"
    uri.write_bytes(b"A" * 4096)
    config = _vllm_config(model_dir)
    config.load_config = LoadConfig(load_format="tensorizer", model_loader_extra_config={"tensorizer_uri": str(uri)})
    watched_loaders.note_load(config, config.model_config, config.load_config)  # what the wrapped loader does first
    uri.write_bytes(b"B" * 4096)
    with pytest.raises(ConfigError, match="changed after vLLM began loading"):
        kv_shape(config, _kv(_full()), None)


def test_a_snapshot_that_cannot_be_taken_never_fails_the_load(watched_loaders: Any) -> None:
    watched_loaders.note_load(None, SimpleNamespace(model=None), object())
    assert watched_loaders._snapshots == {}


def test_without_the_plugin_the_start_says_rewrites_go_unnoticed(
        model_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from ucm_db.connector import weight_loads

    monkeypatch.setattr(weight_loads, "_watching", False)
    monkeypatch.setattr(weight_loads, "_warned", False)
    with caplog.at_level(logging.WARNING, logger="vllm.ucm_db.connector.weight_loads"):
        kv_shape(_vllm_config(model_dir), _kv(_full()), None)
        kv_shape(_vllm_config(model_dir), _kv(_full()), None)
    said = [r.getMessage() for r in caplog.records if "plugin did not run" in r.getMessage()]
    assert len(said) == 1 and "restart" in said[0]  # once a process


def test_the_plugin_wraps_every_loader_that_loads_a_model(watched_loaders: Any) -> None:
    from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER, BaseModelLoader

    for cls in {BaseModelLoader, *_LOAD_FORMAT_TO_MODEL_LOADER.values()}:
        assert getattr(cls.load_model, "__ucm_db_watched__", False), cls
    assert watched_loaders._watching


def _model_copy(tmp_path: Path) -> Path:
    from transformers import LlamaConfig

    out = tmp_path / "model"
    LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                head_dim=64, vocab_size=1000, max_position_embeddings=512).save_pretrained(out)
    return _save_llama(out, seed=1)


# -- 2. KV cache specs whose blocks are no function of their prefix --------------------------


def test_an_rswa_model_is_refused(model_dir: Path) -> None:
    """Unlimited-OCR's lone group (``rswa_single_group.py``): accepted and its
    decode blocks saved before, at any window."""
    from vllm.v1.kv_cache_interface import RSWASpec

    for window in (128, 4096):
        spec = RSWASpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, rswa_window=window)
        with pytest.raises(ConfigError, match="R-SWA"):
            kv_shape(_vllm_config(model_dir), _kv(spec), None)


def _specs_refused_by_kind() -> dict[str, Any]:
    from vllm.v1.kv_cache_interface import (CircularBufferSpec, CrossAttentionSpec, EncoderOnlyAttentionSpec,
                                            MLAAttentionSpec, SlidingWindowMLASpec)

    common = {"block_size": 32, "num_kv_heads": 1, "head_size": 64, "dtype": torch.bfloat16}
    return {
        "bounded replay (prefix_cacheable False)": SlidingWindowMLASpec(sliding_window=64, bounded_replay=True, **common),
        "ring buffer": CircularBufferSpec(**common),
        "encoder-only (bidirectional)": EncoderOnlyAttentionSpec(**common),
        "cross attention": CrossAttentionSpec(**common),
        "non-causal decode rows": MLAAttentionSpec(non_causal_multi_token_decode=True, **common),
    }


@pytest.mark.parametrize("case", sorted(_specs_refused_by_kind()))
def test_a_lone_group_whose_blocks_are_not_a_prefix_function_is_refused(model_dir: Path, case: str) -> None:
    with pytest.raises(ConfigError, match="cannot key by their token prefix"):
        kv_shape(_vllm_config(model_dir), _kv(_specs_refused_by_kind()[case]), None)


def test_a_spec_class_ucm_db_does_not_know_is_refused_not_taken_for_its_parent(model_dir: Path) -> None:
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class TomorrowsAttentionSpec(FullAttentionSpec):
        pass

    spec = TomorrowsAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match="does not know TomorrowsAttentionSpec"):
        kv_shape(_vllm_config(model_dir), _kv(spec), None)


def test_a_model_whose_vllm_hook_turns_prefix_caching_off_for_its_kv_is_refused(model_dir: Path) -> None:
    config = _vllm_config(model_dir)
    config.model_config.hf_config.architectures = ["UnlimitedOCRForCausalLM"]
    with pytest.raises(ConfigError, match="UnlimitedOCRForCausalLM"):
        kv_shape(config, _kv(_full()), None)


def test_prefix_specs_are_accepted(model_dir: Path) -> None:
    """Full, sliding-window, chunked-local and MLA attention are accepted as
    before (the allow-list only refuses: it adds nothing to a namespace; the
    weight files' golden digests are in test_identity_weight_sources.py)."""
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

    common = {"block_size": 32, "num_kv_heads": 2, "head_size": 64, "dtype": torch.bfloat16}
    for spec in (_full(), SlidingWindowSpec(sliding_window=64, **common), ChunkedLocalAttentionSpec(attention_chunk_size=64, **common),
                 MLAAttentionSpec(**{**common, "num_kv_heads": 1})):
        kv_shape(_vllm_config(model_dir), _kv(spec), None)


def _all_spec_classes() -> set[str]:
    """Every subclass of vLLM's ``KVCacheSpec``: those imported, and those
    its source declares (a class statement naming a known spec as a base)."""
    from vllm.v1.kv_cache_interface import KVCacheSpec

    found, todo = {"KVCacheSpec"}, [KVCacheSpec]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub.__module__.startswith("vllm.") and sub.__name__ not in found:
                found.add(sub.__name__)
                todo.append(sub)
    declared: dict[str, set[str]] = {}
    for file in VLLM.rglob("*.py"):
        if "tests" in file.parts:
            continue
        for node in ast.walk(ast.parse(file.read_text(errors="replace"))):
            if isinstance(node, ast.ClassDef):
                declared[node.name] = {b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "") for b in node.bases}
    grew = True
    while grew:
        grew = False
        for name, bases in declared.items():
            if name not in found and bases & found and name.endswith(("Spec", "Specs")):
                found.add(name)
                grew = True
    return found


def test_every_kv_cache_spec_class_of_vllm_is_judged() -> None:
    from ucm_db.connector.kv_specs import SPEC_VERDICTS

    classes = _all_spec_classes()
    new, gone = sorted(classes - set(SPEC_VERDICTS)), sorted(set(SPEC_VERDICTS) - classes)
    assert not new, f"vLLM has new KV cache specs {new}: judge each in connector/kv_specs.SPEC_VERDICTS"
    assert not gone, f"vLLM lost KV cache specs {gone}: drop them from connector/kv_specs.SPEC_VERDICTS"


def test_every_model_hook_that_turns_prefix_caching_off_is_judged() -> None:
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    from ucm_db.connector.kv_specs import NOT_PREFIX_ARCHITECTURES

    turned_off = {arch for arch, cls in MODELS_CONFIG_MAP.items()
                  if "enable_prefix_caching = False" in inspect.getsource(cls.verify_and_update_config)}
    assert turned_off, "the scan found no hook: vLLM's config hooks moved (model_executor/models/config.py)"
    assert turned_off <= set(NOT_PREFIX_ARCHITECTURES), (
        f"vLLM turns prefix caching off for {sorted(turned_off - set(NOT_PREFIX_ARCHITECTURES))}: judge why in "
        "connector/kv_specs.NOT_PREFIX_ARCHITECTURES")


# -- 3. weights read from outside the model's files --------------------------------------


def _tensorizer(model_dir: Path, uri: str, model_id: str | None = None) -> str:
    config = _vllm_config(model_dir)
    config.load_config = LoadConfig(load_format="tensorizer", model_loader_extra_config={"tensorizer_uri": uri})
    return kv_shape(config, _kv(_full()), model_id).extra


def test_a_local_tensorizer_file_is_keyed_by_its_content(model_dir: Path, tmp_path: Path) -> None:
    """``tensorizer_uri.py``: another model serialized to the same path kept
    the namespace (the model directory's files were all that was hashed)."""
    uri = tmp_path / "serialized" / "model.tensors"
    uri.parent.mkdir()
    uri.write_bytes(b"A" * 4096)
    first = _tensorizer(model_dir, str(uri))
    assert _tensorizer(model_dir, str(uri)) == first
    uri.write_bytes(b"B" * 4096)
    assert _tensorizer(model_dir, str(uri)) != first


def test_vllms_own_tensorizer_options_name_the_same_file(model_dir: Path, tmp_path: Path) -> None:
    """``vllm serve --load-format tensorizer`` nests the options under
    ``tensorizer_config`` (with ``tensorizer_dir`` the model): the same file,
    found either way; per-rank files by their template."""
    from ucm_db.connector.weight_loads import tensorizer_files

    nested = LoadConfig(load_format="tensorizer", model_loader_extra_config={
        "tensorizer_uri": str(tmp_path / "m.tensors"),
        "tensorizer_config": {"tensorizer_dir": str(model_dir), "tensorizer_uri": str(tmp_path / "m.tensors")}})
    assert tensorizer_files(nested) == [str(tmp_path / "m.tensors")]
    folder = LoadConfig(load_format="tensorizer", model_loader_extra_config={"tensorizer_config": {"tensorizer_dir": str(tmp_path)}})
    assert tensorizer_files(folder) == [str(tmp_path / "model.tensors")]
    ranks = LoadConfig(load_format="tensorizer", model_loader_extra_config={"tensorizer_uri": str(tmp_path / "m-%02d.tensors")})
    assert tensorizer_files(ranks, tp_size=2) == [str(tmp_path / "m-00.tensors"), str(tmp_path / "m-01.tensors")]


@pytest.mark.parametrize("uri", ["s3://bucket/model.tensors", "https://models.example/model.tensors", "/nowhere/model.tensors"])
def test_a_tensorizer_file_ucm_db_cannot_read_is_refused_unless_model_id_names_it(model_dir: Path, uri: str) -> None:
    with pytest.raises(ConfigError, match="cannot read") as refused:
        _tensorizer(model_dir, uri)
    assert "model_id" in (refused.value.hint or "")
    assert '"load_format":"tensorizer"' in _tensorizer(model_dir, uri, model_id="tuned-v7")


@pytest.mark.parametrize("fmt", ["modelexpress", "ipc_cache", "my_registered_loader"])
def test_weights_from_another_process_or_an_unknown_loader_are_refused_unless_model_id_names_them(
        model_dir: Path, fmt: str) -> None:
    config = _vllm_config(model_dir)
    config.load_config = LoadConfig(load_format=fmt)
    with pytest.raises(ConfigError, match=fmt):
        kv_shape(config, _kv(_full()), None)
    assert f'"load_format":"{fmt}"' in kv_shape(config, _kv(_full()), "tuned-v7").extra


def test_weights_streamed_from_an_object_store_are_refused_unless_model_id_names_them(model_dir: Path) -> None:
    """vLLM streams them with ``runai_streamer`` from ``model_weights`` (the
    model directory holds the configs it pulled); a checkpoint uploaded
    again under the URI kept the namespace."""
    config = _vllm_config(model_dir)
    config.load_config = LoadConfig(load_format="runai_streamer")
    config.model_config.model_weights = "s3://bucket/llama"
    with pytest.raises(ConfigError, match="s3://bucket/llama"):
        kv_shape(config, _kv(_full()), None)
    kv_shape(config, _kv(_full()), "llama-2024-06")


def test_every_load_format_of_vllm_is_judged() -> None:
    from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER, LoadFormats

    from ucm_db.connector import identity_guards

    judged = (identity_guards.FILE_LOAD_FORMATS | identity_guards.MODEL_PATH_FORMATS
              | identity_guards.NAMED_ONLY_FORMATS | {"tensorizer", "dummy"})
    formats = set(_LOAD_FORMAT_TO_MODEL_LOADER) | set(LoadFormats.__args__)
    assert formats <= judged, f"vLLM has new load formats {sorted(formats - judged)}: judge them (identity_guards.py)"


# -- 4. VllmConfig's own fields, SpeculativeConfig and the configs they hold -----------------

_SPARSE = "no: sparse-indexer models only, which are refused (hybrid/groups.kv_groups)"
_ROUNDING = "no: kernel or graph choices, rounding only"

VLLM_CONFIG_FIELDS = {
    "model_config": "fields: test_identity_inputs.MODEL_CONFIG_FIELDS",
    "cache_config": "fields: test_config_tripwires.CACHE_CONFIG_FIELDS",
    "parallel_config": "fields: test_config_tripwires.PARALLEL_CONFIG_FIELDS",
    "attention_config": "fields: test_config_tripwires.ATTENTION_CONFIG_FIELDS",
    "kernel_config": "fields: test_config_tripwires.KERNEL_CONFIG_FIELDS",
    "lora_config": "fields: test_config_tripwires.LORA_CONFIG_FIELDS",
    "load_config": "fields: test_identity_guards.LOAD_CONFIG_FIELDS",
    "speculative_config": "fields: SPECULATIVE_CONFIG_FIELDS",
    "scheduler_config": "fields: SCHEDULER_CONFIG_FIELDS",
    "mamba_config": "fields: MAMBA_CONFIG_FIELDS",
    "engram_config": "fields: ENGRAM_CONFIG_FIELDS",
    "diffusion_config": "fields: DIFFUSION_CONFIG_FIELDS",
    "offload_config": "fields: OFFLOAD_CONFIG_FIELDS",
    "aux_output_config": "fields: AUX_OUTPUT_CONFIG_FIELDS",
    "device_config": "fields: DEVICE_CONFIG_FIELDS",
    "quant_config": "keyed: derived from model_config.quantization, quantization_config and the checkpoint's "
                    "quantization_config (VllmConfig._get_quantization_config), all namespace inputs",
    "additional_config": "keyed: identity_guards.additional_inputs, a digest where non-empty (kernels and platform "
                         "plug-ins read keys ucm-db cannot judge: GDN/KDA prefill backends, vllm-ascend's options)",
    "compilation_config": "no: torch.compile, CUDA graphs and fusions of the same ops (the quantization fusions fuse a "
                          "quantized model's own, keyed, quantization), rounding only",
    "optimization_level": "no: compilation and CUDA graph defaults (OPTIMIZATION_LEVEL_TO_CONFIG), rounding only",
    "performance_mode": "no: CUDA graph capture sizes (config/vllm.py), rounding only",
    "watermark_config": "no: sampling",
    "structured_outputs_config": "no: sampling",
    "reasoning_config": "no: output parsing and sampling",
    "observability_config": "no: metrics and tracing",
    "logging_config": "no: logging",
    "profiler_config": "no: profiling",
    "kv_transfer_config": "no: the connector's own config (its model_id is keyed as the model)",
    "kv_events_config": "no: event publishing",
    "ec_transfer_config": "no: encoder outputs of the same items from an engine of the same model",
    "ec_manager_config": "no: an encoder cache",
    "weight_transfer_config": "no: warned at start (identity_guards.warn_weight_updates): a reset must follow each update",
    "instance_id": "no: a label",
    "shutdown_timeout": "no: shutdown",
}

#: The draft's identity (method, files, dtype, quantization, load config, layers, speculative tokens) is in the
#: layout of a namespace whose blocks hold draft layers (drafts.draft_shape); the target's KV depends on none of these.
SPECULATIVE_CONFIG_FIELDS = {
    "method": "keyed: drafts.draft_shape",
    "model": "keyed: the draft's files by content (drafts.draft_shape, draft_model_config)",
    "draft_model_config": "keyed: the draft's files, dtype and quantization (drafts.draft_shape)",
    "revision": "keyed: resolves the draft's hub snapshot, hashed (draft_model_config)",
    "quantization": "keyed: drafts.draft_shape",
    "num_speculative_tokens": "keyed: drafts.draft_shape, for a drafter of several layers",
    "draft_load_config": "keyed: drafts.draft_load_inputs",
    "kv_cache_dtype": "keyed: draft layers stored only at the target's cache_dtype (drafts._storable), which is keyed",
    "attention_backend": "keyed: draft layers stored only with the target's backend (drafts._storable), keyed where it "
                         "matters (numerics)",
    "moe_backend": "keyed: identity_guards.draft_engine_inputs (the draft's MoE kernels)",
    "max_model_len": "keyed: identity_guards.draft_engine_inputs (a draft's RoPE may read its length)",
    "code_revision": "keyed: identity_guards.draft_engine_inputs (the draft's remote code)",
    "parallel_drafting": "keyed: identity_guards.draft_engine_inputs (where its method does not imply it)",
    "use_heterogeneous_vocab": "keyed: identity_guards.draft_engine_inputs (the draft reads mapped token ids)",
    "num_speculative_tokens_per_batch_size": "keyed: identity_guards.draft_engine_inputs (how many draft layers run)",
    "index_share_for_mtp_iteration": _SPARSE,
    "enforce_eager": _ROUNDING,
    "draft_tensor_parallel_size": "no: units of one KV head (docs/tp.md), rounding only",
    "tensor_parallel_size": "no: units of one KV head (docs/tp.md), rounding only",
    "target_model_config": "no: the target's own config, judged in its own table",
    "target_parallel_config": "no: the target's own config, judged in its own table",
    "draft_parallel_config": "no: the draft's TP size, rounding only (keyed for dummy weights: drafts.draft_load_inputs)",
    "disable_padded_drafter_batch": "no: batching",
    "disable_eagle_block_drop": "no: how many blocks a hit gives back (drafts.drops_last_block), not the KV bytes",
    "use_local_argmax_reduction": "no: sampling",
    "prompt_lookup_max": "no: n-gram drafting, no layers",
    "prompt_lookup_min": "no: n-gram drafting, no layers",
    "suffix_decoding_max_tree_depth": "no: suffix decoding, no layers",
    "suffix_decoding_max_cached_requests": "no: suffix decoding, no layers",
    "suffix_decoding_max_spec_factor": "no: suffix decoding, no layers",
    "suffix_decoding_min_token_prob": "no: suffix decoding, no layers",
    "rejection_sample_method": "no: which drafts are accepted; accepted tokens' K/V are the target's",
    "synthetic_acceptance_rates": "no: which drafts are accepted",
    "synthetic_acceptance_length": "no: which drafts are accepted",
    "enable_adaptive_verification": "no: how many drafts are verified",
    "draft_sample_method": "no: sampling of drafts",
    "dspark_draft_topk": "no: sampling of drafts",
}

SCHEDULER_CONFIG_FIELDS = {
    "disable_hybrid_kv_cache_manager": "keyed: changes vLLM's KV cache specs and groups, which the layout and "
                                       "group namespaces name",
    "runner_type": "no: the runner, not the attention's inputs",
    "is_multimodal_model": "no: derived",
    **{name: "no: which tokens run in which step; a token's K/V is the same function of its prefix, rounding only"
       for name in ("max_num_batched_tokens", "max_num_scheduled_tokens", "max_num_seqs", "max_num_active_seqs",
                    "long_prefill_token_threshold", "long_prefill_token_threshold_adaptive", "max_num_queued_reqs",
                    "max_num_queued_tokens", "enable_chunked_prefill", "max_num_encoder_input_tokens",
                    "encoder_cache_size", "policy", "disable_chunked_mm_input", "scheduler_cls",
                    "scheduler_reserve_full_isl", "watermark", "prefill_schedule_interval", "async_scheduling",
                    "stream_interval")},
}

MAMBA_CONFIG_FIELDS = {
    "backend": "no: the SSM kernel, rounding only (the state dtypes are keyed: CacheConfig)",
    "ssu_algorithm": "no: the SSM kernel, rounding only",
    "enable_stochastic_rounding": "no: rounding of the fp16 state, rounding only",
    "stochastic_rounding_philox_rounds": "no: rounding of the fp16 state",
}

ENGRAM_CONFIG_FIELDS = {name: "no: where the n-gram embedding tables live and how they are sharded, the same weights"
                        for name in ("cpu_offload", "embedding_across_dp", "dp_shared_memory", "use_thp")}

DIFFUSION_CONFIG_FIELDS = {
    "canvas_length": "no: the canvas is denoised without writing KV; committed tokens' K/V are written by the causal "
                     "pass (diffusion_gemma.py)",
    "max_denoising_steps": "no: sampling",
}

OFFLOAD_CONFIG_FIELDS = {name: "no: where the same weights are kept" for name in ("offload_backend", "uva", "prefetch")}

AUX_OUTPUT_CONFIG_FIELDS = {"enable_return_routed_experts": "no: returns what the router chose", "max_bytes": "no: a capacity"}

DEVICE_CONFIG_FIELDS = {"device": "no: the platform is in the layout", "device_type": "no: the platform is in the layout"}

CONFIGS = {
    "VllmConfig": VLLM_CONFIG_FIELDS, "SpeculativeConfig": SPECULATIVE_CONFIG_FIELDS,
    "SchedulerConfig": SCHEDULER_CONFIG_FIELDS, "MambaConfig": MAMBA_CONFIG_FIELDS, "EngramConfig": ENGRAM_CONFIG_FIELDS,
    "DiffusionConfig": DIFFUSION_CONFIG_FIELDS, "OffloadConfig": OFFLOAD_CONFIG_FIELDS,
    "AuxOutputConfig": AUX_OUTPUT_CONFIG_FIELDS, "DeviceConfig": DEVICE_CONFIG_FIELDS,
}
_VERDICTS = ("keyed: ", "refused: ", "no: ", "fields: ")


def _config_class(name: str) -> Any:
    import importlib

    import vllm.config

    if hasattr(vllm.config, name):
        return getattr(vllm.config, name)
    module = {"MambaConfig": "mamba", "EngramConfig": "engram", "DiffusionConfig": "diffusion",
              "AuxOutputConfig": "aux_output"}[name]
    return getattr(importlib.import_module(f"vllm.config.{module}"), name)


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_every_field_is_judged(config: str) -> None:
    cls, judged = _config_class(config), CONFIGS[config]
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set(cls.model_fields)
    new, gone = sorted(fields - set(judged)), sorted(set(judged) - fields)
    assert not new, f"vLLM's {config} has new fields {new}: judge whether each changes K/V ({__name__})"
    assert not gone, f"vLLM's {config} lost fields {gone}: drop them here"
    assert all(why.startswith(_VERDICTS) for why in judged.values())


def test_every_config_vllm_config_holds_is_judged_field_by_field_somewhere() -> None:
    """A ``fields:`` judgement names a table that exists and is checked."""
    import tests.connector.test_config_tripwires as tripwires
    import tests.connector.test_identity_guards as guards
    import tests.connector.test_identity_inputs as inputs

    tables = {"test_identity_inputs": inputs, "test_config_tripwires": tripwires, "test_identity_guards": guards}
    for name, why in VLLM_CONFIG_FIELDS.items():
        if why.startswith("fields: "):
            where = why.removeprefix("fields: ")
            module, _, table = where.rpartition(".")
            assert isinstance(getattr(tables[module], table) if module else globals()[table], dict), name


def test_additional_config_reaches_the_namespace_where_set(model_dir: Path) -> None:
    base = _vllm_config(model_dir)
    set_ = _vllm_config(model_dir)
    set_.additional_config = {"gdn_prefill_backend": "flashinfer"}
    other = _vllm_config(model_dir)
    other.additional_config = {"gdn_prefill_backend": "triton"}
    empty = _vllm_config(model_dir)
    empty.additional_config = {}
    digests = [_namespace_of(c).digest for c in (base, set_, other, empty)]
    assert len(set(digests[:3])) == 3 and digests[3] == digests[0]
    assert "gdn_prefill_backend" not in _namespace_of(set_).extra  # a digest: the options may hold credentials


def test_draft_engine_options_reach_a_stored_drafts_namespace(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where draft layers are stored with the target's, options that change
    the draft's KV beside its identity are named; unset, the layout is as
    before."""
    from tests.connector.test_draft_layers import TARGET, _attention, _kv_config, _vllm

    eagle = _kv_config({**TARGET, "model.layers.2.self_attn.attn": _attention()})
    monkeypatch.setattr("ucm_db.connector.identity.model_fingerprint", lambda config, *a, **k: f"blake3:{config.model}")

    def layout(**spec_fields: Any) -> dict[str, Any]:
        config = _vllm_config(model_dir)
        config.speculative_config = _vllm(**spec_fields).speculative_config
        return json.loads(kv_shape(config, eagle, None).layout)["draft"]

    plain = layout()
    assert set(plain) == {"method", "layers", "model", "dtype"}
    for change in ({"max_model_len": 256}, {"moe_backend": "triton"}, {"code_revision": "abc"},
                   {"parallel_drafting": True}, {"use_heterogeneous_vocab": True},
                   {"num_speculative_tokens_per_batch_size": [(1, 8, 2)]}):
        assert layout(**change) != plain, change
    assert layout(method="dflash", parallel_drafting=True) == {**plain, "method": "dflash"}  # implied by the method


def test_the_first_npcache_start_that_converts_the_weights_is_not_refused(
        tmp_path: Path, watched_loaders: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under npcache the load converts ``*.bin`` into ``np/`` and ucm-db keys
    ``np/`` from then on (weight_files.py): the selection changes during
    that load, which is no rewrite. A ``.bin`` rewritten while a converted
    folder loads is still one (vLLM read the arrays, ucm-db keys them)."""
    import numpy as np

    model = _model_copy(tmp_path)
    (model / "model.safetensors").unlink()
    torch.save({"lm_head.weight": torch.randn(4, 4)}, str(model / "pytorch_model.bin"))
    config = _vllm_config(model)
    config.load_config = LoadConfig(load_format="npcache")

    def convert() -> None:  # what vLLM's np_cache_weights_iterator writes on the first load
        (model / "np").mkdir()
        np.save(model / "np" / "lm_head.weight", np.zeros((4, 4), dtype=np.float32))
        (model / "np" / "weight_names.json").write_text(json.dumps(["lm_head.weight"]))

    _load(config, monkeypatch, while_loading=convert)
    first = namespace(kv_shape(config, _kv(_full()), None))  # before the fix: "changed after vLLM began loading"
    _load(config, monkeypatch, while_loading=lambda: np.save(model / "np" / "lm_head.weight", np.ones((4, 4), dtype=np.float32)))
    with pytest.raises(ConfigError, match="changed after vLLM began loading"):
        kv_shape(config, _kv(_full()), None)
    assert first


def test_weights_vllm_downloads_inside_the_load_are_no_rewrite(
        tmp_path: Path, watched_loaders: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A review's finding: vLLM fetches a hub model's configs before the
    load and its weights inside ``load_model``, so the snapshot held only
    the configs and every first start of a model not yet downloaded was
    refused. A file the load adds is no change; one it finds is."""
    model = _model_copy(tmp_path)
    weights = (model / "model.safetensors").read_bytes()
    (model / "model.safetensors").unlink()  # the snapshot folder before the download: the configs only
    config = _vllm_config(model)
    _load(config, monkeypatch, while_loading=lambda: (model / "model.safetensors").write_bytes(weights))
    assert namespace(kv_shape(config, _kv(_full()), None))  # before the fix: "changed after vLLM began loading"


def test_a_later_engine_is_not_checked_against_an_earlier_engine_s_unchecked_load(
        tmp_path: Path, watched_loaders: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A review's finding: an engine without ucm-db (or one whose start
    failed before its check) left its snapshot, and a later ucm-db engine of
    the process was refused for a checkpoint written between the two."""
    model = _model_copy(tmp_path)
    _load(_vllm_config(model), monkeypatch)  # never checked
    _save_llama(model, seed=5)  # nothing is loading
    later = _vllm_config(model)
    _load(later, monkeypatch)
    assert namespace(kv_shape(later, _kv(_full()), None))  # before the fix: "changed after vLLM began loading"
