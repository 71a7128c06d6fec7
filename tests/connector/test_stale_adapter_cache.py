"""An adapter updated and reloaded (in place, or under a new id) while vLLM's
own prefix cache still holds blocks its old files computed: vLLM hashes an
adapter by name and path (kv_cache_utils._gen_lora_extra_hash_keys), so a new
request is served that old KV from vLLM's cache. ucm-db keys the request by
the new files' digest and used to save those blocks (and every block computed
over them) under it: the old adapter's KV in the shared store under the new
adapter's key, loaded by every engine serving the new one. Such a request now
saves nothing; one that vLLM's cache did not serve saves as before."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")

from vllm.lora.request import LoRARequest  # noqa: E402

from tests.connector.test_scheduler_worker import BS, _admit, _new_step, _request, _shape  # noqa: E402
from ucm_db.connector import fingerprints  # noqa: E402
from ucm_db.connector.identity import namespace  # noqa: E402
from ucm_db.connector.scheduler.hooks import UcmDbScheduler  # noqa: E402
from ucm_db.connector.settings import ConnectorSettings  # noqa: E402

TOKENS = list(range(1, 4 * BS + 1))


@pytest.fixture(autouse=True)
def own_adapter_records(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    for name, value in (("_memo", {}), ("_warned", set()), ("_adapters", {}), ("_adapter_ids", {}), ("_resettled", set()),
                        ("_named", {}), ("_renamed", set())):
        monkeypatch.setattr(fingerprints, name, value)


def _saved_blocks(sched: UcmDbScheduler, req_id: str, lora: LoRARequest, vllm_hit_tokens: int) -> list[int]:
    """Block indices of the request's keys the step saves (vLLM's own cache
    served ``vllm_hit_tokens``), keyed by the adapter's current files."""
    req = _request(req_id, list(TOKENS), lora_request=lora)
    _admit(sched, req, vllm_hit_tokens)
    meta = sched.build_connector_meta(_new_step(req, [7, 8, 9, 10], len(TOKENS) - vllm_hit_tokens))
    digest = "blake3:" + fingerprints.fingerprint(lora.lora_path).digest
    keys = namespace(_shape()).block_keys(TOKENS, {"lora": digest})
    return [keys.index(k) for save in meta.saves for k in save.keys]


@pytest.mark.parametrize("reload", ["in_place", "new_id"])
def test_a_reloaded_adapter_saves_nothing_over_vllms_own_cache_hit(tmp_path: Path, reload: str) -> None:
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}')
    (adapter / "adapter_model.safetensors").write_bytes(b"OLD-WEIGHTS" * 100)
    sched = UcmDbScheduler(ConnectorSettings.from_extra_config({"path": str(tmp_path / "s")}), _shape())
    try:
        # Before any reload a hit from vLLM's cache is this adapter's own KV: saved with the rest.
        assert _saved_blocks(sched, "old", LoRARequest("tuned", 1, str(adapter)), 3 * BS) == [0, 1, 2, 3]
        (adapter / "adapter_model.safetensors").write_bytes(b"NEW-WEIGHTS" * 101)  # retrained, saved in place
        new = LoRARequest("tuned", 1, str(adapter), load_inplace=True) if reload == "in_place" else LoRARequest("tuned", 2, str(adapter))
        assert _saved_blocks(sched, "new-over-cache", new, 3 * BS) == [], "the old adapter's KV was saved under the new key"
        # Computed whole with the new files: saved as before.
        assert _saved_blocks(sched, "new-cold", new, 0) == [0, 1, 2, 3]
        # Another adapter, never reloaded, is untouched.
        other = tmp_path / "other"
        other.mkdir()
        (other / "adapter_model.safetensors").write_bytes(b"OTHER" * 100)
        assert _saved_blocks(sched, "other", LoRARequest("other", 3, str(other)), 2 * BS) == [0, 1, 2, 3]
    finally:
        sched.shutdown()


def test_an_adapter_name_loaded_from_another_path_saves_nothing_with_multimodal_items(tmp_path: Path) -> None:
    """vLLM's encoder cache keys a tower adapter by its name alone: a name
    loaded from another path with other files (a new id) may be served the
    old adapter's image embeddings; the KV computed over them was saved
    under the new files' key. Text requests of it save as before (vLLM's
    prefix cache keys name and path)."""
    from ucm_db.connector.request_keys import request_extras
    from ucm_db.connector.scheduler.request_state import RequestState
    from ucm_db.connector.scheduler.served_controls import refuse_saves_over_stale_caches

    first, second = tmp_path / "v1", tmp_path / "v2"
    for path, weights in ((first, b"V1" * 100), (second, b"V2" * 101)):
        path.mkdir()
        (path / "adapter_model.safetensors").write_bytes(weights)
    request_extras(_request("old", list(TOKENS), lora_request=LoRARequest("tower", 1, str(first))))
    new = _request("new", list(TOKENS), lora_request=LoRARequest("tower", 2, str(second)))
    extras = request_extras(new)
    assert not fingerprints.adapter_resettled(new.lora_request)  # another path: vLLM's prefix cache tells them apart
    for mm_items, saves in ((0, True), (1, False)):
        state = RequestState(new, extras, {}, 0, mm_items=mm_items)
        refuse_saves_over_stale_caches(state, 0)
        assert state.controls.save is saves, f"{mm_items} multimodal items"
