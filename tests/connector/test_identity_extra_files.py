"""Files vLLM's model classes read beside the weight iterator reach the
namespace where they change a stored block's KV
(``connector/weight_files.py``, ``connector/draft_files.py``).

* jina-embeddings-v5 merges a task's LoRA adapter (``adapters/<task>/``,
  two levels down) into its weights at load. Its Qwen3 backbone is causal
  with LAST pooling: vLLM caches its prefixes and runs the KV connector
  around the pooling step (``gpu_model_runner.execute_model``), so ucm-db
  stores its KV. The adapters were not hashed: a retrained adapter kept
  the namespace. They are now keyed.
* A draft of another vocabulary (``use_heterogeneous_vocab``) reads the
  target's tokens mapped through both tokenizers: either tokenizer changed
  the draft's KV under one namespace. Both are now keyed.
* DFlash's ``mask_embedding.pt`` changes only its query slots, never a
  stored block: judged, with the vLLM source lines the verdict rests on.
* A tripwire judges every such read in vLLM's model classes and
  speculative decoding, and fails on a new one.

Real files and vLLM's own configs; no engine.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

import vllm  # noqa: E402
from vllm.config import LoadConfig  # noqa: E402

from ucm_db.connector.drafts import draft_shape, stored_view  # noqa: E402
from ucm_db.connector.weight_files import selected_files  # noqa: E402
from ucm_db.connector.weight_loads import watched_files  # noqa: E402

from tests.connector.test_draft_layers import TARGET, _attention, _kv_config, _model, _vllm  # noqa: E402
from tests.connector.test_identity_inputs import _namespace_of, _vllm_config, own_caches  # noqa: E402,F401

VLLM = Path(vllm.__file__).parent


def _write(path: Path, files: dict[str, bytes | str]) -> Path:
    for name, data in files.items():
        file = path / name
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_bytes(data if isinstance(data, bytes) else data.encode())
    return path


# -- jina-embeddings-v5's task adapters ------------------------------------------


def _jina(path: Path) -> Path:
    """A jina-embeddings-v5-text-small as vLLM reads it: a Qwen3 config
    naming ``JinaEmbeddingsV5Model``, its weights, and task adapters."""
    from safetensors.torch import save_file
    from transformers import Qwen3Config

    Qwen3Config(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                head_dim=64, vocab_size=1000, max_position_embeddings=512,
                architectures=["JinaEmbeddingsV5Model"]).save_pretrained(path)
    save_file({"lm_head.weight": torch.zeros(4, 4)}, str(path / "model.safetensors"))
    adapter = '{"r": 8, "lora_alpha": 16}'
    return _write(path / "adapters", {"retrieval/adapter_config.json": adapter,
                                      "retrieval/adapter_model.safetensors": b"R" * 512,
                                      "text-matching/adapter_config.json": adapter,
                                      "text-matching/adapter_model.safetensors": b"T" * 512}).parent


def test_a_jina_v5_task_adapter_merged_at_load_is_keyed(tmp_path: Path) -> None:
    model = _jina(tmp_path / "jina")
    config = _vllm_config(model)
    assert config.model_config.runner_type == "pooling" and config.model_config.is_prefix_caching_supported
    first = _namespace_of(config)
    (model / "adapters" / "retrieval" / "adapter_model.safetensors").write_bytes(b"S" * 512)  # retrained in place
    retrained = _namespace_of(_vllm_config(model))
    assert retrained.id != first.id
    (model / "adapters" / "retrieval" / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 32}')  # its scaling
    assert _namespace_of(_vllm_config(model)).id != retrained.id
    # The load's snapshot (weight_loads.py) watches them too.
    watched = watched_files(config.model_config, LoadConfig())[str(model)]
    assert {"adapters/retrieval/adapter_model.safetensors", "adapters/text-matching/adapter_config.json"} <= set(watched)


def test_vllm_runs_the_kv_connector_around_a_pooling_step() -> None:
    """Why a pooling model's KV is ucm-db's to key: vLLM's model runner
    returns the pooler's output inside the block that saves KV
    (``maybe_get_kv_connector_output``); a tripwire on that order."""
    source = (VLLM / "v1" / "worker" / "gpu_model_runner.py").read_text()
    step = source[source.index("self.maybe_get_kv_connector_output("):]
    assert step.index("return self._pool(") < step.index("def ")


# -- a draft of another vocabulary ---------------------------------------------


def test_a_draft_of_another_vocabulary_is_keyed_by_both_tokenizers(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    target = _write(tmp_path / "target", {"tokenizer.json": '{"v": ["a", "b"]}', "config.json": "{}"})
    draft = _write(tmp_path / "draft", {"tokenizer.json": '{"v": ["a", "b"]}', "tokenizer_config.json": "{}"})
    layers = _kv_config({**TARGET, "draft_model.model.layers.0.self_attn.attn": _attention()})

    def inputs() -> dict[str, Any] | None:
        vllm = _vllm("draft_model", use_heterogeneous_vocab=True, draft_model_config=_model(model=str(draft)),
                     target_model_config=SimpleNamespace(tokenizer=str(target)))
        return draft_shape(vllm, stored_view(vllm, layers), lambda *_: "blake3:d1")[1]

    first = inputs()
    (draft / "tokenizer.json").write_text('{"v": ["b", "a"]}')  # the draft's ids for the same target tokens move
    drafts_moved = inputs()
    assert drafts_moved != first
    (target / "tokenizer.json").write_text('{"v": ["b", "a"]}')
    assert inputs() != drafts_moved
    # One ucm-db cannot find (vLLM found it, in a cache ucm-db does not read): by its name, with a warning.
    vllm = _vllm("draft_model", use_heterogeneous_vocab=True, draft_model_config=_model(model="org/absent"),
                 target_model_config=SimpleNamespace(tokenizer=str(target)))
    with caplog.at_level(logging.WARNING):
        named = draft_shape(vllm, stored_view(vllm, layers), lambda *_: "blake3:d1")[1]
    assert named is not None and named["files"]["vocabularies"][1] == "name:org/absent"
    assert any("draft's tokenizer" in r.getMessage() for r in caplog.records)


# -- every file a model class reads beside its weights, judged ----------------

#: Modules of vLLM's model classes and speculative decoding that read files apart from the weight iterator, each
#: judged: ``keyed`` with the files (relative to the model) ucm-db's selection holds, else why no stored KV moves.
EXTRA_READS: dict[str, tuple[str, tuple[str, ...]]] = {
    "jina.py": ("keyed: a task's LoRA adapter, merged into the weights", (
        "adapters/retrieval/adapter_config.json", "adapters/retrieval/adapter_model.safetensors")),
    "mimo_audio.py": ("keyed: the audio tokenizer (a subfolder: its embeddings)", (
        "audio_tokenizer/config.json", "audio_tokenizer/model.safetensors")),
    "nemotron_vl.py": ("keyed: image tiling (top-level JSON)", ("processor_config.json",)),
    "llava_onevision2.py": ("keyed: video codec defaults (top-level JSON)", ("preprocessor_config.json",)),
    "moss_audio.py": ("keyed: audio processing defaults (top-level JSON)",
                      ("processor_config.json", "preprocessor_config.json")),
    "adapters.py": ("no: a Sentence-Transformers dense projector, a pooling head after the last layer (keyed anyway: "
                    "a subfolder's weights)", ("2_Dense/model.safetensors",)),
    "qwen3_dflash.py": ("no: DFlash's mask_embedding.pt embeds its query slots, whose KV lies past the accepted "
                        "tokens and is overwritten by the context KV before vLLM counts them computed", ()),
}
_READS = re.compile(r"\b(get_hf_file_bytes|get_hf_file_to_dict|hf_hub_download|snapshot_download|torch\.load|np\.load"
                    r"|load_file|safe_open|safetensors_load)\(")


def test_every_file_a_vllm_model_class_reads_beside_its_weights_is_judged() -> None:
    """Tripwire: a new such read fails here, naming its module, until it is
    judged (keyed by ``weight_files``, or shown not to change a stored block)."""
    found = set()
    for folder in (VLLM / "model_executor" / "models", VLLM / "v1" / "spec_decode", VLLM / "v1" / "worker" / "gpu" / "spec_decode"):
        found |= {file.name for file in folder.rglob("*.py") if _READS.search(file.read_text(errors="replace"))}
    assert found == set(EXTRA_READS), f"judge: {sorted(found - set(EXTRA_READS))}; gone: {sorted(set(EXTRA_READS) - found)}"


def test_the_files_judged_keyed_are_in_a_models_selection(tmp_path: Path) -> None:
    names = {name for _, files in EXTRA_READS.values() for name in files}
    model = _write(tmp_path / "m", {"config.json": "{}", "model.safetensors": b"w", **{name: b"x" for name in names}})
    assert names <= set(selected_files(model, subfolders=True))


def test_dflash_mask_embedding_never_reaches_a_stored_block() -> None:
    """The lines the DFlash verdict rests on: the mask embedding enters only
    the query slots' embeddings; the context K/V (what a full block of
    computed tokens holds) is projected from the target's hidden states;
    query slots start past the last accepted token."""
    model = (VLLM / "model_executor" / "models" / "qwen3_dflash.py").read_text()
    lines = [line.strip() for line in model.splitlines()]
    uses = [line for line in lines if "self.mask_embedding" in line and not line.startswith("self.mask_embedding =")]
    assert uses == ["embeds = torch.where(is_mask, self.mask_embedding.to(embeds.dtype), embeds)"], uses
    assert "all_k, all_v = self._project_context_kv(context_states" in model
    kernel = (VLLM / "v1" / "spec_decode" / "utils.py").read_text()
    assert "query_pos = last_pos + 1 + query_off" in kernel
    runner = (VLLM / "v1" / "worker" / "gpu_model_runner.py").read_text()
    assert "(wait_for_save + clear metadata) until after draft model runs" in runner
