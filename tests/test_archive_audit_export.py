"""``export`` ships only blocks that verify, and only from a store format it
knows.

Audit findings (real LMDB stores, the real CLI through CliRunner):

* A block whose payload rotted in the store (one bit) was exported as it
  was, signed too where the export had an auth key, and the export said
  "exported 23 blocks" (exit 0); every import of the archive then skipped it
  and its 2 descendants (exit 1), far from the store that held the damage.
  Export now checks each block under its key as import does, leaves a
  corrupt one out with its descendants, names it and exits 1 with the fix
  (``ucm-db verify PATH --fix``).
* ``export`` of a store of a newer format than this ucm-db's wrote an
  archive (exit 0) though ``verify`` refuses such a store: export reads the
  tables as this ucm-db lays them out (a format-2 ucm-db reading a format-3
  store would have exported every block without its head, which format 3
  keeps in a table of its own). It is now refused (FormatVersionError,
  exit 2), nothing written.
"""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest
from click.testing import CliRunner

import ucm_db
from ucm_db import FormatVersionError, Namespace, maintenance
from ucm_db.format import write_format_version
from ucm_db.store import STORE_FORMAT_VERSION
from ucm_db.tools.cli import cli

NS = Namespace(model="test/archive-audit-export", kv_dtype="bfloat16", block_size=4)
DEPTH = 4


def chain(c: int) -> list[bytes]:
    return NS.block_keys([c * 100 + t for t in range(DEPTH * NS.block_size)])


@pytest.fixture
def store(tmp_path: Path) -> Path:
    with ucm_db.open(tmp_path / "s") as opened:
        for c in range(3):
            opened.put(NS, chain(c), [bytes([c, i]) * 500 for i in range(DEPTH)])
    return tmp_path / "s"


def run(*args: object, expect: int) -> dict[str, object]:
    result = CliRunner().invoke(cli, [*map(str, args), "--json"], catch_exceptions=False)
    assert result.exit_code == expect, result.stdout + result.stderr
    return json.loads(result.stdout)  # type: ignore[no-any-return]


def rot(store: Path, key: bytes) -> None:
    """Flips the last bit of a block's stored body, as a bad disk sector would."""
    with ucm_db.open(store) as opened:
        def flip(txn: object) -> None:
            body = bytearray(txn.get("blocks", key))  # type: ignore[attr-defined]
            body[-1] ^= 1
            txn.put("blocks", key, bytes(body))  # type: ignore[attr-defined]
        opened._tier.engine.write(flip)


def key_file(tmp_path: Path) -> Path:
    path = tmp_path / "auth.key"
    path.write_text(bytes(range(32)).hex() + "\n")
    path.chmod(0o600)
    return path


def test_a_corrupt_block_is_left_out_with_its_descendants_and_named(store: Path, tmp_path: Path) -> None:
    bad = chain(1)[1]
    rot(store, bad)
    keys = key_file(tmp_path)
    report = run("export", store, tmp_path / "a.tar", "--auth-key-file", keys, expect=1)
    assert report["blocks"] == 3 * DEPTH - (DEPTH - 1) and report["left_out"] == DEPTH - 1
    assert [c["key"] for c in report["corrupt"]] == [bad.hex()]  # type: ignore[attr-defined,index]
    with tarfile.open(tmp_path / "a.tar") as tar:
        names = {m.name for m in tar.getmembers()}
    assert not {f"blocks/{k.hex()}" for k in chain(1)[1:]} & names
    imported = run("import", tmp_path / "a.tar", tmp_path / "dst", "--auth-key-file", keys, expect=0)
    assert imported["skipped"] == [] and imported["stored"] == report["blocks"]
    with ucm_db.open(tmp_path / "dst") as dst:
        assert dst.lookup(NS, chain(1)) == 1 and dst.lookup(NS, chain(2)) == DEPTH


def test_the_human_report_names_the_fix(store: Path, tmp_path: Path) -> None:
    rot(store, chain(0)[0])
    result = CliRunner().invoke(cli, ["export", str(store), str(tmp_path / "a.tar")], catch_exceptions=False)
    assert result.exit_code == 1
    assert f"ucm-db verify {store} --fix" in result.stdout and chain(0)[0].hex()[:16] in result.stdout


def test_a_clean_store_exports_with_no_corrupt_block(store: Path, tmp_path: Path) -> None:
    report = run("export", store, tmp_path / "a.tar", expect=0)
    assert report["corrupt"] == [] and report["left_out"] == 0 and report["blocks"] == 3 * DEPTH


def test_export_of_a_newer_format_store_is_refused_and_writes_nothing(store: Path, tmp_path: Path) -> None:
    with ucm_db.open(store) as opened:  # as newer code writes it: checksummed
        opened._tier.engine.write(lambda txn: write_format_version(txn, STORE_FORMAT_VERSION + 1))
    with pytest.raises(FormatVersionError, match="newer|exports format"):
        maintenance.export_archive(store, tmp_path / "a.tar")
    error = run("export", store, tmp_path / "a.tar", expect=2)["error"]
    assert error["type"] == "FormatVersionError" and "ucm-db that wrote it" in error["hint"]  # type: ignore[index,operator]
    assert list(tmp_path.iterdir()) == [store]
