"""Remote code a config names from another repo or revision is keyed by its
content (connector/remote_code.py): a branch that moves on, a helper module
it imports, code not in the cache. Real vLLM configs of a tiny local model
and a Hugging Face cache laid out on disk as huggingface_hub lays it out."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from tests.connector.test_identity_inputs import _namespace_of, _vllm_config, model_dir  # noqa: E402,F401
from ucm_db.connector.identity import namespace_inputs  # noqa: E402
from ucm_db.connector.remote_code import remote_code_inputs  # noqa: E402


def _cache_snapshot(cache: Path, repo: str, ref: str, commit: str, files: dict[str, str]) -> Path:
    """``files`` as the snapshot ``commit`` of ``repo``, with ``ref`` pointing at it."""
    root = cache / ("models--" + repo.replace("/", "--"))
    snapshot = root / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (snapshot / name).write_text(text)
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def remote_model(model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The tiny model whose config class lives in another repo (``org/code``)."""
    model = tmp_path / "model"
    shutil.copytree(model_dir, model)
    config = json.loads((model / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "org/code--configuration_tiny.TinyConfig"}
    (model / "config.json").write_text(json.dumps(config))
    _use_cache(monkeypatch, tmp_path / "hub")
    return model


def _use_cache(monkeypatch: pytest.MonkeyPatch, hub: Path) -> None:
    """The Hugging Face cache that huggingface_hub (so transformers) reads."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))


def _config(model: Path, trust: bool = True) -> object:
    config = _vllm_config(model)
    config.model_config.trust_remote_code = trust
    return config


def _inputs(model: Path, trust: bool = True) -> str:
    return namespace_inputs(_config(model, trust))


def test_code_from_another_repo_is_keyed_by_the_content_main_points_at(remote_model: Path, tmp_path: Path) -> None:
    hub = tmp_path / "hub"
    code = {"configuration_tiny.py": "from .helpers import ROPE\n", "helpers.py": "ROPE = 1\n"}
    _cache_snapshot(hub, "org/code", "main", "a" * 40, code)
    first, first_ns = _inputs(remote_model), _namespace_of(_config(remote_model)).digest
    assert '"remote_code":{"org/code@main":"blake2b:' in first
    assert _inputs(remote_model) == first
    _cache_snapshot(hub, "org/code", "main", "b" * 40, code)  # main moved to a commit of the same files
    assert _inputs(remote_model) == first
    _cache_snapshot(hub, "org/code", "main", "b" * 40, {**code, "tokenization_tiny.py": "T = 1\n"})  # a file nothing imports
    assert _inputs(remote_model) == first
    _cache_snapshot(hub, "org/code", "main", "c" * 40, {**code, "helpers.py": "ROPE = 2\n"})  # the imported helper changed
    assert _inputs(remote_model) != first and _namespace_of(_config(remote_model)).digest != first_ns
    dangling = _cache_snapshot(hub, "org/code", "main", "d" * 40, {"configuration_tiny.py": code["configuration_tiny.py"]})
    (dangling / "helpers.py").symlink_to(tmp_path / "no-such-blob")  # an interrupted download: no crash
    assert '"remote_code":{"org/code@main":"blake2b:' in _inputs(remote_model)


def test_without_trust_remote_code_or_a_reference_nothing_is_added(remote_model: Path, model_dir: Path, tmp_path: Path) -> None:
    _cache_snapshot(tmp_path / "hub", "org/code", "main", "a" * 40, {"configuration_tiny.py": "X = 1\n"})
    assert '"remote_code"' not in _inputs(remote_model, trust=False)
    assert '"remote_code"' not in _inputs(model_dir)  # trusted, but its config names no code


def test_code_another_repo_gives_an_hf_config_path_is_keyed(model_dir: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    _use_cache(monkeypatch, tmp_path / "hub")
    _cache_snapshot(tmp_path / "hub", "org/code", "main", "a" * 40, {"configuration_tiny.py": "X = 1\n"})
    folder = tmp_path / "cfg"
    folder.mkdir()
    config = json.loads((model_dir / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoConfig": "org/code--configuration_tiny.C"}}))
    vllm_config = _config(model_dir)
    vllm_config.model_config.hf_config_path = str(folder)
    first = namespace_inputs(vllm_config)
    assert '"remote_code":{"org/code@main":"blake2b:' in first
    _cache_snapshot(tmp_path / "hub", "org/code", "main", "b" * 40, {"configuration_tiny.py": "X = 2\n"})
    assert namespace_inputs(vllm_config) != first


def test_code_not_in_the_cache_is_keyed_by_its_name_with_a_warning(remote_model: Path, caplog: pytest.LogCaptureFixture,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from ucm_db.connector import remote_code

    monkeypatch.setattr(remote_code, "_warned", set())  # logged once a process: this test's own first time
    with caplog.at_level(logging.WARNING):
        inputs = _inputs(remote_model)
    assert '"remote_code":{"org/code@main":"unresolved"}' in inputs
    assert "org/code" in caplog.text and "pin code_revision to a commit" in caplog.text


def test_a_hub_models_own_code_at_another_code_revision_is_keyed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The weights at main, the config's own classes fetched at ``code_revision``
    (a tag that can be moved): keyed by the content at that tag. The model
    config is a stand-in holding the fields read (a hub model is not
    downloadable here)."""
    hub = tmp_path / "hub"
    _use_cache(monkeypatch, hub)
    config = json.dumps({"model_type": "llama", "auto_map": {"AutoConfig": "configuration_tiny.TinyConfig",
                                                              "AutoTokenizer": ["other--tokenization_x.T", None]}})
    _cache_snapshot(hub, "org/model", "main", "1" * 40, {"config.json": config, "configuration_tiny.py": "X = 1\n"})
    _cache_snapshot(hub, "org/model", "v2", "2" * 40, {"config.json": config, "configuration_tiny.py": "X = 2\n"})
    model_config = SimpleNamespace(model="org/model", revision=None, code_revision="v2", trust_remote_code=True, hf_config_path=None)
    at_v2 = remote_code_inputs(model_config)
    assert list(at_v2["remote_code"]) == ["org/model@v2"]  # a tokenizer's code changes no KV: not keyed
    _cache_snapshot(hub, "org/model", "v2", "3" * 40, {"config.json": config, "configuration_tiny.py": "X = 3\n"})  # the tag moved
    assert remote_code_inputs(model_config) != at_v2
    model_config.code_revision = None  # the code comes with the weights' snapshot, which the model fingerprint keys
    assert remote_code_inputs(model_config) == {}


def test_a_module_in_a_subfolder_and_its_imports_beside_it_are_keyed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hub = tmp_path / "hub"
    _use_cache(monkeypatch, hub)
    folder = tmp_path / "cfg"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"auto_map": {"AutoModelForCausalLM": "org/code--sub/modeling_x.X"}}))
    model_config = SimpleNamespace(model=str(folder), revision=None, code_revision=None, trust_remote_code=True, hf_config_path=None)
    code = {"sub/modeling_x.py": "from .layers import Y\n", "sub/layers.py": "Y = 1\n"}
    (hub / "models--org--code" / "snapshots" / ("a" * 40) / "sub").mkdir(parents=True)
    _cache_snapshot(hub, "org/code", "main", "a" * 40, code)
    first = remote_code_inputs(model_config)
    assert first["remote_code"]["org/code@main"].startswith("blake2b:")
    (hub / "models--org--code" / "snapshots" / ("b" * 40) / "sub").mkdir(parents=True)
    _cache_snapshot(hub, "org/code", "main", "b" * 40, {**code, "sub/layers.py": "Y = 2\n"})
    assert remote_code_inputs(model_config) != first
