"""Review of ab89e0a (bounded tar headers): reproduction of a refusal, fixed.

ab89e0a's ``MAX_EXTENDED_TOTAL_BYTES`` (16 MiB of extended headers per archive) did
not grow with the number of members, while a tar tool re-packing an export
adds a small pax header to every member: GNU tar ``--format=posix`` writes
atime and ctime (about 60 bytes) for each file. Measured in review: a real
export of 300,000 blocks, extracted and re-packed with GNU tar 1.34
``--format=posix``, is refused ("an extended header ... of 60 bytes ... over
the bounds", exit 2) where ab89e0a^ imported all 300,000 (200,000 still
import). The manifest allows about 1.5 million blocks. Here the bound is
scaled down (the fixed allowance monkeypatched to 16 KiB) so 400 members show it in seconds; the
archive is re-packed by tarfile with the same per-member pax records GNU
tar writes.

Fixed (ucm_db/maintenance/archive/files.py, BoundedTarInfo): what tarfile
keeps of the extended headers is bounded by 16 MiB plus 2 KiB per member
read (a posix re-pack is charged ~0.4 KiB a member), beside the 64 KiB
per-header and 8-in-a-row bounds, which stop the 200 MB header and the
RecursionError. Measured (listing through BoundedTarInfo, peak RSS): a
300,000-member posix re-pack listed in 325 MiB (ab89e0a: refused at member
~280k, 306 MiB).
"""

from __future__ import annotations

import tarfile
from pathlib import Path

import pytest

import ucm_db
from ucm_db import Namespace, maintenance
from ucm_db.maintenance.archive import files as archive_files

NS = Namespace(model="test/review-archive-pax-total", kv_dtype="bfloat16", block_size=4)
CHAINS, DEPTH = 100, 4


def repacked_as_posix(archive: Path, out: Path) -> int:
    """``archive`` re-packed with a pax header (atime, ctime) per member, as
    GNU tar --format=posix does; returns the extended-header bytes."""
    header_bytes = 0
    with tarfile.open(archive) as src, tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as dst:
        for member in src.getmembers():
            member.pax_headers = {"atime": "1796542858.542814281", "ctime": "1796542860.030814329"}
            header_bytes += sum(_record_bytes(k, v) for k, v in member.pax_headers.items())
            dst.addfile(member, src.extractfile(member))
    return header_bytes


def _record_bytes(key: str, value: str) -> int:
    """Length of the pax record ``"<len> key=value\\n"`` (its length counts its own digits)."""
    body = len(f" {key}={value}\n")
    n = body + len(str(body))
    return body + len(str(n))


def test_a_posix_repack_imports_whatever_its_member_count(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with ucm_db.open(tmp_path / "src") as store:
        for c in range(CHAINS):
            keys = NS.block_keys([c * 1000 + t for t in range(DEPTH * NS.block_size)])
            store.put(NS, keys, [bytes([c % 256, i]) * 8 for i in range(DEPTH)])
    maintenance.export_archive(tmp_path / "src", tmp_path / "a.tar")
    assert repacked_as_posix(tmp_path / "a.tar", tmp_path / "posix.tar") > 16 << 10
    monkeypatch.setattr(archive_files, "MAX_EXTENDED_BASE_BYTES", 16 << 10)  # 16 MiB scaled as 300k members to 400
    report = maintenance.import_archive(tmp_path / "posix.tar", tmp_path / "dst")  # ab89e0a: ConfigError "over the bounds"
    assert report["stored"] == CHAINS * DEPTH
