"""`ucm-db gc` on a file:// root that does not exist is a usage error, not an
empty remote (issue 26, item 21)."""

from __future__ import annotations

from pathlib import Path

import pytest

import ucm_db
from ucm_db import maintenance

from cli_stores import invoke, invoke_json


def test_gc_of_a_missing_local_root_exits_2_and_creates_nothing(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such" / "remote"
    result = invoke("gc", f"file://{missing}", "--older-than", "7d", expect=2)
    assert f"{missing} does not exist" in result.stderr and "file:///" in result.stderr
    assert not (tmp_path / "no").exists()
    with pytest.raises(ucm_db.ConfigError, match="does not exist"):
        maintenance.gc_remote(f"file://{missing}", older_than_s=1.0)


def test_gc_of_a_local_root_that_is_a_file_exits_2(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("not a remote")
    assert "is not a directory" in invoke("gc", f"file://{tmp_path / 'f'}", "--max-bytes", "1GiB", expect=2).stderr
    assert (tmp_path / "f").read_text() == "not a remote"


def test_gc_of_an_empty_existing_root_and_of_memory_still_work(tmp_path: Path) -> None:
    (tmp_path / "r").mkdir()
    assert invoke_json("gc", f"file://{tmp_path / 'r'}", "--older-than", "7d")["objects_before"] == 0
    assert invoke_json("gc", "memory://ucm-db-gc-root-test", "--older-than", "7d")["objects_before"] == 0
