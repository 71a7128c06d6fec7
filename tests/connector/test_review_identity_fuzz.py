"""Review: the namespace an engine's blocks are stored under, input by input,
derived as the connector derives it in an engine.

Each engine here is vLLM's own config path, ``EngineArgs(...).create_engine_config()``
(platform checks, ucm-db's plugin wrapping the config parse, as in an engine's
processes), and the connector's ``namespace(kv_shape(vllm_config, kv_cache_config,
model_id))`` over a ``KVCacheConfig`` built as vLLM's attention layers build their
specs (this rank's KV heads, the resolved KV cache dtype and quantization mode, the
stage's layers). The model is a tiny random-weight Llama written to ``tmp_path``.

Invariants checked (docs/connector.md, "Identity: what a key names"):
    * An input that changes the K/V bytes of a token prefix moves the namespace id,
      and no two such variations share one (a seeded list per seed).
    * An input that leaves K/V as they are keeps the id: tensor- and pipeline-parallel
      size, scheduling, memory, logging, served name, dtype spelled another way, a
      local revision, LoRA enabled, ngram speculation.
    * Identity is by content: the same files under another path, link or relative
      path share the id; a config or weight file rewritten in place after a first
      start (the fingerprint caches warm) moves it, and moves it back once restored;
      an engine that parsed the old config is refused; tokenizer and generation files
      are not keyed (but Llama 4's ``attn_temperature_tuning`` from the generation
      config is).
    * Two engines that read different files of one folder (vLLM's Mistral layout:
      ``params.json`` and ``consolidated*.safetensors`` beside ``config.json`` and HF
      shards, read or not by ``config_format``/``load_format`` auto) must not share a
      namespace: the review's repros below (both shared one before the formats were
      keyed in such folders: connector/identity_guards.py, ``has_mistral_layout``).
    * Over-keying the docs accept (fewer hits, never wrong ones) is pinned as the
      docs state it: a renamed shard, ``kv_cache_dtype`` spelled as the model dtype.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from vllm.engine.arg_utils import EngineArgs  # noqa: E402

from ucm_db.connector import fingerprints  # noqa: E402
from ucm_db.connector.identity import kv_shape, namespace  # noqa: E402
from ucm_db.errors import ConfigError  # noqa: E402
from ucm_db.keys import Namespace  # noqa: E402

SEEDS = (11, 23, 37)
#: Every engine's arguments beside a case's (no tokenizer: ids are keyed, not text).
BASE_ARGS: dict[str, Any] = {"skip_tokenizer_init": True, "max_model_len": 256}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


@pytest.fixture(autouse=True)
def own_caches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A private fingerprint cache file and a fresh in-process memo per test."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(fingerprints, "_memo", {})
    monkeypatch.setattr(fingerprints, "_warned", set())


def write_llama(path: Path, seed: int, **config: Any) -> Path:
    """A tiny Llama (2 layers, 2 KV heads of 32) with random weights of ``seed`` and tokenizer files."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, vocab_size=256, max_position_embeddings=512,
                **config).save_pretrained(path)
    generator = torch.Generator().manual_seed(seed)
    weights = {name: torch.randn(shape, generator=generator) for name, shape in
               (("model.embed_tokens.weight", (256, 64)), ("model.layers.0.self_attn.k_proj.weight", (64, 64)),
                ("lm_head.weight", (256, 64)))}
    save_file(weights, str(path / "model.safetensors"))
    for name in TOKENIZER_FILES:
        (path / name).write_text(json.dumps({"seed": seed, "file": name}))
    return path


def engine_config(model: Path | str, **args: Any) -> Any:
    """The VllmConfig an engine serving ``model`` with ``args`` builds."""
    return EngineArgs(model=str(model), **{**BASE_ARGS, **args}).create_engine_config()


def kv_cache_config_of(config: Any, pp_rank: int = 0) -> Any:
    """A KVCacheConfig as vLLM's attention layers of ``pp_rank``'s stage specify it."""
    from vllm.distributed.utils import get_pp_indices
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, get_kv_quant_mode

    model, cache, parallel = config.model_config, config.cache_config, config.parallel_config
    spec = FullAttentionSpec(block_size=cache.block_size, num_kv_heads=model.get_num_kv_heads(parallel),
                             head_size=model.get_head_size(), kv_quant_mode=get_kv_quant_mode(cache.cache_dtype),
                             dtype=kv_cache_dtype_str_to_dtype(cache.cache_dtype, model))
    start, stop = get_pp_indices(model.hf_text_config.num_hidden_layers, pp_rank, parallel.pipeline_parallel_size)
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(start, stop)]
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(layers, spec)])


def namespace_of(config: Any, pp_rank: int = 0) -> Namespace:
    """The connector's namespace for ``config`` (connector.py: kv_shape, then namespace)."""
    return namespace(kv_shape(config, kv_cache_config_of(config, pp_rank), None))


def engine_id(model: Path | str, **args: Any) -> bytes:
    return namespace_of(engine_config(model, **args)).id


@pytest.fixture(scope="module")
def shared_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model no test changes (file cases write their own)."""
    return write_llama(tmp_path_factory.mktemp("review_identity") / "llama", seed=0)


# -- engine arguments, one at a time -------------------------------------------------------------------------------


def kv_changing_variations(rng: random.Random) -> dict[str, dict[str, Any]]:
    """Engine arguments that change K/V for the same token ids, values drawn from ``rng``."""
    theta = rng.choice([20000.0, 50000.0, 500000.0])
    return {
        "dtype float32": {"dtype": "float32"},
        "kv_cache_dtype fp8_e4m3": {"kv_cache_dtype": "fp8_e4m3"},
        "kv_cache_dtype fp8_e5m2": {"kv_cache_dtype": "fp8_e5m2"},
        "block_size": {"block_size": rng.choice([16, 32, 64])},
        "quantization fp8 (online)": {"quantization": "fp8"},
        "quantization fp8 per-token activations": {"quantization": "fp8", "quantization_config": {
            "linear": {"weight": "fp8_per_tensor_dynamic", "activation": "fp8_per_token"}}},
        "quantization fp8 per-tensor activations": {"quantization": "fp8", "quantization_config": {
            "linear": {"weight": "fp8_per_tensor_dynamic", "activation": "fp8_per_tensor_dynamic"}}},
        "hf_overrides num_key_value_heads": {"hf_overrides": {"num_key_value_heads": 1}},
        "hf_overrides rope_theta": {"hf_overrides": {"rope_parameters": {"rope_type": "default", "rope_theta": theta}}},
        "hf_overrides rope linear": {"hf_overrides": {"rope_parameters": {
            "rope_type": "linear", "factor": rng.choice([2.0, 4.0]), "rope_theta": 10000.0}}},
        "hf_overrides rms_norm_eps": {"hf_overrides": {"rms_norm_eps": rng.choice([1e-5, 1e-4, 1e-3])}},
        "hf_overrides head_dim": {"hf_overrides": {"head_dim": 16}},
        "additional_config": {"additional_config": {"review": rng.randrange(1 << 30)}},
    }


def kv_keeping_variations(rng: random.Random) -> dict[str, dict[str, Any]]:
    """Engine arguments that leave K/V as they are (the baseline is ``dtype`` auto: bfloat16 on CPU)."""
    return {
        "tensor_parallel_size 2": {"tensor_parallel_size": 2},
        "tensor_parallel_size 4 (KV heads replicated)": {"tensor_parallel_size": 4},
        "pipeline_parallel_size 2": {"pipeline_parallel_size": 2},
        "scheduling and memory": {"max_num_seqs": rng.randint(1, 64), "max_num_batched_tokens": rng.choice([512, 1024]),
                                  "gpu_memory_utilization": rng.choice([0.5, 0.7])},
        "logging, seed, names": {"disable_log_stats": True, "seed": rng.randrange(1000), "served_model_name": "x"},
        "eager, no prefix cache": {"enforce_eager": True, "enable_prefix_caching": False},
        "dtype bfloat16 spelled out": {"dtype": "bfloat16"},
        "revision of a local directory": {"revision": "v1"},
        "max_model_len under default rope": {"max_model_len": rng.choice([128, 512])},
        "LoRA enabled": {"enable_lora": True, "max_lora_rank": 16},
        "ngram speculation": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2,
                                                     "prompt_lookup_max": 3}},
        "prompt embeddings enabled": {"enable_prompt_embeds": True},
        "hf_overrides empty": {"hf_overrides": {}},
        "additional_config empty": {"additional_config": {}},
    }


@pytest.mark.parametrize("seed", SEEDS)
def test_each_kv_changing_argument_has_a_namespace_of_its_own(shared_model: Path, seed: int) -> None:
    base = engine_id(shared_model)
    ids: dict[bytes, str] = {base: "baseline"}
    for name, args in kv_changing_variations(random.Random(seed)).items():
        ns_id = engine_id(shared_model, **args)
        assert ns_id not in ids, f"seed {seed}: {name!r} has the namespace of {ids.get(ns_id)!r}"
        ids[ns_id] = name


@pytest.mark.parametrize("seed", SEEDS)
def test_each_kv_keeping_argument_keeps_the_namespace(shared_model: Path, seed: int) -> None:
    base = engine_id(shared_model)
    for name, args in kv_keeping_variations(random.Random(seed)).items():
        assert engine_id(shared_model, **args) == base, f"seed {seed}: {name!r} moved the namespace"


@pytest.mark.parametrize("tp", [2, 4])
def test_every_tp_size_reads_what_tp1_wrote_under_each_kv_changing_argument(shared_model: Path, tp: int) -> None:
    """Any TP reads any TP's blocks: not only at the defaults, under every keyed input too."""
    for name, args in kv_changing_variations(random.Random(SEEDS[0])).items():
        one = engine_config(shared_model, **args)
        many = engine_config(shared_model, tensor_parallel_size=tp, **args)
        assert kv_cache_config_of(many).kv_cache_groups[0].kv_cache_spec.num_kv_heads <= \
            kv_cache_config_of(one).kv_cache_groups[0].kv_cache_spec.num_kv_heads  # this rank's share
        assert namespace_of(many) == namespace_of(one), f"{name!r} at TP={tp}"


def test_every_pipeline_stage_derives_one_namespace(shared_model: Path) -> None:
    config = engine_config(shared_model, pipeline_parallel_size=2)
    stages = {namespace_of(config, pp_rank=0), namespace_of(config, pp_rank=1)}
    assert stages == {namespace_of(engine_config(shared_model))}


def test_a_dtype_spelled_two_ways_is_one_namespace(shared_model: Path) -> None:
    assert engine_id(shared_model, dtype="half") == engine_id(shared_model, dtype="float16")
    assert engine_id(shared_model, dtype="float") == engine_id(shared_model, dtype="float32")
    assert engine_id(shared_model, dtype="auto") == engine_id(shared_model, dtype="bfloat16")


def test_kv_cache_dtype_spelled_as_the_model_dtype_is_over_keyed_as_documented(shared_model: Path) -> None:
    """Both store bfloat16 K/V; the layout names ``cache_dtype`` as given (fewer hits, never wrong ones)."""
    auto, spelled = engine_config(shared_model), engine_config(shared_model, kv_cache_dtype="bfloat16")
    assert namespace_of(auto).kv_dtype == namespace_of(spelled).kv_dtype == "bfloat16"
    assert namespace_of(auto) != namespace_of(spelled)


# -- the model's files ------------------------------------------------------------------------------------------------


def rewrite_in_place(file: Path, text: str) -> None:
    """Rewrites ``file`` through its inode (a trainer saving over it), keeping its size and mtime."""
    st = file.stat()
    data = text.encode()
    assert len(data) == st.st_size, "a same-size rewrite is the hardest case for a stat-keyed cache"
    with file.open("r+b") as handle:
        handle.write(data)
    os.utime(file, ns=(st.st_atime_ns, st.st_mtime_ns))


def config_with(model: Path, old: str, new: str) -> str:
    text = (model / "config.json").read_text()
    assert old in text and len(old) == len(new)
    return text.replace(old, new)


@pytest.mark.parametrize("seed", SEEDS)
def test_a_config_edited_in_place_after_a_first_start_moves_the_namespace(tmp_path: Path, seed: int) -> None:
    model = write_llama(tmp_path / "llama", seed)
    original = (model / "config.json").read_text()
    first_config = engine_config(model)
    first = namespace_of(first_config)  # every cache warm: memo, parse record
    assert namespace_of(first_config) == first
    edits = [('"rms_norm_eps": 1e-06', '"rms_norm_eps": 1e-05'), ('"rope_theta": 10000.0', '"rope_theta": 90000.0'),
             ('"hidden_act": "silu"', '"hidden_act": "gelu"')]
    old, new = random.Random(seed).choice(edits)
    rewrite_in_place(model / "config.json", config_with(model, old, new))
    with pytest.raises(ConfigError, match="changed after vLLM parsed it"):
        namespace_of(first_config)  # the first engine computes with the config it parsed
    edited = engine_id(model)
    assert edited != first.id, f"{new} left the namespace"
    assert edited == engine_id(shutil.copytree(model, tmp_path / "fresh copy"))  # what a cold start of it derives
    rewrite_in_place(model / "config.json", original)
    assert engine_id(model) == first.id  # restored: the same files, the same namespace


@pytest.mark.parametrize("seed", SEEDS)
def test_weights_retrained_in_place_move_the_namespace_and_restored_weights_return(tmp_path: Path, seed: int) -> None:
    model = write_llama(tmp_path / "llama", seed)
    saved = (model / "model.safetensors").read_bytes()
    first = engine_id(model)
    write_llama(tmp_path / "retrained", seed + 1)
    retrained = (tmp_path / "retrained" / "model.safetensors").read_bytes()
    assert len(retrained) == len(saved)
    with (model / "model.safetensors").open("r+b") as handle:
        handle.write(retrained)
    assert engine_id(model) != first
    with (model / "model.safetensors").open("r+b") as handle:
        handle.write(saved)
    assert engine_id(model) == first


@pytest.mark.parametrize("seed", SEEDS)
def test_tokenizer_and_generation_files_edited_after_a_start_keep_the_namespace(tmp_path: Path, seed: int) -> None:
    model = write_llama(tmp_path / "llama", seed)
    started = engine_config(model)
    first = namespace_of(started)
    rng = random.Random(seed)
    for name in rng.sample(TOKENIZER_FILES, k=len(TOKENIZER_FILES)):
        (model / name).write_text(json.dumps({"edited": rng.random(), "temperature": 0.3}))
        assert namespace_of(started) == first, f"{name} edited under a running engine"
        assert engine_id(model) == first.id, f"{name} edited before a restart"


def test_the_same_files_under_another_path_link_or_relative_path_share_the_namespace(
        shared_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = engine_id(shared_model)
    copy = shutil.copytree(shared_model, tmp_path / "elsewhere" / "renamed-model")
    link = tmp_path / "current"
    link.symlink_to(copy, target_is_directory=True)
    monkeypatch.chdir(copy.parent)
    for model in (copy, link, "renamed-model", f"{copy.parent}/../elsewhere/renamed-model"):
        assert engine_id(model) == base, model


def test_a_link_repointed_to_other_weights_moves_the_namespace(shared_model: Path, tmp_path: Path) -> None:
    """A deployment's ``current -> v1`` link moved to v2: the path is the same, the files are not."""
    v2 = write_llama(tmp_path / "v2", seed=99)
    link = tmp_path / "current"
    link.symlink_to(shared_model, target_is_directory=True)
    before = engine_id(link)
    link.unlink()
    link.symlink_to(v2, target_is_directory=True)
    assert engine_id(link) == engine_id(v2) != before


def test_a_renamed_shard_is_over_keyed_as_documented(shared_model: Path, tmp_path: Path) -> None:
    """"Names and contents only": the same tensors under another shard name (fewer hits, never wrong ones)."""
    copy = shutil.copytree(shared_model, tmp_path / "renamed")
    (copy / "model.safetensors").rename(copy / "model-00001-of-00001.safetensors")
    assert engine_id(copy) != engine_id(shared_model)


def test_files_vllm_never_loads_beside_the_weights_keep_the_namespace(shared_model: Path, tmp_path: Path) -> None:
    copy = shutil.copytree(shared_model, tmp_path / "extras")
    base = engine_id(copy)
    (copy / "pytorch_model.bin").write_bytes(os.urandom(64))  # .safetensors present: vLLM loads those
    (copy / "README.md").write_text("notes")
    (copy / "chat_template.jinja").write_text("{{ messages }}")
    (copy / "tokenizer.model").write_bytes(os.urandom(64))
    assert engine_id(copy) == base


# -- Llama 4: the one generation-config value that changes K/V ------------------------------------------------------


def write_llama4(path: Path, generation: dict[str, Any]) -> Path:
    from safetensors.torch import save_file
    from transformers import Llama4TextConfig

    Llama4TextConfig(hidden_size=64, intermediate_size=128, intermediate_size_mlp=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=256,
                     max_position_embeddings=512, num_local_experts=2, num_experts_per_tok=1).save_pretrained(path)
    described = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**described, "architectures": ["Llama4ForCausalLM"]}))
    save_file({"lm_head.weight": torch.zeros(4, 4)}, str(path / "model.safetensors"))
    (path / "generation_config.json").write_text(json.dumps(generation))
    return path


def test_llama4_temperature_tuning_from_the_generation_config_is_keyed_and_sampling_is_not(tmp_path: Path) -> None:
    model = write_llama4(tmp_path / "llama4", {"temperature": 0.6, "attn_temperature_tuning": True})
    tuned = engine_id(model)
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.9, "attn_temperature_tuning": True}))
    assert engine_id(model) == tuned  # sampling only
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.9, "attn_temperature_tuning": False}))
    assert engine_id(model) != tuned  # the NoPE layers' queries, so every later layer's K/V
    assert engine_id(model, override_generation_config={"attn_temperature_tuning": True}) == tuned


# -- one folder, two formats: vLLM's Mistral layout -------------------------------------------------------------------


def write_two_layouts(path: Path, *, hf_eps: float, mistral_eps: float, hf_seed: int, mistral_seed: int) -> Path:
    """A folder in both layouts vLLM reads, each half of its own (a fine-tune saved with ``save_pretrained``
    into a copy of a Mistral snapshot: the HF half new, ``params.json`` and ``consolidated.safetensors`` stale)."""
    from safetensors.torch import save_file

    write_llama(path, hf_seed, rms_norm_eps=hf_eps)
    (path / "model.safetensors").rename(path / "model-00001-of-00001.safetensors")
    weight_map = {"model.embed_tokens.weight": "model-00001-of-00001.safetensors"}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "params.json").write_text(json.dumps({"dim": 64, "n_layers": 2, "head_dim": 32, "hidden_dim": 128,
                                                  "n_heads": 4, "n_kv_heads": 2, "norm_eps": mistral_eps,
                                                  "vocab_size": 256, "rope_theta": 10000.0}))
    generator = torch.Generator().manual_seed(mistral_seed)
    consolidated = {"tok_embeddings.weight": torch.randn(256, 64, generator=generator)}
    save_file(consolidated, str(path / "consolidated.safetensors"))
    return path


def files_loaded(config: Any) -> dict[str, bytes]:
    """The weight files vLLM's default loader reads for ``config`` (its own selection), by name."""
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    model = config.model_config.model
    _, files, _, _ = DefaultModelLoader(config.load_config)._prepare_weights(model, None, None, True, None)
    return {Path(file).name: Path(file).read_bytes() for file in files}


def test_engines_loading_other_weight_files_of_one_folder_get_other_namespaces(tmp_path: Path) -> None:
    model = write_two_layouts(tmp_path / "mistral-ft", hf_eps=1e-6, mistral_eps=1e-6, hf_seed=1, mistral_seed=2)
    (model / "params.json").unlink()  # the config is config.json for both: only the weights differ
    default, safetensors = engine_config(model), engine_config(model, load_format="safetensors")
    assert default.model_config.hf_config.rms_norm_eps == safetensors.model_config.hf_config.rms_norm_eps
    assert set(files_loaded(default)) == {"consolidated.safetensors"}  # vLLM's auto: the Mistral layout
    assert set(files_loaded(safetensors)) == {"model-00001-of-00001.safetensors"}
    assert namespace_of(default) != namespace_of(safetensors)


def test_engines_parsing_other_config_files_of_one_folder_get_other_namespaces(tmp_path: Path) -> None:
    model = write_two_layouts(tmp_path / "mistral-ft", hf_eps=1e-6, mistral_eps=1e-5, hf_seed=1, mistral_seed=1)
    default, hf = engine_config(model), engine_config(model, config_format="hf")
    assert files_loaded(default) == files_loaded(hf)  # the same weights: only the config read differs
    assert (default.model_config.hf_config.rms_norm_eps, hf.model_config.hf_config.rms_norm_eps) == (1e-5, 1e-6)
    assert namespace_of(default) != namespace_of(hf)
