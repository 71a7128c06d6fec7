"""A LoRA adapter is keyed by exactly the files vLLM loads it from:
``adapter_config.json`` and the first of ``adapter_model.safetensors``,
``adapter_model.bin``, ``adapter_model.pt`` that exists
(``vllm/lora/lora_model.py`` ``from_local_checkpoint``,
``vllm/lora/peft_helper.py``; ``connector/weight_files.py``).

Before, the adapter's folder was read like a model's: the first weight
*kind* present won, so any ``*.safetensors`` beside ``adapter_model.bin``
(an older PEFT's ``new_embeddings.safetensors``) hid the weights vLLM
computes with, and two different adapters got one key (the audit's
``lora_bin_beside_safetensors.py``). Real files and vLLM's request objects;
no engine.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")

from vllm.lora.request import LoRARequest  # noqa: E402

from ucm_db.connector.fingerprints import adapter_key  # noqa: E402
from ucm_db.connector.weight_files import selected_files  # noqa: E402

from test_identity_inputs import own_caches  # noqa: E402,F401 - autouse: each test its own fingerprint cache


def _adapter(path: Path, files: dict[str, bytes]) -> Path:
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16, "target_modules": ["k_proj"]}')
    for name, data in files.items():
        (path / name).write_bytes(data)
    return path


def _key(path: Path, lora_id: int) -> str:
    return adapter_key(LoRARequest(path.name, lora_id, str(path)))


def test_adapter_model_bin_is_keyed_beside_another_safetensors_file(tmp_path: Path) -> None:
    stray = {"new_embeddings.safetensors": b"x" * 64}  # the same in both: vLLM 0.32 never reads it
    a = _adapter(tmp_path / "a", {**stray, "adapter_model.bin": b"1" * 512})
    b = _adapter(tmp_path / "b", {**stray, "adapter_model.bin": b"2" * 512})
    assert _key(a, 1) != _key(b, 2)
    assert sorted(selected_files(a, adapter=True)) == ["adapter_config.json", "adapter_model.bin"]


def test_adapter_model_bin_wins_over_a_pt_file_beside_it(tmp_path: Path) -> None:
    a = _adapter(tmp_path / "a", {"adapter_model.bin": b"1" * 512, "adapter_model.pt": b"p" * 512})
    b = _adapter(tmp_path / "b", {"adapter_model.bin": b"2" * 512, "adapter_model.pt": b"p" * 512})
    assert _key(a, 1) != _key(b, 2)


@pytest.mark.parametrize("loaded, ignored", [("adapter_model.safetensors", "adapter_model.bin"),
                                             ("adapter_model.safetensors", "adapter_model.pt"),
                                             ("adapter_model.bin", "adapter_model.pt"),
                                             ("adapter_model.pt", "other.safetensors"),
                                             ("adapter_model.pt", "stray.bin")])
def test_only_the_file_vllm_loads_counts(tmp_path: Path, loaded: str, ignored: str) -> None:
    adapter = _adapter(tmp_path / "a", {loaded: b"w" * 512, ignored: b"1" * 512})
    first = _key(adapter, 1)
    (adapter / ignored).write_bytes(b"2" * 512)  # a file vLLM does not read: the same KV
    assert _key(adapter, 2) == first
    (adapter / loaded).write_bytes(b"v" * 512)  # the weights it computes with
    assert _key(adapter, 3) != first
    (adapter / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 32}')  # another scaling
    assert _key(adapter, 4) not in (first,)


def test_an_adapter_without_weights_is_keyed_by_its_config(tmp_path: Path) -> None:
    """vLLM refuses to load it ("doesn't contain tensors"); a key for the
    config alone never meets one with weights."""
    empty = _adapter(tmp_path / "a", {"notes.safetensors": b"n" * 64})
    assert sorted(selected_files(empty, adapter=True)) == ["adapter_config.json"]
