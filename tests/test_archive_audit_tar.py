"""``import`` reads a tar's own structure within bounds, and refuses an archive
whose member listing does not reach the tar's end.

Audit findings (reproduced here on real archives, imported into real LMDB
stores through the CLI or ``ucm_db.maintenance``):

* tarfile reads a pax extended header or a GNU long-name header whole, into
  memory, before import sees any member: a 200 MB pax header (a 210 MB
  archive) took the import to 640 MiB of RSS (40 MiB now, refused), and
  nothing bounded it; 3000
  small pax headers in a row (each read nested in the last) ended the
  import in a RecursionError traceback. ucm-db's export writes no such
  header, so import now refuses one over 64 KiB or more than 8 in a row
  (ConfigError, exit 2, nothing written).
* What tarfile keeps of the headers (every member's pax records, with a copy
  of the global records before it, in ``tar.members``) is bounded by the
  members read: 16 MiB and 2 KiB a member (review of ab89e0a: a flat 16 MiB
  refused a GNU tar ``--format=posix`` re-pack of 280k+ blocks, while one
  60 KiB global header copied into 2000 members took 200 MiB under it).
* tarfile ends its member listing silently at the first header it cannot
  read (anywhere but the first): an archive cut short at a member boundary,
  or with a member header damaged midway, was imported up to there and the
  rest reported as "payload missing" (exit 1), where cli.md promises that a
  cut-short archive is refused whole (exit 2) before anything is written.
  Import now requires the listing to end at the tar's end-of-archive block.
* A sparse member (GNU) declares a size it does not hold: one of a few
  bytes made import allocate and zero-fill its declared 512 MiB (and its
  map is read whole, like an extended header). Export never writes one;
  import refuses the archive (ConfigError, exit 2, nothing written).
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest
from click.testing import CliRunner

import ucm_db
from ucm_db import ConfigError, Namespace, maintenance
from ucm_db.maintenance.archive import files as archive_files
from ucm_db.tools.cli import cli

NS = Namespace(model="test/archive-audit-tar", kv_dtype="bfloat16", block_size=4)
CHAINS = 6
DEPTH = 3


@pytest.fixture
def archive(tmp_path: Path) -> Path:
    """An export of 6 chains of 3 blocks (18 members after the manifest)."""
    with ucm_db.open(tmp_path / "src") as store:
        for c in range(CHAINS):
            keys = NS.block_keys([c * 100 + t for t in range(DEPTH * NS.block_size)])
            store.put(NS, keys, [bytes([c, i]) * 300 for i in range(DEPTH)])
    out = tmp_path / "a.tar"
    assert maintenance.export_archive(tmp_path / "src", out)["blocks"] == CHAINS * DEPTH
    return out


def member_offsets(archive: Path) -> list[int]:
    with tarfile.open(archive) as tar:
        return [m.offset for m in tar.getmembers()]


def pax_headers(count: int, value_bytes: int) -> bytes:
    """``count`` pax extended headers, each with one record of about ``value_bytes``."""
    return b"".join(tarfile.TarInfo._create_pax_generic_header(  # type: ignore[attr-defined]
        {"comment": f"{i}:" + "x" * value_bytes}, tarfile.XHDTYPE, "utf-8") for i in range(count))


def insert_before_member(archive: Path, index: int, data: bytes, out: Path) -> Path:
    raw = archive.read_bytes()
    at = member_offsets(archive)[index]
    out.write_bytes(raw[:at] + data + raw[at:])
    return out


def import_cli(archive: Path, dest: Path, expect: int) -> dict[str, object]:
    result = CliRunner().invoke(cli, ["import", str(archive), str(dest), "--json"], catch_exceptions=False)
    assert result.exit_code == expect, result.stdout + result.stderr
    return json.loads(result.stdout)  # type: ignore[no-any-return]


def test_an_oversized_pax_header_is_refused_and_nothing_written(archive: Path, tmp_path: Path) -> None:
    bad = insert_before_member(archive, 1, pax_headers(1, 1 << 20), tmp_path / "pax.tar")
    error = import_cli(bad, tmp_path / "dst", expect=2)["error"]
    assert error["type"] == "ConfigError" and "extended header" in error["message"]  # type: ignore[index]
    assert error["hint"]  # type: ignore[index]
    assert not (tmp_path / "dst").exists()


def test_many_extended_headers_in_a_row_are_refused_not_a_recursion_error(archive: Path, tmp_path: Path) -> None:
    bad = insert_before_member(archive, 1, pax_headers(3000, 8), tmp_path / "nested.tar")
    with pytest.raises(ConfigError, match="extended headers in a row"):
        maintenance.import_archive(bad, tmp_path / "dst")
    assert not (tmp_path / "dst").exists()


def test_extended_headers_over_the_archive_budget_are_refused(archive: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Headers each under the per-header bound, few in a row, add up: past the
    archive's budget (lowered to 1 MiB here, so 19 members make it) they are refused."""
    monkeypatch.setattr(archive_files, "MAX_EXTENDED_BASE_BYTES", 1 << 20)
    raw = archive.read_bytes()
    offsets = member_offsets(archive) + [len(raw)]
    pieces = [raw[: offsets[0]]]
    for i, (start, stop) in enumerate(zip(offsets, offsets[1:])):  # a global (g) header before each member
        pieces += [tarfile.TarInfo._create_pax_generic_header(  # type: ignore[attr-defined]
            {f"k{i}": "x" * (60 << 10)}, tarfile.XGLTYPE, "utf-8"), raw[start:stop]]
    (tmp_path / "budget.tar").write_bytes(b"".join(pieces))
    with pytest.raises(ConfigError, match="extended header"):
        maintenance.import_archive(tmp_path / "budget.tar", tmp_path / "dst")
    assert not (tmp_path / "dst").exists()


def test_global_records_copied_into_every_member_are_refused_past_the_bound(tmp_path: Path) -> None:
    """Review of ab89e0a: tarfile copies the global pax records into every
    member that has records of its own. One global header of 5000 records
    (60 KiB), before 41 members with atime and ctime, passed a flat 16 MiB
    total of header bytes, each member holding a 5000-entry dict (a 4 MB
    archive of 2000 such members took a listing from 40 to 240 MiB); what
    the members hold is now charged, at the real bounds."""
    with ucm_db.open(tmp_path / "src") as store:
        for c in range(10):
            keys = NS.block_keys([c * 100 + t for t in range(4 * NS.block_size)])
            store.put(NS, keys, [bytes([c, i]) * 30 for i in range(4)])
    maintenance.export_archive(tmp_path / "src", tmp_path / "a.tar")
    many_globals = {f"k{i:05d}": "v" for i in range(5000)}
    out = tmp_path / "global.tar"
    with tarfile.open(tmp_path / "a.tar") as src, \
            tarfile.open(out, "w", format=tarfile.PAX_FORMAT, pax_headers=many_globals) as dst:
        assert len(src.getmembers()) == 41
        for member in src.getmembers():
            member.pax_headers = {"atime": "1796542858.542814281", "ctime": "1796542860.030814329"}
            dst.addfile(member, src.extractfile(member))
    assert out.stat().st_size < 1 << 20  # a 16 MiB total of header bytes is nowhere near
    error = import_cli(out, tmp_path / "dst", expect=2)["error"]
    assert "extended headers" in error["message"] and "per member" in error["message"]  # type: ignore[index,operator]
    assert not (tmp_path / "dst").exists()


def test_a_few_small_pax_headers_are_still_read(archive: Path, tmp_path: Path) -> None:
    """A tar tool that adds pax headers (atime, ctime) to an export it re-packs is still imported."""
    ok = insert_before_member(archive, 1, pax_headers(2, 100), tmp_path / "ok.tar")
    report = import_cli(ok, tmp_path / "dst", expect=0)
    assert report["stored"] == CHAINS * DEPTH


@pytest.mark.parametrize("member", [4, 11, 18])
def test_an_archive_cut_at_a_member_boundary_is_refused_whole(archive: Path, tmp_path: Path, member: int) -> None:
    cut = tmp_path / "cut.tar"
    cut.write_bytes(archive.read_bytes()[: member_offsets(archive)[member]])
    error = import_cli(cut, tmp_path / "dst", expect=2)["error"]
    assert "cut short" in error["message"] and "export it again" in error["hint"]  # type: ignore[index,operator]
    assert not (tmp_path / "dst").exists()


def test_a_damaged_member_header_midway_is_refused_whole(archive: Path, tmp_path: Path) -> None:
    raw = bytearray(archive.read_bytes())
    raw[member_offsets(archive)[7] + 3] ^= 0x20  # its name: the header checksum no longer matches
    (tmp_path / "bad.tar").write_bytes(raw)
    ucm_db.open(tmp_path / "dst").close()
    with pytest.raises(ConfigError, match="cut short or damaged"):
        maintenance.import_archive(tmp_path / "bad.tar", tmp_path / "dst")
    with ucm_db.open(tmp_path / "dst") as store:
        assert store.stats().blocks == 0


def test_a_sparse_member_is_refused_without_reading_its_declared_size(archive: Path, tmp_path: Path) -> None:
    with tarfile.open(archive) as tar:
        items = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]  # type: ignore[union-attr]
    victim = items[-1][0].name
    sparse = tmp_path / "sparse.tar"
    with tarfile.open(sparse, "w", format=tarfile.GNU_FORMAT) as tar:
        for member, data in items:
            if member.name == victim:  # a GNU sparse member: 512 MiB declared, nothing stored
                info = tarfile.TarInfo(member.name)
                info.type = tarfile.GNUTYPE_SPARSE
                info.size = 0
                buf = bytearray(info.tobuf(tarfile.GNU_FORMAT))
                buf[483:495] = b"%011o\0" % (512 << 20)  # realsize
                buf[148:156] = b" " * 8
                buf[148:155] = b"%06o\0" % sum(buf)
                tar.fileobj.write(bytes(buf))  # type: ignore[union-attr]
                tar.offset += len(buf)
                continue
            tar.addfile(member, io.BytesIO(data))
    error = import_cli(sparse, tmp_path / "dst", expect=2)["error"]
    assert "sparse" in error["message"] and victim in error["message"]  # type: ignore[index,operator]
    assert not (tmp_path / "dst").exists()


def test_link_and_path_members_are_never_followed_or_written(archive: Path, tmp_path: Path) -> None:
    """No finding: import extracts nothing and reads members by their exact
    names, regular ones only. A symlink or hard link standing for a block,
    and members named with ``..`` or an absolute path, leave the block
    skipped (with its descendants) and create nothing anywhere."""
    with tarfile.open(archive) as tar:
        items = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]  # type: ignore[union-attr]
    first, second = items[1][0].name, items[2][0].name
    outside = tmp_path / "outside"
    odd = tmp_path / "odd.tar"
    with tarfile.open(odd, "w") as tar:
        for member, data in items:
            if member.name in (first, second):
                link = tarfile.TarInfo(member.name)
                link.type = tarfile.SYMTYPE if member.name == first else tarfile.LNKTYPE
                link.linkname = "/etc/passwd" if member.name == first else "manifest.json"
                tar.addfile(link)
                continue
            tar.addfile(member, io.BytesIO(data))
        for name in (f"../{outside.name}", str(outside)):
            info = tarfile.TarInfo(name)
            info.size = 4
            tar.addfile(info, io.BytesIO(b"evil"))
    report = maintenance.import_archive(odd, tmp_path / "dst")
    skipped = {s["key"]: s["reason"] for s in report["skipped"]}
    for name in (first, second):
        assert "not a regular member" in skipped[name.removeprefix("blocks/")]
    assert report["stored"] == CHAINS * DEPTH - len(skipped)
    assert not outside.exists()
