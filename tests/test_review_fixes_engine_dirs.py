"""Review of 5dc4e7b (``detect_engine`` refuses a directory holding both
``lmdb/`` and ``rocksdb/``).

Finding: the refusal reads any such directory as one store with two
engine directories, including a plain directory that holds two whole
stores *named* ``lmdb`` and ``rocksdb`` (the layout of
``ucm-db bench inventory-stall``'s scratch directory, or an operator's
``/data/lmdb`` and ``/data/rocksdb``). Opening that parent by mistake is
told to ``mkdir PARENT.lmdb && mv PARENT/lmdb PARENT.lmdb/``, which nests
a working store one level down (``ucm-db inspect PARENT.lmdb``, as the
hint says next, then finds no store), instead of being told that
``PARENT/lmdb`` and ``PARENT/rocksdb`` are stores to open themselves.
Real stores, nothing mocked.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import ucm_db
from ucm_db import ConfigError


def test_a_parent_of_two_stores_named_after_the_engines_is_told_to_open_them(tmp_path: Path) -> None:
    with ucm_db.open(tmp_path / "lmdb", capacity_bytes=64 << 20):
        pass
    with ucm_db.open(tmp_path / "rocksdb", engine="rocksdb", capacity_bytes=64 << 20):
        pass
    with pytest.raises(ConfigError) as refused:
        ucm_db.open(tmp_path)
    hint = refused.value.hint or ""
    assert "mv " not in hint, hint
    assert str(tmp_path / "lmdb") in hint and str(tmp_path / "rocksdb") in hint, hint
