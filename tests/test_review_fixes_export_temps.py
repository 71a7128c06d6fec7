"""Review of 5dc4e7b (an export removes the temp files of dead exports).

Finding: the cleaner removes *any* unlocked regular file whose name
matches ``TEMP_NAME``, and nothing keeps an export from writing its
finished archive under such a name: the next export to that directory
deletes that archive (it holds no lock, since its export ended). Contrived
(a user must pick such a name), but it is the one way the cleaner removes
a file that is not an abandoned temp. Real store, real exports.
"""

from __future__ import annotations

import tarfile
from pathlib import Path

import pytest

import ucm_db
from ucm_db import ConfigError, Namespace
from ucm_db.maintenance.archive import export_archive, temps

NS = Namespace(model="test/review-export-temps", kv_dtype="bfloat16", block_size=16)


def test_an_archive_named_like_a_temp_file_survives_the_next_export(tmp_path: Path) -> None:
    with ucm_db.open(tmp_path / "store", capacity_bytes=64 << 20) as store:
        keys = NS.block_keys(list(range(32)))
        store.put(NS, keys, [b"x" * 1024] * len(keys))
    out = tmp_path / "out"
    out.mkdir()
    kept = out / ".monday.ucm-db-export.0123456789abcdef.partial"
    assert temps.TEMP_NAME.fullmatch(kept.name)
    try:
        export_archive(tmp_path / "store", kept)  # accepted today: a regular file name like any other
    except ConfigError:
        return  # one fix: such a name is refused as an archive name
    assert tarfile.is_tarfile(kept)
    export_archive(tmp_path / "store", out / "tuesday.tar")
    assert kept.exists(), "the next export removed a finished archive"
