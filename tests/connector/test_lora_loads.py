"""What ``connector/lora_loads.py`` records of vLLM's adapter loads, and which
saves it lets through: a content key equal to the last load's (and no other),
a label key (``unhashed:``) as before, nothing for an id never seen loading or
loaded in another layout (``is_3d_lora_weight``),
nothing where the files moved between the load's start and the hash. Real
adapter files; the load itself is vLLM's elsewhere
(``test_review_lora_key_race.py`` drives it).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from ucm_db.connector import lora_loads  # noqa: E402
from ucm_db.connector.fingerprints import fingerprint  # noqa: E402

from test_identity_inputs import own_caches  # noqa: E402,F401 - autouse: each test its own fingerprint cache


def _adapter(path: Path, weights: bytes) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text('{"r": 4}')
    (path / "adapter_model.safetensors").write_bytes(weights)
    return path


@pytest.fixture(autouse=True)
def no_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lora_loads, "_loaded", {})


def test_a_save_matches_the_last_load_of_its_id_only(tmp_path: Path) -> None:
    a, b = _adapter(tmp_path / "a", b"\1" * 256), _adapter(tmp_path / "b", b"\2" * 256)
    key_a = "blake3:" + fingerprint(a, adapter=True).digest
    key_b = "blake3:" + fingerprint(b, adapter=True).digest
    assert not lora_loads.computed_with(7, key_a), "an id never seen loading let a save through"
    lora_loads.note_load(7, str(a), lora_loads._stats(str(a)))
    assert lora_loads.computed_with(7, key_a)
    assert not lora_loads.computed_with(7, key_b) and not lora_loads.computed_with(8, key_a)
    lora_loads.note_load(7, str(b), lora_loads._stats(str(b)))  # the id reloaded with other files
    assert not lora_loads.computed_with(7, key_a) and lora_loads.computed_with(7, key_b)
    assert lora_loads.computed_with(9, 'unhashed:["hub", "org/adapter"]')  # label keys: saved as before


def test_files_that_moved_during_the_load_match_no_key(tmp_path: Path) -> None:
    a = _adapter(tmp_path / "a", b"\1" * 256)
    before = lora_loads._stats(str(a))
    (a / "adapter_model.safetensors").write_bytes(b"\3" * 256)  # rewritten while vLLM read it
    os.utime(a / "adapter_model.safetensors")
    lora_loads.note_load(7, str(a), before)
    assert not lora_loads.computed_with(7, "blake3:" + fingerprint(a, adapter=True).digest)


def test_the_3d_moe_layout_is_part_of_the_key_and_of_the_load_record(tmp_path: Path) -> None:
    """``is_3d_lora_weight``: vLLM (with ``enable_mixed_moe_lora_format``) splits the same files otherwise, and the
    loaded adapter keeps the flag of the request that loaded it: both the chain's key and the load's record name it,
    so a request keyed 3D whose id vLLM loaded 2D (or the other way round) saves nothing."""
    from vllm.lora.request import LoRARequest

    from ucm_db.connector.fingerprints import adapter_key

    a = _adapter(tmp_path / "a", b"\1" * 256)
    flat, fused = (LoRARequest("a", 7, str(a), is_3d_lora_weight=flag) for flag in (False, True))
    key_flat, key_fused = adapter_key(flat), adapter_key(fused)
    assert key_flat == "blake3:" + fingerprint(a, adapter=True).digest and key_fused == key_flat + "+3d"
    lora_loads.note_load(7, str(a), lora_loads._stats(str(a)), "")
    assert lora_loads.computed_with(7, key_flat) and not lora_loads.computed_with(7, key_fused)
    lora_loads.note_load(7, str(a), lora_loads._stats(str(a)), "+3d")
    assert lora_loads.computed_with(7, key_fused) and not lora_loads.computed_with(7, key_flat)
