"""An archive's manifest version is an int: ``true`` and ``1.0`` are not 1.

Audit finding: ``manifest.get("version") not in (1, 2, 3)`` let ``true`` and
``1.0`` through (both equal 1 in Python), and the archive was then read as
version 1, whose epochs are ignored: a namespace invalidated at the source
kept the importing store's older epoch. Now such a manifest is refused with
the version it holds, before anything is written.
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest

import ucm_db
from ucm_db import ConfigError, Namespace, maintenance

NS = Namespace(model="test/archive-versions", kv_dtype="bfloat16", block_size=4)
TOKENS = list(range(31, 31 + 4 * 3))


@pytest.fixture
def archive(tmp_path: Path) -> Path:
    with ucm_db.open(tmp_path / "src") as store:
        store.put(NS, NS.block_keys(TOKENS, epoch=store.epoch(NS)), [b"v1" * 32] * 3)
        store.bump_epoch(NS)  # invalidated at the source: epoch 1 travels with the archive
        store.put(NS, NS.block_keys(TOKENS, epoch=store.epoch(NS)), [b"v2" * 32] * 3)
    maintenance.export_archive(tmp_path / "src", tmp_path / "x.tar")
    return tmp_path / "x.tar"


def with_version(archive: Path, out: Path, version: object) -> Path:
    with tarfile.open(archive) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]  # type: ignore[union-attr]
    with tarfile.open(out, "w") as tar:
        for member, data in members:
            if member.name == "manifest.json":
                data = json.dumps({**json.loads(data), "version": version}).encode()
                member.size = len(data)
            tar.addfile(member, io.BytesIO(data))
    return out


@pytest.mark.parametrize("version", [True, 1.0, 2.0, "2", None])
def test_a_version_that_is_not_an_int_is_refused_before_anything_is_written(tmp_path: Path, archive: Path,
                                                                            version: object) -> None:
    altered = with_version(archive, tmp_path / "altered.tar", version)
    with pytest.raises(ConfigError, match=r"not a ucm-db export of version 1 or 2 or 3 \(its manifest's version is") as caught:
        maintenance.import_archive(altered, tmp_path / "dst")
    assert repr(str(version)) in caught.value.message
    assert not (tmp_path / "dst").exists()


def test_the_int_versions_are_still_read(tmp_path: Path, archive: Path) -> None:
    report = maintenance.import_archive(with_version(archive, tmp_path / "v2.tar", 2), tmp_path / "dst")
    assert report["epochs"][NS.digest[:16].hex()]["epoch"] == 1
    report = maintenance.import_archive(with_version(archive, tmp_path / "v1.tar", 1), tmp_path / "old")
    assert report["epochs"][NS.digest[:16].hex()]["carried"] is None  # version 1: no epochs, as before
