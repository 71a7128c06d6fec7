"""What else changes KV beyond the model config (connector/identity_guards.py):
weights not loaded from the fingerprinted files, engine-wide multimodal
options, counter identifiers, another platform's fp8 encoding, and the
deployments ucm-db refuses (context parallelism, non-causal attention).
Real vLLM configs and specs; the platform alone is a stub (no ROCm here)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from tests.connector.test_identity_inputs import _namespace_of, _vllm_config, model_dir  # noqa: E402,F401
from ucm_db.connector import identity_guards  # noqa: E402
from ucm_db.connector.identity import kv_shape  # noqa: E402
from ucm_db.connector.request_keys import request_block_extras  # noqa: E402
from ucm_db.connector.identity_guards import PROCESS_NONCE, device_tag, item_identity  # noqa: E402
from ucm_db.errors import ConfigError  # noqa: E402


def _kv_config(**spec_changes: Any) -> Any:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, **spec_changes)
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(layers, spec)])


# -- how the weights are loaded ------------------------------------------------


def test_dummy_weights_are_refused_unless_a_model_id_names_them(model_dir: Path) -> None:
    from vllm.config import LoadConfig

    config = _vllm_config(model_dir)
    config.load_config = LoadConfig(load_format="dummy")
    with pytest.raises(ConfigError, match="dummy") as refused:
        _namespace_of(config)
    assert "model_id" in (refused.value.hint or "")
    named = kv_shape(config, _kv_config(), "dummy-profiling")  # the operator names these weights
    assert named.model == "dummy-profiling" and '"load_format":"dummy"' in named.extra
    config.parallel_config.tensor_parallel_size = 2  # each shard's random weights are seeded alike: other weights
    assert kv_shape(config, _kv_config(), "dummy-profiling").extra != named.extra
    config.parallel_config.tensor_parallel_size = 1
    config.parallel_config.pipeline_parallel_size = 2  # every layer keeps its shape: the same weights
    assert kv_shape(config, _kv_config(), "dummy-profiling").extra == named.extra


def test_weights_not_read_from_the_model_files_are_keyed_by_how_they_are_loaded(model_dir: Path) -> None:
    from vllm.config import LoadConfig

    base = _namespace_of(_vllm_config(model_dir))
    same_files = _vllm_config(model_dir)
    same_files.load_config = LoadConfig(load_format="safetensors")
    assert _namespace_of(same_files) == base  # the same bytes, read another way
    sharded, streamed = _vllm_config(model_dir), _vllm_config(model_dir)
    sharded.load_config = LoadConfig(load_format="sharded_state")
    streamed.load_config = LoadConfig(load_format="runai_streamer", model_loader_extra_config={"concurrency": 4})
    digests = {_namespace_of(c).digest for c in (sharded, streamed)} | {base.digest}
    assert len(digests) == 3


def test_the_file_load_formats_are_those_vllm_reads_with_its_default_loader() -> None:
    """A tripwire: a format vLLM adds that reads the model's files through
    its default loader is keyed until it is judged here (safe, fewer hits)."""
    from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER, DefaultModelLoader

    default = {name for name, loader in _LOAD_FORMAT_TO_MODEL_LOADER.items() if loader is DefaultModelLoader}
    assert identity_guards.FILE_LOAD_FORMATS == default


def test_a_config_read_from_hf_config_path_is_keyed_by_its_content(model_dir: Path) -> None:
    """vLLM builds the config from ``hf_config_path``, not from the model's
    fingerprinted files: two configs there are two namespaces."""
    one, two = _vllm_config(model_dir), _vllm_config(model_dir)
    for config in (one, two):
        config.model_config.hf_config_path = "/configs/llama"
    two.model_config.hf_config.rms_norm_eps = 1e-3  # what another config file there would give
    assert len({_namespace_of(c).digest for c in (one, two, _vllm_config(model_dir))}) == 3


def test_a_config_directory_is_keyed_by_its_files_not_by_the_object_a_worker_may_change(
        model_dir: Path, tmp_path: Path) -> None:
    """The scheduler and a TP worker hold separate config objects, and a
    model constructor may change the worker's: the files vLLM read decide."""
    text = (model_dir / "config.json").read_text()
    first, copy, other = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    for folder, content in ((first, text), (copy, text), (other, text.replace("{", '{"rms_norm_eps": 0.001,', 1))):
        folder.mkdir()
        (folder / "config.json").write_text(content)
    configs = [_vllm_config(model_dir) for _ in range(3)]
    for config, folder in zip(configs, (first, copy, other)):
        config.model_config.hf_config_path = str(folder)
    before = _namespace_of(configs[0]).digest
    configs[0].model_config.hf_config.some_constructor_flag = True  # a worker's object, changed after it was built
    configs[0].model_config.hf_config._name_or_path = "/elsewhere"
    assert _namespace_of(configs[0]).digest == before == _namespace_of(configs[1]).digest  # same bytes, any folder
    assert _namespace_of(configs[2]).digest != before


def test_the_code_a_config_directorys_auto_map_names_is_keyed_with_it(model_dir: Path, tmp_path: Path) -> None:
    """Under ``trust_remote_code`` the config class (and the model's) runs
    from the ``*.py`` files beside the config, and from the modules beside
    it that they import relatively: other code there, other KV, though
    config.json is the same. Files nothing named imports are not keyed."""
    import json

    config = json.loads((model_dir / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_tiny.TinyConfig", "AutoModelForCausalLM": ["modeling_tiny.Tiny", None]}

    def namespace_with(files: dict[str, str], auto_map: bool = True) -> bytes:
        folder = tmp_path / f"cfg{len(list(tmp_path.iterdir()))}"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config if auto_map else {k: v for k, v in config.items() if k != "auto_map"}))
        for name, text in files.items():
            (folder / name).write_text(text)
        vllm_config = _vllm_config(model_dir)
        vllm_config.model_config.hf_config_path = str(folder)
        return _namespace_of(vllm_config).digest

    code = {"configuration_tiny.py": "from .rope_tiny import ROPE\n", "rope_tiny.py": "import .base_tiny\nROPE = 1\n",
            "base_tiny.py": "THETA = 1\n", "modeling_tiny.py": "class Tiny: ...\n"}
    base = namespace_with(code)
    assert namespace_with(code) == base  # the same files in another folder
    assert namespace_with({**code, "configuration_tiny.py": "from .rope_tiny import ROPE  # \n"}) != base
    assert namespace_with({**code, "modeling_tiny.py": "class Tiny: pass\n"}) != base
    assert namespace_with({**code, "rope_tiny.py": "import .base_tiny\nROPE = 2\n"}) != base  # imported by named code
    assert namespace_with({**code, "base_tiny.py": "THETA = 2\n"}) != base  # imported by an import
    assert namespace_with({**code, "unrelated.py": "x = 1\n"}) == base
    assert namespace_with({"modeling_tiny.py": code["modeling_tiny.py"]}) != base  # one named file absent


def test_a_hub_configs_auto_map_code_is_keyed_from_the_hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants

    commit = "d" * 40
    snap = tmp_path / "models--org--cfg" / "snapshots" / commit
    snap.mkdir(parents=True)
    (tmp_path / "models--org--cfg" / "refs").mkdir()
    (tmp_path / "models--org--cfg" / "refs" / "main").write_text(commit)
    (snap / "config.json").write_text('{"model_type": "tiny", "auto_map": {"AutoConfig": "configuration_tiny.TinyConfig"}}')
    (snap / "configuration_tiny.py").write_text("from .helpers import ROPE\n")
    (snap / "helpers.py").write_text("ROPE = 1\n")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    first = identity_guards.config_digest("org/cfg", None, commit)
    assert first.startswith("blake2b:") and identity_guards.config_digest("org/cfg", None, None) == first  # main
    (snap / "helpers.py").write_text("ROPE = 2\n")  # a module the named one imports
    second = identity_guards.config_digest("org/cfg", None, commit)
    assert second != first
    (snap / "configuration_tiny.py").write_text("from .helpers import ROPE  # \n")
    assert identity_guards.config_digest("org/cfg", None, commit) not in (first, second)


# -- multimodal ---------------------------------------------------------------


def _with_mm(model_dir: Path, **options: Any) -> Any:
    from vllm.config import MultiModalConfig

    config = _vllm_config(model_dir)
    config.model_config.multimodal_config = MultiModalConfig(**options)
    return config


def test_engine_wide_multimodal_options_reach_the_namespace(model_dir: Path, tmp_path: Path) -> None:
    plain = _namespace_of(_with_mm(model_dir))
    assert plain == _namespace_of(_vllm_config(model_dir))  # no option set: nothing keyed
    scales = tmp_path / "scales.json"
    scales.write_text('{"q": 1.0}')
    changed = [
        _with_mm(model_dir, mm_processor_kwargs={"do_normalize": False}),
        _with_mm(model_dir, media_io_kwargs={"video": {"num_frames": 40}}),
        _with_mm(model_dir, video_pruning_rate=0.5),
        _with_mm(model_dir, mm_encoder_attn_dtype="fp8", mm_encoder_fp8_scale_path=str(scales)),
    ]
    digests = [_namespace_of(c).digest for c in changed]
    assert len(set(digests)) == len(changed) and plain.digest not in digests
    scales.write_text('{"q": 2.0}')  # other scales, same path: other image embeddings
    assert _namespace_of(changed[3]).digest != digests[3]


def test_runtime_calibrated_encoder_scales_are_refused(model_dir: Path) -> None:
    with pytest.raises(ConfigError, match="calibrated at runtime") as refused:
        _namespace_of(_with_mm(model_dir, mm_encoder_attn_dtype="fp8"))
    assert "mm_encoder_fp8_scale_path" in (refused.value.hint or "")


def test_a_counter_identifier_is_unique_to_its_process_and_a_content_hash_is_kept() -> None:
    counter = "renderer0-mm-3-image-0"
    assert item_identity(counter) == f"{counter}@{PROCESS_NONCE}"
    assert item_identity("9f2c" * 16) == "9f2c" * 16 and item_identity("user-uuid-1") == "user-uuid-1"
    other = subprocess.run([sys.executable, "-c", "from ucm_db.connector.identity_guards import item_identity as i; "
                            f"print(i({counter!r}))"], capture_output=True, text=True, check=True).stdout.strip()
    assert other.startswith(counter + "@") and other != item_identity(counter)  # a restarted engine's counter 3 is not this one


def test_two_processes_counter_items_never_share_keys(tmp_path: Path) -> None:
    """The same counter identifier at the same place in the same prompt, as
    two engines' renderers give two different images: another block extra
    in another process."""
    from vllm import SamplingParams
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.v1.request import Request

    feature = MultiModalFeatureSpec(data=None, modality="image", identifier="renderer0-mm-1-image-0",
                                    mm_position=PlaceholderRange(offset=40, length=8))
    request = Request("r", list(range(128)), SamplingParams(max_tokens=1), None, mm_features=[feature])
    here = request_block_extras(request, 32)
    assert set(here) == {1} and PROCESS_NONCE.encode() in here[1]
    monkey = identity_guards.PROCESS_NONCE
    try:
        identity_guards.PROCESS_NONCE = "another-process"
        assert request_block_extras(request, 32)[1] != here[1]
    finally:
        identity_guards.PROCESS_NONCE = monkey


def test_with_both_caches_off_every_identifier_is_taken_as_a_counter(model_dir: Path) -> None:
    """vLLM gives counter identifiers when its prefix cache and processor
    cache are off, and hashes one with per-request kwargs into something
    that looks like content: under that config none is trusted."""
    from vllm import SamplingParams
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.v1.request import Request

    hashed = "5e1f" * 16  # what a counter identifier hashed with per-request kwargs looks like
    feature = MultiModalFeatureSpec(data=None, modality="image", identifier=hashed,
                                    mm_position=PlaceholderRange(offset=40, length=8))
    request = Request("r", list(range(128)), SamplingParams(max_tokens=1), None, mm_features=[feature])
    both_off = _with_mm(model_dir, mm_processor_cache_gb=0)
    both_off.cache_config.enable_prefix_caching = False
    shape = kv_shape(both_off, _kv_config(), None)
    assert shape.counter_mm_ids
    assert PROCESS_NONCE.encode() in request_block_extras(request, 32, shape.counter_mm_ids)[1]
    for cached in (_with_mm(model_dir, mm_processor_cache_gb=0), _with_mm(model_dir)):  # prefix cache on: content hashes
        assert not kv_shape(cached, _kv_config(), None).counter_mm_ids
    assert PROCESS_NONCE.encode() not in request_block_extras(request, 32)[1]


# -- platform -------------------------------------------------------------------


def _platform(name: str, fp8: Any) -> Any:
    return SimpleNamespace(device_name=name, device_type="cuda", fp8_dtype=lambda: fp8)


def test_rocm_is_not_cuda_and_its_fp8_encoding_is_named() -> None:
    cuda = _platform("cuda", torch.float8_e4m3fn)
    mi300, mi350 = _platform("rocm", torch.float8_e4m3fnuz), _platform("rocm", torch.float8_e4m3fn)
    assert device_tag(cuda, "fp8") == device_tag(cuda, "auto") == "cuda"  # CUDA namespaces as before
    assert device_tag(mi350, "auto") == device_tag(mi350, "fp8_e4m3") == "rocm"
    assert device_tag(mi300, "fp8") == "rocm:float8_e4m3fnuz" != device_tag(mi350, "fp8")


def test_the_platform_reaches_the_namespace(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm.platforms

    config = _vllm_config(model_dir)
    config.cache_config.cache_dtype = "fp8"
    layouts = {}
    for name, platform in {"cuda": _platform("cuda", torch.float8_e4m3fn),
                           "mi300": _platform("rocm", torch.float8_e4m3fnuz)}.items():
        monkeypatch.setattr(vllm.platforms, "current_platform", platform, raising=False)
        layouts[name] = kv_shape(config, _kv_config(), None).layout
    assert '"platform":"cuda"' in layouts["cuda"] and '"platform":"rocm:float8_e4m3fnuz"' in layouts["mi300"]


def test_a_quantized_models_kernel_scheme_reaches_the_namespace(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """fp8 or FP4 weights run other schemes on other GPU generations
    (weight-only Marlin kernels on some, activations quantized on others):
    a quantized model's namespace names the compute capability, named kernel
    backends and vLLM's switches; a model that is not quantized keeps one
    namespace across generations. The platforms are stand-ins: no GPU here."""
    import vllm.platforms

    config = _vllm_config(model_dir)  # built on this host's platform, then read as on a GPU's

    def extra(capability: tuple[int, int], quantization: str | None, **env: str) -> str:
        platform = SimpleNamespace(device_name="cuda", device_type="cuda", fp8_dtype=lambda: torch.float8_e4m3fn,
                                   get_device_capability=lambda: capability)
        for name in ("VLLM_MARLIN_INPUT_DTYPE", "VLLM_HUMMING_ONLINE_QUANT_CONFIG", "VLLM_B12X_MOE_FP4_FORCE_A16"):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        object.__setattr__(config.model_config, "quantization", quantization)
        with monkeypatch.context() as patched:
            patched.setattr(vllm.platforms, "current_platform", platform, raising=False)
            return kv_shape(config, _kv_config(), None).extra

    a100, h100 = (8, 0), (9, 0)
    assert extra(a100, None) == extra(h100, None)  # not quantized: one namespace
    assert extra(a100, "fp8") != extra(h100, "fp8")
    assert extra(h100, "fp8") != extra(h100, "fp8", VLLM_MARLIN_INPUT_DTYPE="int8")
    assert '"device_capability":"9.0"' in extra(h100, "fp8")
    assert extra(h100, "nvfp4") != extra(h100, "nvfp4", VLLM_B12X_MOE_FP4_FORCE_A16="1")


@pytest.mark.parametrize(("name", "value", "default"), [
    ("VLLM_ROCM_QUICK_REDUCE_QUANTIZATION", "INT4", "NONE"),  # TP all-reduce in 4 bits
    ("VLLM_FLOAT32_MATMUL_PRECISION", "high", "highest"),  # float32 matmuls as TF32
    ("VLLM_DEEPEPLL_NVFP4_DISPATCH", "1", "0"),  # expert-parallel dispatch in FP4
    ("VLLM_FLASHINFER_MOE_A2A_LOW_PRECISION_COMBINE", "1", "0"),  # expert outputs combined in FP8
    ("VLLM_ROCM_SHUFFLE_KV_CACHE_LAYOUT", "true", "False"),  # another packing of the KV pages
])
def test_an_environment_switch_that_quantizes_any_model_reaches_the_namespace(
        model_dir: Path, monkeypatch: pytest.MonkeyPatch, name: str, value: str, default: str) -> None:
    config = _vllm_config(model_dir)  # not quantized
    monkeypatch.delenv(name, raising=False)
    unset = kv_shape(config, _kv_config(), None).extra
    monkeypatch.setenv(name, default)
    assert kv_shape(config, _kv_config(), None).extra == unset  # vLLM's default: the same namespace
    monkeypatch.setenv(name, value)
    assert kv_shape(config, _kv_config(), None).extra != unset


# -- refused deployments -------------------------------------------------------------


@pytest.mark.parametrize("field", ["decode_context_parallel_size", "prefill_context_parallel_size"])
def test_context_parallelism_is_refused(model_dir: Path, field: str) -> None:
    config = _vllm_config(model_dir)
    object.__setattr__(config.parallel_config, field, 2)
    with pytest.raises(ConfigError, match=field) as refused:
        _namespace_of(config)
    assert f"{field}=1" in (refused.value.hint or "")


def test_non_causal_attention_is_refused(model_dir: Path) -> None:
    with pytest.raises(ConfigError, match="non-causally"):
        kv_shape(_vllm_config(model_dir), _kv_config(non_causal=True), None)
    kv_shape(_vllm_config(model_dir), _kv_config(), None)  # causal: accepted


# -- tripwires: every field of the configs identity_guards.py reads, judged --------

#: Every LoadConfig field: does it change the weights the KV is computed from?
LOAD_CONFIG_FIELDS = {
    "load_format": "keyed: outside FILE_LOAD_FORMATS (dummy refused without model_id)",
    "model_loader_extra_config": "keyed with a load format outside FILE_LOAD_FORMATS",
    "ignore_patterns": "keyed: which of the directory's files are loaded",
    "download_dir": "read: where the hub snapshot that is hashed lies",
    "safetensors_load_strategy": "no: how the same bytes are read",
    "safetensors_prefetch_num_threads": "no: how the same bytes are read",
    "safetensors_prefetch_block_size": "no: how the same bytes are read",
    "device": "no: where the weights are placed",
    "use_tqdm_on_load": "no: progress output",
    "pt_load_map_location": "no: where the weights are placed",
}

#: Every MultiModalConfig field: does it change an item's embeddings beyond its identifier?
MULTIMODAL_CONFIG_FIELDS = {
    "mm_processor_kwargs": "keyed",
    "media_io_kwargs": "keyed",
    "video_pruning_rate": "keyed (with video_pruning_method)",
    "video_pruning_method": "keyed with video_pruning_rate",
    "mm_encoder_attn_dtype": "keyed with the scale file's content; runtime scales refused",
    "mm_encoder_fp8_scale_path": "keyed by content",
    "mm_encoder_fp8_scale_save_path": "no: where runtime scales are saved (runtime scales are refused)",
    "mm_encoder_fp8_scale_save_margin": "no: runtime calibration (refused)",
    "mm_hasher_algorithm": "no: it makes the identifiers, which are keyed",
    "mm_device_do_normalize": "no: where the same normalisation runs, same numerics class",
    "mm_encoder_tp_mode": "no: how the encoder is split, same numerics class",
    "mm_encoder_attn_backend": "no: a kernel choice, same numerics class",
    "language_model_only": "no: no items then",
    "limit_per_prompt": "no: a limit",
    "enable_mm_embeds": "no: embeddings given are items with identifiers",
    "mm_processor_cache_gb": "no: a cache (at 0 with prefix caching off, counter identifiers are made process-unique)",
    "mm_processor_cache_type": "no: a cache",
    "mm_shm_cache_max_object_size_mb": "no: a cache",
    "mm_encoder_only": "no: an encoder-only engine stores no KV",
    "interleave_mm_strings": "no: prompt text layout; token ids are keyed",
    "skip_mm_profiling": "no: start-up",
    "mm_tensor_ipc": "no: transport",
    "allow_missing_mm_embeddings": "no: validation",
    "mm_ipc_gpu_memory_gb": "no: transport",
}


@pytest.mark.parametrize(("config", "judged"), [("LoadConfig", LOAD_CONFIG_FIELDS), ("MultiModalConfig", MULTIMODAL_CONFIG_FIELDS)])
def test_every_field_of_the_configs_read_is_judged(config: str, judged: dict[str, str]) -> None:
    import dataclasses

    import vllm.config

    fields = {f.name for f in dataclasses.fields(getattr(vllm.config, config))}
    new, gone = sorted(fields - set(judged)), sorted(set(judged) - fields)
    assert not new, f"vLLM's {config} has new fields {new}: judge whether each changes K/V (connector/identity_guards.py)"
    assert not gone, f"vLLM's {config} lost fields {gone}: drop them here (and from identity_guards.py)"


def test_ignored_weight_files_reach_the_namespace(model_dir: Path) -> None:
    from vllm.config import LoadConfig

    config = _vllm_config(model_dir)
    config.load_config = LoadConfig(ignore_patterns=["model-0000[2-9]*"])
    one = LoadConfig(ignore_patterns="model-0000[2-9]*")  # vLLM takes one pattern as a string too
    as_string = _vllm_config(model_dir)
    as_string.load_config = one
    default = _vllm_config(model_dir)
    default.load_config = LoadConfig(ignore_patterns=["original/**/*"])
    assert _namespace_of(config) == _namespace_of(as_string) != _namespace_of(_vllm_config(model_dir)) == _namespace_of(default)


def test_a_plain_deployment_names_only_what_it_did_before(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Upgrading keeps the namespace of a model without a draft, switches or
    a quantized KV cache: its layout and inputs hold the fields they held
    before drafts, numerics and weight subfolders were keyed (so its blocks
    still hit), and its model digest is its top-level files'."""
    import json

    from ucm_db.connector import numerics
    from ucm_db.connector.fingerprints import fingerprint

    for name in (*numerics.NUMERICS_ENV_DEFAULTS, *numerics.QUANT_ENV_VARS):
        monkeypatch.delenv(name, raising=False)
    shape = kv_shape(_vllm_config(model_dir), _kv_config(), None)
    assert set(json.loads(shape.layout)) == {"platform", "spec", "layers", "kv_heads", "head_size", "cache_dtype"}
    assert set(json.loads(shape.extra)) == {"dtype", "rope"}
    assert (shape.layers, shape.draft_layers, shape.drops_last_block) == (2, 0, False)
    assert shape.model == "blake3:" + fingerprint(model_dir).digest


def test_an_engine_set_up_for_weight_updates_is_told_to_reset_after_each(
        model_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """vLLM's weight sync (``weight_transfer_config``) changes the weights
    under the model's namespace and tells the connector nothing: the start
    says what keeps old KV from being served (a reset after each update)."""
    import logging

    from vllm.config.weight_transfer import WeightTransferConfig

    monkeypatch.setattr(identity_guards, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="vllm.ucm_db.connector.identity_guards"):
        kv_shape(_vllm_config(model_dir), _kv_config(), None)
        assert not [r for r in caplog.records if "weight updates" in r.getMessage()]
        config = _vllm_config(model_dir)
        config.weight_transfer_config = WeightTransferConfig()
        kv_shape(config, _kv_config(), None)
        kv_shape(config, _kv_config(), None)
    warned = [r.getMessage() for r in caplog.records if "weight updates" in r.getMessage()]
    assert len(warned) == 1 and "reset_connector=True" in warned[0]
