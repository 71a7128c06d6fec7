"""A stored draft's weights are keyed however vLLM loads them
(``connector/draft_files.py``, ``connector/drafts.py``).

A draft with its own ``draft_load_config`` was keyed by its load format's
name and a digest of ``model_loader_extra_config``: a draft serialized with
tensorizer and serialized again at the same URI (other weights) kept its
namespace, so its stored draft layers were served to the new draft. Now a
draft's weights read from elsewhere are keyed as a target's are (a local
file by content) or the start is refused (a remote URI, another process,
an unknown loader). Drafts loaded from their files keep their namespaces.

vLLM's own LoadConfig; the rest of the config as the drafts module reads it
(``test_draft_layers.py``'s stand-ins).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.config import LoadConfig  # noqa: E402

from ucm_db.connector.drafts import draft_load_config, draft_shape, stored_view  # noqa: E402
from ucm_db.errors import ConfigError  # noqa: E402

from tests.connector.test_draft_layers import TARGET, _attention, _kv_config, _vllm  # noqa: E402

EAGLE = {**TARGET, "model.layers.2.self_attn.attn": _attention()}


def _by_files(config: Any, _dir: object, _load: object) -> str:
    return "blake3:d1"  # the draft directory's files (configs only, for a serialized draft)


def _draft(draft_load: Any, method: str = "eagle", model_id: str | None = None, **spec: Any) -> dict[str, Any] | None:
    vllm = _vllm(method, draft_load_config=draft_load, **spec)
    vllm.load_config = LoadConfig()
    vllm.parallel_config.tensor_parallel_size = 1
    vllm.model_config.model = "/target"
    return draft_shape(vllm, stored_view(vllm, _kv_config(EAGLE)), _by_files, model_id)[1]


def _tensorizer(uri: str) -> LoadConfig:
    return LoadConfig(load_format="tensorizer", model_loader_extra_config={"tensorizer_uri": uri})


def test_a_draft_serialized_with_tensorizer_is_keyed_by_the_file_it_loads(tmp_path: Path) -> None:
    uri = tmp_path / "draft.tensors"
    uri.write_bytes(b"A" * 4096)
    first = _draft(_tensorizer(str(uri)))
    uri.write_bytes(b"B" * 4096)  # serialized again at the same URI: other draft weights, other draft KV
    again = _draft(_tensorizer(str(uri)))
    assert again != first
    assert again is not None and again["files"]["tensorizer_files"][0].startswith("blake3:")


@pytest.mark.parametrize("load", [
    LoadConfig(load_format="tensorizer", model_loader_extra_config={"tensorizer_uri": "s3://bucket/draft.tensors"}),
    LoadConfig(load_format="modelexpress"),
    LoadConfig(load_format="ipc_cache"),
])
def test_a_draft_whose_weights_ucm_db_cannot_read_stops_the_start(load: LoadConfig) -> None:
    with pytest.raises(ConfigError, match="speculative draft") as refused:
        _draft(load)
    assert "local files" in (refused.value.hint or "")
    with pytest.raises(ConfigError):  # the connector's model_id names the target's weights, not the draft's
        _draft(load, model_id="llama-2024-06")


def test_drafts_loaded_from_their_files_keep_their_namespaces() -> None:
    as_before = {"method": "eagle", "layers": 1, "model": "blake3:d1", "dtype": "bfloat16"}
    assert _draft(None) == as_before
    assert _draft(LoadConfig(load_format="safetensors")) == {**as_before, "load": {"load_format": "safetensors"}}
    assert _draft(LoadConfig(load_format="dummy"))["load"]["load_format"] == "dummy"  # type: ignore[index]


def test_an_mtp_draft_streamed_with_the_targets_checkpoint_is_named_by_model_id() -> None:
    """vLLM's MTP draft reads the target's ``model_weights`` (speculative.py):
    the connector's ``model_id`` names those weights for both."""
    streamed = LoadConfig(load_format="runai_streamer")
    draft = SimpleNamespace(dtype="torch.bfloat16", quantization=None, get_total_num_kv_heads=lambda: 2,
                            get_head_size=lambda: 64, hf_config=SimpleNamespace(), model="/cache/llama",
                            model_weights="s3://bucket/llama")

    def shape(model_id: str | None) -> dict[str, Any] | None:
        vllm = _vllm("mtp", draft_model_config=draft)
        vllm.load_config = streamed
        vllm.parallel_config.tensor_parallel_size = 1
        vllm.model_config.model, vllm.model_config.model_weights = "/cache/llama", "s3://bucket/llama"
        return draft_shape(vllm, stored_view(vllm, _kv_config(EAGLE)), _by_files, model_id)[1]

    assert shape("llama-2024-06") is not None
    with pytest.raises(ConfigError, match="s3://bucket/llama"):
        shape(None)


def test_a_drafter_of_a_target_served_by_the_weight_cache_daemon_is_loaded_as_vllm_loads_it() -> None:
    """vLLM's ``get_draft_load_config``: with the target's weights from the
    ``ipc_cache`` daemon, a drafter it serves as a draft group comes from the
    daemon (refused), one it does not from disk (keyed by its files)."""
    daemon = LoadConfig(load_format="ipc_cache", model_loader_extra_config={"socket": "/run/w"})
    for method, vllm_loads in (("medusa", "auto"), ("eagle", "ipc_cache"), ("draft_model", "ipc_cache")):
        vllm = _vllm(method, draft_load_config=None)
        vllm.load_config = daemon
        assert draft_load_config(vllm).load_format == vllm_loads, method
    vllm = _vllm("eagle", draft_load_config=None)  # the daemon's draft group: weights of another process
    vllm.load_config, vllm.parallel_config.tensor_parallel_size, vllm.model_config.model = daemon, 1, "/target"
    with pytest.raises(ConfigError, match="ipc_cache"):
        draft_shape(vllm, stored_view(vllm, _kv_config(EAGLE)), _by_files, "llama-2024-06")
