"""Weights a model loads from outside its own directory reach its identity,
and what ``--load-format npcache`` loads is what is keyed
(``connector/fingerprints.py``, ``connector/weight_files.py``).

* Ultravox names its language model and audio tower by
  ``config.text_model_id`` / ``audio_model_id``: another local directory or
  hub repo, which vLLM loads as a ``secondary_weights`` source. Every layer
  that writes K/V comes from there, so its files are keyed (a hub id by
  its snapshot at ``main``, as vLLM loads it; refused where not cached).
* A tripwire reads vLLM's model classes: a new ``secondary_weights`` source
  that is not the model's own directory (or a config field naming another
  model) fails until ucm-db keys it.
* npcache loads ``np/`` (the arrays it converted once) whenever
  ``np/weight_names.json`` exists, never the ``.bin`` files again.
* Golden digests: models without any of these keep the namespaces they had.

Real files and vLLM's own configs; no engine (the audit's end-to-end runs
of both wrong-KV cases are ``/tmp/audit_identity/ultravox_e2e.py`` and
``npcache_stale.py``).
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

import vllm  # noqa: E402
from vllm.config import LoadConfig  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402

from ucm_db.connector.fingerprints import adapter_key, fingerprint, model_fingerprint  # noqa: E402
from ucm_db.connector.weight_files import EXPORT_FOLDERS, SUB_MODEL_FIELDS  # noqa: E402
from ucm_db.errors import ConfigError  # noqa: E402

from test_identity_inputs import _hub, own_caches  # noqa: E402,F401 - autouse: each test its own fingerprint cache

VLLM = Path(vllm.__file__).parent


def _write(path: Path, files: dict[str, bytes | str]) -> Path:
    for name, data in files.items():
        file = path / name
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_bytes(data if isinstance(data, bytes) else data.encode())
    return path


def _identity(model: str | Path, load_config: LoadConfig | None = None, hf_config: Any = None) -> str:
    return model_fingerprint(SimpleNamespace(model=str(model), revision=None, hf_config=hf_config),
                             load_config=load_config or LoadConfig())


# -- models that load weights from elsewhere ----------------------------------


def _text_model(path: Path, weights: bytes) -> Path:
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=2, head_dim=64, vocab_size=1000, max_position_embeddings=512).save_pretrained(path)
    (path / "model.safetensors").write_bytes(weights)
    return path


def _audio_model(path: Path, weights: bytes) -> Path:
    from transformers import WhisperConfig

    WhisperConfig(d_model=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
                  encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=80, vocab_size=1000).save_pretrained(path)
    (path / "model.safetensors").write_bytes(weights)
    return path


def _ultravox(path: Path, text: str, audio: str) -> Path:
    """An Ultravox directory as the hub ships it: its config and the projector only."""
    config = {"model_type": "ultravox", "architectures": ["UltravoxModel"], "text_model_id": text,
              "audio_model_id": audio, "audio_token_index": 999, "hidden_size": 128, "stack_factor": 8,
              "projector_act": "swiglu", "vocab_size": 1000, "torch_dtype": "float32"}
    return _write(path, {"config.json": json.dumps(config), "model.safetensors": b"projector" * 64})


def _ultravox_namespace(model: Path) -> Any:
    """The namespace ucm-db derives for an Ultravox engine, from vLLM's own configs."""
    from vllm.config import CacheConfig, ModelConfig, VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from ucm_db.connector.identity import kv_shape, namespace

    vllm_config = VllmConfig(model_config=ModelConfig(model=str(model), skip_tokenizer_init=True, dtype="float32",
                                                      max_model_len=512), cache_config=CacheConfig(block_size=32))
    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.float32)
    layers = [f"language_model.model.layers.{i}.self_attn.attn" for i in range(2)]
    kv_cache_config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(layers, spec)])
    return namespace(kv_shape(vllm_config, kv_cache_config, None))


def test_ultravox_is_keyed_by_the_language_model_and_audio_tower_it_loads(tmp_path: Path) -> None:
    """The audit's ultravox_text_model.py: the text model replaced in place
    kept the namespace, so an engine on the new weights was served the old
    ones' KV (ultravox_e2e.py: 192 hit tokens, other greedy tokens)."""
    text = _text_model(tmp_path / "text", b"A" * 4096)
    audio = _audio_model(tmp_path / "audio", b"W" * 4096)
    model = _ultravox(tmp_path / "ultravox", str(text), str(audio))
    first = _ultravox_namespace(model)
    assert first.model != "blake3:" + fingerprint(model).digest  # more than the projector's directory
    (text / "model.safetensors").write_bytes(b"B" * 4096)  # the language model retrained in place
    retrained = _ultravox_namespace(model)
    assert retrained.id != first.id
    (audio / "model.safetensors").write_bytes(b"X" * 4096)  # another audio tower: other embeddings, other KV
    assert _ultravox_namespace(model).id != retrained.id


def test_a_sub_model_is_keyed_by_content_not_by_the_name_that_points_at_it(tmp_path: Path) -> None:
    projector = _write(tmp_path / "uv", {"config.json": '{"model_type": "ultravox"}', "model.safetensors": b"p" * 64})
    text = _write(tmp_path / "a" / "text", {"config.json": "{}", "model.safetensors": b"t" * 512})
    copy = _write(tmp_path / "b" / "moved", {"config.json": "{}", "model.safetensors": b"t" * 512})
    here = _identity(projector, hf_config=SimpleNamespace(text_model_id=str(text), audio_model_id=None))
    assert _identity(projector, hf_config=SimpleNamespace(text_model_id=str(copy), audio_model_id=None)) == here
    # Which sub-model a directory is matters: the same files as audio tower are another model.
    assert _identity(projector, hf_config=SimpleNamespace(text_model_id=None, audio_model_id=str(text))) != here
    # No sub-model named: the directory's own digest, as before.
    assert _identity(projector, hf_config=SimpleNamespace(text_model_id=None)) == "blake3:" + fingerprint(projector).digest


def test_a_hub_sub_model_is_keyed_by_its_snapshot_at_main_and_refused_where_not_cached(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM loads a sub-model hub id at ``main`` (revision None) before the
    connector starts: the snapshot ``refs/main`` names is what it loaded."""
    old, new = "a" * 40, "b" * 40
    _hub(tmp_path / "hub", "org/text", {"main": old}, {old: b"old" * 100, new: b"new" * 100})
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.delenv("VLLM_USE_MODELSCOPE", raising=False)
    projector = _write(tmp_path / "uv", {"config.json": '{"model_type": "ultravox"}', "model.safetensors": b"p" * 64})
    config = SimpleNamespace(text_model_id="org/text", audio_model_id=None)
    then = _identity(projector, hf_config=config)
    (tmp_path / "hub" / "models--org--text" / "refs" / "main").write_text(new)  # main moved on: other weights loaded
    assert _identity(projector, hf_config=config) != then
    with pytest.raises(ConfigError) as info:
        _identity(projector, hf_config=SimpleNamespace(text_model_id="org/absent", audio_model_id=None))
    assert "text_model_id" in str(info.value) and "org/absent" in str(info.value)
    assert "model_id" in info.value.hint
    monkeypatch.setenv("VLLM_USE_MODELSCOPE", "1")  # vLLM would load ModelScope's files, which ucm-db cannot name
    with pytest.raises(ConfigError, match="ModelScope"):
        _identity(projector, hf_config=config)


def _source_calls(tree: ast.AST) -> list[ast.Call]:
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call)
            and (getattr(node.func, "attr", None) == "Source" or getattr(node.func, "id", None) == "Source")]


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((kw.value for kw in call.keywords if kw.arg == name), None)


#: The model's own directory, as vLLM's model classes name it.
_OWN_DIRECTORY = {"vllm_config.model_config.model", "model_config.model"}
#: Files of its own directory a model class loads beside the weights ucm-db keys, judged one by one: pooling
#: heads read after the last layer (they change embeddings or scores, never a layer's K/V).
_OWN_FILES_JUDGED = {
    "roberta.py": "BGE-M3's sparse_linear.pt / colbert_linear.pt: pooling heads (and an encoder: refused anyway)",
    "clef_omni.py": "the joint schema pooler's head: applied to the last hidden states",
}


def _unkeyed(module: str, call: ast.Call) -> str | None:
    """Why ucm-db would not key the weights one ``Source(...)`` of ``module`` loads (None: it does)."""
    where = _keyword(call, "model_or_path")
    source = ast.unparse(where) if where is not None else "<positional>"
    if source not in _OWN_DIRECTORY:
        field = re.fullmatch(r"(?:\w+\.)*config\.(\w+)", source)
        if field is None or field.group(1) not in SUB_MODEL_FIELDS:
            return f"{module}: loads weights from {source}, which ucm-db does not key (SUB_MODEL_FIELDS)"
        return None
    subfolder = _keyword(call, "subfolder")
    if subfolder is not None:
        name = str(subfolder.value) if isinstance(subfolder, ast.Constant) else "/"
        if "/" in name or name.startswith(".") or name in EXPORT_FOLDERS | {"original"}:
            return f"{module}: loads from subfolder {ast.unparse(subfolder)}: ucm-db keys one level, not hidden, export or original/"
    if _keyword(call, "allow_patterns_overrides") is not None and module not in _OWN_FILES_JUDGED:
        return f"{module}: loads chosen files of the model directory, maybe of a kind ucm-db does not key: judge them"
    return None


def test_every_vllm_weight_source_outside_the_model_directory_is_keyed() -> None:
    """Tripwire: each ``DefaultModelLoader.Source`` a vLLM model class adds
    loads either from the model's own directory (one subfolder level at
    most, not one ucm-db leaves out; extra files judged above) or from a
    directory a config field names, which must be in ``SUB_MODEL_FIELDS``.
    A new vLLM model that loads weights from anywhere else fails here,
    naming it."""
    unjudged: list[str] = []
    seen: set[str] = set()
    for module in sorted((VLLM / "model_executor" / "models").glob("*.py")):
        text = module.read_text()
        if "secondary_weights" not in text:
            continue
        calls = _source_calls(ast.parse(text))
        if not calls:
            unjudged.append(f"{module.name}: sets secondary_weights without a Source(...) this test can read")
        unjudged += [why for call in calls if (why := _unkeyed(module.name, call))]
        seen.add(module.name)
    assert not unjudged, "\n".join(unjudged)
    assert {"ultravox.py", "kimi_audio.py"} <= seen  # the tripwire reads what it should


@pytest.mark.parametrize("source", [
    "DefaultModelLoader.Source(model_or_path=config.vision_model_id, revision=None)",
    "DefaultModelLoader.Source(vllm_config.model_config.model, None)",
    "DefaultModelLoader.Source(model_or_path=model_config.model, revision=None, subfolder='a/b')",
    "DefaultModelLoader.Source(model_or_path=model_config.model, revision=None, allow_patterns_overrides=['*.pt'])",
])
def test_the_tripwire_trips_on_a_source_ucm_db_does_not_key(source: str) -> None:
    call = ast.parse(source).body[0].value  # type: ignore[attr-defined]
    assert _unkeyed("new_model.py", call)
    assert _unkeyed("kimi_audio.py", ast.parse(
        "Source(model_or_path=vllm_config.model_config.model, subfolder='whisper-large-v3', revision=None)"
    ).body[0].value) is None  # type: ignore[attr-defined]


def test_every_vllm_config_field_naming_another_model_is_keyed() -> None:
    """Tripwire: a config class of vLLM's with a field naming another
    model's weights (``*_model_id``, ``*_model_path``) is a sub-model vLLM
    may load: ucm-db must key it (``SUB_MODEL_FIELDS``)."""
    fields: set[str] = set()
    for module in (VLLM / "transformers_utils" / "configs").glob("*.py"):
        fields |= set(re.findall(r"\b(\w+_model_(?:id|path))\b", module.read_text()))
    assert fields == set(SUB_MODEL_FIELDS), f"fields naming another model: {sorted(fields)}"


# -- npcache --------------------------------------------------------------------


def _bin_model(path: Path) -> Path:
    return _write(path, {"config.json": '{"model_type": "llama"}', "pytorch_model.bin": b"A" * 4096})


def _converted(model: Path, arrays: dict[str, bytes]) -> None:
    """What vLLM's np_cache_weights_iterator leaves: one file per parameter, then the names."""
    _write(model / "np", {**arrays, "weight_names.json": json.dumps(sorted(arrays))})


def test_npcache_keys_the_arrays_it_loads_not_the_bin_files_it_no_longer_reads(tmp_path: Path) -> None:
    """The audit's npcache_stale.py: the .bin replaced in place, an npcache
    engine kept computing with the old arrays under the new files' namespace,
    which an engine loading the .bin shares: wrong KV served."""
    npcache = LoadConfig(load_format="npcache")
    model = _bin_model(tmp_path / "m")
    _converted(model, {"lm_head.weight": b"a" * 256, "model.norm.weight": b"n" * 64})
    converted = _identity(model, npcache)
    (model / "pytorch_model.bin").write_bytes(b"B" * 4096)  # weights B: npcache still loads A's arrays
    assert _identity(model, npcache) == converted
    assert _identity(model, npcache) != _identity(model)  # never the namespace of an engine on B's .bin
    (model / "np" / "lm_head.weight").write_bytes(b"c" * 256)  # the arrays it loads changed
    assert _identity(model, npcache) != converted


def test_npcache_before_conversion_keys_the_bin_files_it_will_convert(tmp_path: Path) -> None:
    npcache = LoadConfig(load_format="npcache")
    model = _bin_model(tmp_path / "m")
    (model / "np").mkdir()  # vLLM makes the folder first: no weight_names.json yet, the .bin is read
    _write(model / "np", {"lm_head.weight": b"half-written" * 8})
    before = _identity(model, npcache)
    (model / "pytorch_model.bin").write_bytes(b"B" * 4096)
    assert _identity(model, npcache) != before


def test_npcache_in_a_sub_model_keys_its_arrays(tmp_path: Path) -> None:
    npcache = LoadConfig(load_format="npcache")
    projector = _bin_model(tmp_path / "uv")
    text = _bin_model(tmp_path / "text")
    _converted(text, {"w": b"1" * 64})
    config = SimpleNamespace(text_model_id=str(text), audio_model_id=None)
    before = _identity(projector, npcache, config)
    (text / "np" / "w").write_bytes(b"2" * 64)
    assert _identity(projector, npcache, config) != before


# -- namespaces that must not move ----------------------------------------------

#: Digests computed by ucm-db before these fixes (the same files): a namespace moving here strands every block.
_GOLDEN = {
    "st": "blake3:e0c8c81516f95d3be1e7a0a13e0d911dacff7d9b32aa7cb2ea88d153c7237eb6",
    "bin": "blake3:b9a74848037ce00f09ff5398057c69cfe6a1a1d23a4e94fca5a4b14eaf23a210",
    "sharded": "blake3:778fa8b30de3a0c2a222d6e27afc4dca35daa59216fccc009dbef0d4802d29f3",
    "adapter": "blake3:0c3ae8edcb69aa9318fb9cefde01c7e8f560419bdb7696fa2fa99f0f0c9876e3",
    "adapter_bin": "blake3:1de31ab93718c166633b4df824e98b279a0850e7a170b882b5b84bdbc0ef0ef3",
}


def test_plain_checkpoints_and_adapters_keep_their_identity(tmp_path: Path) -> None:
    cfg = '{"model_type": "llama"}'
    models = {
        "st": {"config.json": cfg, "model.safetensors": b"s" * 4096, "tokenizer.json": "{}",
               "generation_config.json": "{}", "README.md": "x"},
        "bin": {"config.json": cfg, "pytorch_model.bin": b"b" * 4096, "training_args.bin": b"t",
                "np/weight_names.json": '["a"]', "np/a": b"arr"},
        "sharded": {"config.json": cfg, "model-00001-of-00002.safetensors": b"1" * 4096,
                    "model-00002-of-00002.safetensors": b"2" * 4096, "model.safetensors.index.json": "{}",
                    "pytorch_model.bin": b"b" * 64, "original/consolidated.00.pth": b"o"},
    }
    for name, files in models.items():
        assert _identity(_write(tmp_path / name, files)) == _GOLDEN[name], name
    adapters = {"adapter": {"adapter_config.json": '{"r": 8}', "adapter_model.safetensors": b"l" * 512, "README.md": "x",
                            "tokenizer_config.json": "{}", "training_args.bin": b"t"},
                "adapter_bin": {"adapter_config.json": '{"r": 8}', "adapter_model.bin": b"l" * 512}}
    for lora_id, (name, files) in enumerate(adapters.items(), start=1):
        assert adapter_key(LoRARequest(name, lora_id, str(_write(tmp_path / name, files)))) == _GOLDEN[name], name
