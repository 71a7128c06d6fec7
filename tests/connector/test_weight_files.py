"""Which files name a model: weights vLLM loads from subfolders (Cosmos3's
``transformer/``, Kimi-Audio's ``whisper-large-v3/``) and the kind a load
format names (``pt`` loads ``*.pt`` beside ``.safetensors``) reach the
model's identity; ``original/`` under vLLM's default ignore patterns and an
adapter's training checkpoints do not (``connector/weight_files.py``).

Real files and vLLM's own ``LoadConfig``; no engine. Each test has its own
fingerprint cache.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm.config import LoadConfig  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402

from ucm_db.connector.fingerprints import adapter_key, fingerprint, model_fingerprint  # noqa: E402

from test_identity_inputs import own_caches  # noqa: E402,F401 - autouse: each test its own fingerprint cache


def _model(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"model_type": "cosmos3"}')
    (path / "model.safetensors").write_bytes(b"w" * 4096)
    return path


def _identity(path: Path, load_config: LoadConfig | None = None) -> str:
    return model_fingerprint(SimpleNamespace(model=str(path), revision=None), load_config=load_config or LoadConfig())


def test_weights_in_a_subfolder_are_part_of_the_models_identity(tmp_path: Path) -> None:
    model = _model(tmp_path / "m")
    top_only = _identity(model)
    assert top_only == "blake3:" + fingerprint(model).digest  # a model without subfolders keeps its namespace
    (model / "transformer").mkdir()
    (model / "transformer" / "diffusion_pytorch_model.safetensors").write_bytes(b"a" * 4096)
    (model / "transformer" / "config.json").write_text('{"layers": 2}')
    with_transformer = _identity(model)
    assert with_transformer != top_only
    (model / "transformer" / "diffusion_pytorch_model.safetensors").write_bytes(b"b" * 4096)  # fine-tuned in place
    assert _identity(model) != with_transformer
    retrained = _identity(model)
    (model / "transformer" / "config.json").write_text('{"layers": 3}')
    assert _identity(model) != retrained


def test_original_export_and_hidden_folders_are_left_out_as_vllm_leaves_them(tmp_path: Path) -> None:
    model = _model(tmp_path / "m")
    base = _identity(model)
    (model / "original").mkdir()
    (model / "original" / "consolidated.00.pth").write_bytes(b"c" * 4096)  # Meta's copy: vLLM never loads it
    (model / ".cache").mkdir()
    (model / ".cache" / "model.safetensors").write_bytes(b"d" * 4096)
    (model / "metal").mkdir()  # gpt-oss ships its weights for Apple's Metal beside vLLM's
    (model / "metal" / "model.bin").write_bytes(b"e" * 4096)
    assert _identity(model) == base
    # Told to ignore nothing, vLLM may fetch original/: it is keyed then.
    assert _identity(model, LoadConfig(ignore_patterns=[])) != base


def test_load_format_pt_keys_the_pt_files_it_loads_beside_safetensors(tmp_path: Path) -> None:
    model = _model(tmp_path / "m")
    (model / "model.pt").write_bytes(b"p" * 4096)
    as_pt = _identity(model, LoadConfig(load_format="pt"))
    auto = _identity(model)
    (model / "model.pt").write_bytes(b"q" * 4096)
    assert _identity(model, LoadConfig(load_format="pt")) != as_pt  # what vLLM loads changed
    assert _identity(model) == auto  # auto loads the .safetensors, unchanged


def test_load_format_npcache_keys_the_bin_files_it_loads(tmp_path: Path) -> None:
    model = _model(tmp_path / "m")
    (model / "pytorch_model.bin").write_bytes(b"p" * 4096)
    before = _identity(model, LoadConfig(load_format="npcache"))
    (model / "pytorch_model.bin").write_bytes(b"q" * 4096)
    assert _identity(model, LoadConfig(load_format="npcache")) != before


def test_an_adapters_training_checkpoints_are_not_the_adapter(tmp_path: Path) -> None:
    adapter = tmp_path / "lora"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 8}')
    (adapter / "adapter_model.safetensors").write_bytes(b"l" * 4096)
    key = adapter_key(LoRARequest("a", 1, str(adapter)))
    (adapter / "checkpoint-500").mkdir()
    (adapter / "checkpoint-500" / "adapter_model.safetensors").write_bytes(b"m" * 4096)
    assert adapter_key(LoRARequest("a", 1, str(adapter))) == key


def test_a_hub_adapter_is_keyed_by_its_cached_snapshot_only_where_the_hub_is_offline(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Offline, vLLM loads a hub adapter from the cache's snapshot at main:
    its files key it, so an adapter updated there (main moved, loaded under a
    new id) gets a new key. Online, vLLM's worker downloads main after the
    scheduler keyed the request: the cached snapshot may be the old one, so
    the name and path key it (warned), as before."""
    hub = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.delenv("VLLM_USE_MODELSCOPE", raising=False)
    repo = hub / "models--org--adapter"
    for commit, weights in (("a" * 40, b"1" * 512), ("b" * 40, b"2" * 512)):
        snapshot = repo / "snapshots" / commit
        snapshot.mkdir(parents=True)
        (snapshot / "adapter_config.json").write_text('{"r": 8}')
        (snapshot / "adapter_model.safetensors").write_bytes(weights)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    assert adapter_key(LoRARequest("ad", 1, "org/adapter")).startswith("unhashed:")  # online: the old snapshot may go
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    first = adapter_key(LoRARequest("ad", 1, "org/adapter"))
    assert first == "blake3:" + fingerprint(repo / "snapshots" / ("a" * 40)).digest
    (repo / "refs" / "main").write_text("b" * 40)  # updated in the cache
    assert adapter_key(LoRARequest("ad", 1, "org/adapter")).startswith("unsettled:")  # vLLM may still run the old one
    assert adapter_key(LoRARequest("ad", 2, "org/adapter")) == "blake3:" + fingerprint(repo / "snapshots" / ("b" * 40)).digest
