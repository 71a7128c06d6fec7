"""kv_connector_extra_config parsing: names, files, defaults, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ucm_db.connector.settings import ConnectorSettings, default_store_path, valid_keys
from ucm_db.errors import ConfigError


def test_store_options_and_path_are_taken_by_name(tmp_path: Path) -> None:
    s = ConnectorSettings.from_extra_config({"path": str(tmp_path), "codec": "none", "capacity_bytes": 1 << 30, "load_mode": "layer"})
    assert s.path == tmp_path
    assert dict(s.store_options) == {"codec": "none", "capacity_bytes": 1 << 30}
    assert s.load_mode == "layer"


def test_unknown_key_names_every_valid_key() -> None:
    with pytest.raises(ConfigError) as info:
        ConnectorSettings.from_extra_config({"path": "/x", "shared_storage_path": "/y"})
    message = str(info.value)
    assert "shared_storage_path" in message
    for key in ("path", "config_file", "codec", "capacity_bytes", "durability", "load_mode"):
        assert key in message


def test_invalid_store_option_is_rejected_by_the_core_parser() -> None:
    with pytest.raises(ConfigError, match="codec"):
        ConnectorSettings.from_extra_config({"codec": "lz4"})


def test_invalid_connector_option() -> None:
    with pytest.raises(ConfigError, match="load_mode"):
        ConnectorSettings.from_extra_config({"load_mode": "later"})
    with pytest.raises(ConfigError, match="max_pending_save_bytes"):
        ConnectorSettings.from_extra_config({"max_pending_save_bytes": 10})


def test_yaml_config_file_with_override(tmp_path: Path) -> None:
    file = tmp_path / "ucm.yaml"
    file.write_text(f"path: {tmp_path / 'a'}\ncodec: none\nload_mode: layer\n")
    s = ConnectorSettings.from_extra_config({"config_file": str(file), "codec": "zstd"})
    assert s.path == tmp_path / "a"
    assert s.store_options["codec"] == "zstd"  # the extra config wins over the file
    assert s.load_mode == "layer"


def test_json_config_file_unknown_key_names_the_file(tmp_path: Path) -> None:
    file = tmp_path / "ucm.json"
    file.write_text(json.dumps({"path": str(tmp_path), "cpacity_bytes": 5}))
    with pytest.raises(ConfigError, match="ucm.json.*cpacity_bytes"):
        ConnectorSettings.from_extra_config({"config_file": str(file)})


def test_missing_config_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        ConnectorSettings.from_extra_config({"config_file": str(tmp_path / "nope.yaml")})


def test_default_path_env_then_xdg_then_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("UCM_DB_PATH", str(tmp_path / "env"))
    assert ConnectorSettings.from_extra_config({}).path == tmp_path / "env"
    monkeypatch.delenv("UCM_DB_PATH")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_store_path() == tmp_path / "xdg" / "ucm-db"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_store_path() == tmp_path / "home" / ".cache" / "ucm-db"


def test_valid_keys_cover_store_config() -> None:
    from ucm_db.config import StoreConfig

    assert set(StoreConfig.field_names()) <= set(valid_keys())


def test_every_connector_key_has_a_row_in_the_readme_and_a_place_in_configuration_md() -> None:
    """The README's table and docs/configuration.md promise the whole list of keys."""
    from ucm_db.config import StoreConfig

    connector_keys = sorted(set(valid_keys()) - set(StoreConfig.field_names()))
    assert "load_threads" in connector_keys
    root = Path(__file__).resolve().parents[2]
    readme = (root / "README.md").read_text()
    configuration = (root / "docs" / "configuration.md").read_text()
    missing = [k for k in connector_keys if f"\n| `{k}` |" not in readme or f"`{k}`" not in configuration]
    assert not missing, f"connector keys missing from README.md's table or docs/configuration.md: {missing}"
