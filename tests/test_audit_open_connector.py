"""Audit: one store path, one error, whichever door it enters by.

A store path with a name over the file system's limit (255 bytes) is the
user's input, so it is a ConfigError naming the fix -- what ``ucm_db.open``
and the CLI raise (docs/api.md), and the connector too (it was a TierError:
``connector/stores.py``'s ``store_is_read_only`` runs ``Path.is_dir`` on the
path first, and Python 3.11 raises ENAMETOOLONG from it)."""

from __future__ import annotations

from pathlib import Path

import pytest

import ucm_db
from ucm_db.errors import ConfigError


def test_the_core_names_a_too_long_name_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="name of 300 bytes") as raised:
        ucm_db.open(tmp_path / ("a" * 300))
    assert "255" in raised.value.hint


def test_the_connector_names_a_too_long_name_a_config_error_too(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    from ucm_db.connector.stores import check_openable, role_settings

    try:
        settings, _ = role_settings({"path": str(tmp_path / ("a" * 300))}, "kv_both")
        check_openable(settings)
    except ucm_db.UcmDbError as exc:
        assert isinstance(exc, ConfigError), f"{type(exc).__name__}: {exc}"
        assert "255" in (exc.hint or "")
    else:
        pytest.fail("a 300-byte name was accepted")
