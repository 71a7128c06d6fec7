"""The LMDB fence (ucm_db/engines/lmdb/fence.py): an LMDB library or data file
that the page-level code was not proven on is refused at open, and nothing
is rolled back, rewritten or mapped first.

The data-file tests edit real bytes of a real store's meta pages. The
library test replaces ``lmdb.version()`` with a stub: this is the one mock
here, because no other LMDB library can be loaded into the test's process
(py-lmdb bundles exactly one).
"""

from __future__ import annotations

import struct
from pathlib import Path

import lmdb
import pytest

import ucm_db
from ucm_db.errors import FormatVersionError, TierError
from ucm_db.storelock import StoreLock
from ucm_db.engines.lmdb import LMDB_REQUIREMENT, PROVEN_DATA_VERSIONS, PROVEN_LIBRARY_VERSIONS
from ucm_db.engines.lmdb.fence import UNPROVEN_LIBRARY_ENV
from ucm_db.engines.lmdb.groupsync import read_record
from ucm_db.engines.lmdb.recovery import BOOT_ID_ENV

from .harness import NS, chain_tokens, payload_for

BLOCKS = 8
BLOCK_BYTES = 16 << 10
PAGE = 4096
_VERSION_AT = 16 + 4  # page header, then MDB_meta's magic; the data version follows
GROUP = {"durability": "group", "sync_interval_s": 3600.0, "sync_bytes": 1 << 40}


def _keys() -> list[bytes]:
    return NS.block_keys(chain_tokens("lmdb-fence", BLOCKS))


def _store(tmp_path: Path, **options: object) -> Path:
    path = tmp_path / "store"
    keys = _keys()
    with ucm_db.open(path, capacity_bytes=64 << 20, **options) as store:  # type: ignore[arg-type]
        store.put(NS, keys, [payload_for(k, BLOCK_BYTES) for k in keys])
        store.flush()
    return path


def _files(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted((path / "lmdb").iterdir()) if p.is_file()}


def _assert_released(path: Path) -> None:
    with StoreLock(path) as lock:
        assert lock.try_exclusive(), "a refused open must not keep holding the store"


def test_the_running_library_is_a_proven_one() -> None:
    """The bound in pyproject.toml installs what the fence admits."""
    assert tuple(lmdb.version()[:3]) in PROVEN_LIBRARY_VERSIONS
    assert lmdb.__version__.startswith("3.0.")
    text = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert f'"{LMDB_REQUIREMENT}"' in text


def test_an_unproven_lmdb_library_is_refused_at_open(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _store(tmp_path)
    before = _files(path)
    monkeypatch.delenv(UNPROVEN_LIBRARY_ENV, raising=False)
    monkeypatch.setattr(lmdb, "version", lambda *args, **kwargs: (0, 9, 99))  # the mock: see the module doc
    with pytest.raises(TierError, match=r"LMDB 0\.9\.99.*proven on LMDB 0\.9\.36") as info:
        ucm_db.open(path)
    assert LMDB_REQUIREMENT in info.value.hint and UNPROVEN_LIBRARY_ENV in info.value.hint
    assert _files(path) == before, "a refused open changes nothing"
    _assert_released(path)
    # The escape hatch opens it (the data file is still a proven format).
    monkeypatch.setenv(UNPROVEN_LIBRARY_ENV, "1")
    with ucm_db.open(path) as store:
        assert store.lookup(NS, _keys()) == BLOCKS


@pytest.mark.parametrize("pages", [(0, 1), (1,)], ids=["both-meta-pages", "meta-page-1"])
@pytest.mark.parametrize("read_only", [False, True], ids=["writable", "read-only"])
def test_a_data_file_of_an_unknown_lmdb_data_version_is_refused_and_not_rolled_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pages: tuple[int, ...], read_only: bool,
) -> None:
    """A group-durability store opened after a (simulated) OS crash would be
    rolled back onto its recorded meta page: with a meta page of an unknown
    format that rollback must not run, nor may LMDB map the file."""
    monkeypatch.setenv(BOOT_ID_ENV, "boot-before")
    path = _store(tmp_path, **GROUP)
    assert read_record(path / "lmdb") is not None
    data = path / "lmdb" / "data.mdb"
    with open(data, "r+b") as file:
        for page in pages:
            file.seek(page * PAGE + _VERSION_AT)
            file.write(struct.pack("<I", 7))
    before = _files(path)
    monkeypatch.setenv(BOOT_ID_ENV, "boot-after")  # the machine went down since the last sync
    with pytest.raises(FormatVersionError, match=r"LMDB data version 7.*proven on data version 1") as info:
        ucm_db.open(path, read_only=read_only, **GROUP)
    assert "aside" in info.value.hint and "migrate" not in info.value.hint
    assert _files(path) == before, "nothing rolled back or rewritten"
    _assert_released(path)
    assert PROVEN_DATA_VERSIONS == {1}
