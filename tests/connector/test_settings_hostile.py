"""Hostile and odd start-up input (audit of the connector's input handling,
F4-F7): every bad ``kv_connector_extra_config`` or config file ends in one
short :class:`~ucm_db.errors.UcmDbError` line with its hint, the one the
connector logs as ``ucm-db connector cannot start: ...``, and fast: never a
raw ``ValueError``/``OSError``/``RecursionError`` traceback, a blocked read
or a runaway error message.

Each case runs what the engine core's first connector call runs
(``UcmDbConnector.get_required_kvcache_layout``: :func:`role_settings`, then
:func:`check_openable`); no engine is started.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from ucm_db.connector.settings import ConnectorSettings
from ucm_db.connector.stores import check_openable, role_settings
from ucm_db.errors import ConfigError, TierError, UcmDbError

#: Longest a refused start may take here: each case is refused before any
#: real work (seconds would mean a read, an expansion or a store open ran).
QUICK_S = 2.0


def _refused(extra: dict[str, Any], kind: type[UcmDbError] = UcmDbError) -> UcmDbError:
    """The error a start with ``extra`` stops with, checked against the
    contract: the class, one line, the hint in it, short, quick."""
    started = time.monotonic()
    with pytest.raises(kind) as info:
        settings, _ = role_settings(extra, "kv_both")
        check_openable(settings)
    assert time.monotonic() - started < QUICK_S
    text = str(info.value)
    assert "\n" not in text and info.value.hint and text.endswith(f"(hint: {info.value.hint})"), text
    assert len(text) < 2000, text[:300]
    return info.value


@pytest.fixture()
def store(tmp_path: Path) -> str:
    return str(tmp_path / "store")


# -- F4: store paths and config file names no file system takes ---------------------
def test_a_store_path_under_a_directory_the_user_cannot_enter(tmp_path: Path) -> None:
    """The audit's case: a service user whose store lies under a directory it cannot enter. Root enters
    every directory, so the start runs in a forked child that becomes ``nobody`` first (as
    tests/test_store_open_path.py does); the child reports the error it met."""
    from other_user import error_outcome, run_as_nobody

    parent = Path(tempfile.mkdtemp(prefix="ucm-db-locked-"))
    parent.chmod(0o711)
    locked = parent / "locked"
    locked.mkdir(mode=0o700)  # root's: nobody cannot enter it

    def start() -> None:
        settings, _ = role_settings({"path": str(locked / "store")}, "kv_both")
        check_openable(settings)

    try:
        result = run_as_nobody(lambda: error_outcome(start))
    finally:
        shutil.rmtree(parent)
    assert result.get("tier") == "True", result
    assert "ermission denied" in result["text"] and "\n" not in result["text"] and result["hint"], result


def test_a_store_path_with_a_name_too_long(tmp_path: Path) -> None:
    assert "255" in _refused({"path": str(tmp_path / ("a" * 300))}, ConfigError).hint


@pytest.mark.parametrize("key", ["path", "config_file"])
def test_a_nul_character_in_a_path(tmp_path: Path, key: str) -> None:
    extra = {"path": str(tmp_path / "store"), key: str(tmp_path / "a\x00b")}
    assert "NUL" in _refused(extra, ConfigError).message


def test_the_home_of_an_unknown_user(store: str) -> None:
    error = _refused({"path": "~no_such_user_ucm_db/store"}, ConfigError)
    assert "~no_such_user_ucm_db" in error.message and "unknown user" in error.message


@pytest.mark.parametrize("value", [7, ["a.yaml"], {"a": 1}, "", b"a.yaml"], ids=["int", "list", "dict", "empty", "bytes"])
def test_a_config_file_that_is_not_a_path(store: str, value: Any) -> None:
    assert _refused({"path": store, "config_file": value}, ConfigError).message.startswith("config_file must be")


def test_a_config_file_that_is_not_utf8(tmp_path: Path, store: str) -> None:
    file = tmp_path / "ucm.yaml"
    file.write_bytes(b"load_mode: \xff\xfe block\n")
    assert "utf-8" in _refused({"path": store, "config_file": str(file)}, ConfigError).message


@pytest.mark.parametrize("suffix", ["yaml", "json"])
def test_a_config_file_nested_thousands_deep(tmp_path: Path, store: str, suffix: str) -> None:
    file = tmp_path / f"ucm.{suffix}"
    file.write_text('{"load_mode": ' + "[" * 5000 + "]" * 5000 + "}")
    assert f"not valid {suffix.upper()}" in _refused({"path": store, "config_file": str(file)}, ConfigError).message


def test_a_start_failure_ucm_db_did_not_expect_still_logs_the_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("vllm")
    from ucm_db.connector.connector import UcmDbConnector

    def broken(extra: Any) -> ConnectorSettings:
        raise RuntimeError("something odd\nover two lines")

    lines: list[str] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger("vllm.ucm_db.connector.connector")
    log.addHandler(handler)
    monkeypatch.setattr(ConnectorSettings, "from_extra_config", broken)
    try:
        with pytest.raises(RuntimeError):
            UcmDbConnector.requires_piecewise_for_cudagraph({})
    finally:
        log.removeHandler(handler)
    assert lines == ["ucm-db connector cannot start: RuntimeError: something odd over two lines (hint: the traceback that follows "
                     "shows where; check the settings and the store path)"]


# -- F5: aliases (an alias bomb) and huge values ------------------------------------
def _alias_bomb(levels: int) -> str:
    lines = ['a0: &a0 ["xxxxxxxxxx","xxxxxxxxxx","xxxxxxxxxx","xxxxxxxxxx","xxxxxxxxxx",'
             '"xxxxxxxxxx","xxxxxxxxxx","xxxxxxxxxx","xxxxxxxxxx","xxxxxxxxxx"]']
    for level in range(1, levels):
        lines.append(f"a{level}: &a{level} [" + ",".join([f"*a{level - 1}"] * 10) + "]")
    return "\n".join(lines) + f"\nload_mode: *a{levels - 1}\n"


def test_a_yaml_alias_bomb_is_refused_at_once(tmp_path: Path, store: str) -> None:
    # 9 levels: printing load_mode's value took past 60 s and 6 GiB (audit F5).
    file = tmp_path / "bomb.yaml"
    file.write_text(_alias_bomb(9))
    error = _refused({"path": store, "config_file": str(file)}, ConfigError)
    assert "alias" in error.message and "line 2" in error.message


def test_any_yaml_alias_is_refused(tmp_path: Path, store: str) -> None:
    file = tmp_path / "ucm.yaml"
    file.write_text("base: &mode layer\nload_mode: *mode\n")
    _refused({"path": store, "config_file": str(file)}, ConfigError)


@pytest.mark.parametrize("key", ["load_mode", "remote_lookup", "save_process", "load_threads", "max_pending_save_bytes"])
def test_a_huge_bad_value_is_described_briefly(store: str, key: str) -> None:
    assert len(_refused({"path": store, key: "x" * 10_000_000}, ConfigError).message) < 300
    assert len(_refused({"path": store, key: [[0] * 1000] * 1000}, ConfigError).message) < 300
    assert len(_refused({"path": store, key: -(10 ** 5000)}, ConfigError).message) < 300


def test_many_huge_unknown_keys_are_listed_briefly(store: str) -> None:
    extra = {"path": store, **{"k" * 1_000_000 + str(i): 1 for i in range(20)}}
    assert "and 10 more" in _refused(extra, ConfigError).message


# -- F6: invalid YAML in one line ---------------------------------------------------
def test_invalid_yaml_is_one_line_naming_the_file_line_and_column(tmp_path: Path, store: str) -> None:
    file = tmp_path / "ucm.yaml"
    file.write_text("path: [unclosed\n")
    error = _refused({"path": store, "config_file": str(file)}, ConfigError)
    assert str(file) in error.message and "line 2, column 1" in error.message and error.hint == "fix the YAML"


def test_invalid_json_is_one_line_too(tmp_path: Path, store: str) -> None:
    file = tmp_path / "ucm.json"
    file.write_text(json.dumps({"load_mode": "block"})[:-1])
    assert "not valid JSON" in _refused({"path": store, "config_file": str(file)}, ConfigError).message


# -- F7: regular files only, of bounded size -----------------------------------------
def test_a_fifo_as_config_file_is_refused_without_reading_it(tmp_path: Path, store: str) -> None:
    fifo = tmp_path / "ucm.yaml"
    os.mkfifo(fifo)

    def late_writer() -> None:  # frees a reader blocked on the FIFO, so a regression fails instead of hanging
        time.sleep(2 * QUICK_S)
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK) if _has_reader(fifo) else None
        if fd is not None:
            os.close(fd)

    threading.Thread(target=late_writer, daemon=True).start()
    assert "not a regular file" in _refused({"path": store, "config_file": str(fifo)}, ConfigError).message


def _has_reader(fifo: Path) -> bool:
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        return True
    except OSError:  # ENXIO: nobody reads it
        return False


@pytest.mark.parametrize("name", ["/dev/null", "directory"])
def test_a_device_or_a_directory_as_config_file_is_refused(tmp_path: Path, store: str, name: str) -> None:
    # /dev/zero is refused the same way (a character device); it is not
    # read here, as before the fix it read until memory ran out.
    target = str(tmp_path) if name == "directory" else name
    assert "not a regular file" in _refused({"path": store, "config_file": target}, ConfigError).message


def test_an_oversized_config_file_is_refused_before_it_is_read(tmp_path: Path, store: str) -> None:
    file = tmp_path / "ucm.yaml"
    file.write_text("# padding\n" * 200_000 + "load_mode: block\n")
    assert "at most 1048576 bytes" in _refused({"path": store, "config_file": str(file)}, ConfigError).message
