"""`ucm-db export` never destroys what is not its own; `ucm-db import`
reads hostile archives in bounded memory and never evicts without consent
(issue 26, items 1, 12 and 21)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import stat
import tarfile
from pathlib import Path

import pytest

import ucm_db
from ucm_db import maintenance
from ucm_db.maintenance.archive import MAX_MANIFEST_BYTES, MAX_MEMBER_BYTES

from cli_stores import NS_A, chain_keys, invoke, invoke_json, make_store


@pytest.fixture
def store(tmp_path: Path) -> Path:
    make_store(tmp_path / "s")
    return tmp_path / "s"


def test_export_refuses_a_symlink_target_and_leaves_its_target_alone(store: Path, tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    (tmp_path / "out.tar").symlink_to(victim)
    result = invoke("export", store, tmp_path / "out.tar", expect=2)
    assert "is a symlink, not a regular file" in result.stderr
    assert (tmp_path / "out.tar").is_symlink() and victim.read_text() == "keep me"


def test_export_refuses_a_fifo_target_without_replacing_it(store: Path, tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "pipe")
    result = invoke("export", store, tmp_path / "pipe", expect=2)
    assert "is a FIFO" in result.stderr
    assert stat.S_ISFIFO(os.lstat(tmp_path / "pipe").st_mode)


def test_export_refuses_a_device_and_dev_stdout_without_touching_them(store: Path) -> None:
    """The issue's device cases: a character device, and /dev/stdout (a
    symlink) that an export as root would have replaced for the machine."""
    before = os.lstat("/dev/null")
    assert "is a character device" in invoke("export", store, "/dev/null", expect=2).stderr
    after = os.lstat("/dev/null")
    assert stat.S_ISCHR(after.st_mode) and (after.st_ino, after.st_rdev) == (before.st_ino, before.st_rdev)
    assert "not a regular file" in invoke("export", store, "/dev/stdout", expect=2).stderr
    assert os.path.lexists("/dev/stdout")


def test_export_refuses_standard_output_and_a_directory(store: Path, tmp_path: Path) -> None:
    assert "standard output" in invoke("export", store, "-", expect=2).stderr
    (tmp_path / "d").mkdir()
    assert "is a directory" in invoke("export", store, tmp_path / "d", expect=2).stderr


def test_export_never_writes_through_a_planted_partial_symlink(store: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    (out / "a.tar.partial").symlink_to(victim)  # where the old export wrote its temp file
    invoke_json("export", store, out / "a.tar")
    assert victim.read_text() == "keep me"
    assert sorted(p.name for p in out.iterdir()) == ["a.tar", "a.tar.partial"]  # no temp file left
    assert tarfile.is_tarfile(out / "a.tar")


def test_export_keeps_the_store_permissions_and_replaces_a_regular_file(store: Path, tmp_path: Path) -> None:
    assert stat.S_IMODE(os.stat(store).st_mode) == 0o700
    target = tmp_path / "a.tar"
    target.write_bytes(b"old archive")
    os.chmod(target, 0o644)
    r = invoke_json("export", store, target)
    assert r["blocks"] == 23
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o600  # as the store's files, not 0644
    assert tarfile.is_tarfile(target)


def write_tar(path: Path, members: list[tuple[tarfile.TarInfo, bytes]]) -> int:
    """Writes a tar of ``members``; returns where its end-of-archive blocks start."""
    with tarfile.open(path, "w") as tar:
        for info, data in members:
            info.size = len(data) if info.isreg() else 0
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
        return tar.offset


def member(name: str, **fields: object) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    for key, value in fields.items():
        setattr(info, key, value)
    return info


def test_import_refuses_a_symlink_manifest_member(tmp_path: Path) -> None:
    archive = tmp_path / "a.tar"
    write_tar(archive, [(member("blocks/x"), b"{}"), (member("manifest.json", type=tarfile.SYMTYPE, linkname="nowhere"), b"")])
    result = invoke("import", archive, tmp_path / "dst", expect=2)
    assert "manifest.json is a symlink" in result.stderr
    write_tar(archive, [(member("blocks/x"), b"{}"), (member("manifest.json", type=tarfile.LNKTYPE, linkname="blocks/x"), b"")])
    assert "manifest.json is a hard link" in invoke("import", archive, tmp_path / "dst", expect=2).stderr


def test_import_refuses_a_deeply_nested_manifest(tmp_path: Path) -> None:
    archive = tmp_path / "a.tar"
    write_tar(archive, [(member("manifest.json"), b"[" * 100_000 + b"]" * 100_000)])
    result = invoke("import", archive, tmp_path / "dst", expect=2)
    assert "nested more than 16 levels deep" in result.stderr
    with pytest.raises(ucm_db.ConfigError, match="nested"):  # the API too: never a RecursionError
        maintenance.import_archive(archive, tmp_path / "dst")


def sparse_member_archive(path: Path, first: list[tuple[tarfile.TarInfo, bytes]], name: str, size_bytes: int) -> None:
    """``first``'s members, then a member ``name`` of ``size_bytes`` zero
    bytes written as a hole (the file is sparse: no disk space, no memory)."""
    end = write_tar(path, first)
    with open(path, "r+b") as f:
        f.seek(end)  # over the end-of-archive blocks
        info = tarfile.TarInfo(name)
        info.size = size_bytes
        f.write(info.tobuf())
        padded = -(-size_bytes // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
        f.seek(padded, os.SEEK_CUR)
        f.write(bytes(2 * tarfile.BLOCKSIZE))
        f.truncate()


def test_import_skips_a_block_member_over_the_bound_without_reading_it(store: Path, tmp_path: Path) -> None:
    whole = tmp_path / "whole.tar"
    invoke_json("export", store, whole, "--namespace", "test/alpha")
    with tarfile.open(whole) as tar:
        manifest = json.loads(tar.extractfile("manifest.json").read())  # type: ignore[union-attr]
    big_key = manifest["blocks"][0][0]  # a chain's first block: it and its 4 descendants are skipped
    kept = [(m, tar_bytes(whole, m.name)) for m in tarfile.open(whole).getmembers() if m.name != f"blocks/{big_key}"]
    archive = tmp_path / "big.tar"
    sparse_member_archive(archive, kept, f"blocks/{big_key}", MAX_MEMBER_BYTES + 1)

    r = invoke_json("import", archive, tmp_path / "dst", expect=1)
    reasons = {s["key"]: s["reason"] for s in r["skipped"]}
    assert f"over the {MAX_MEMBER_BYTES} bytes import reads per block" in reasons[big_key]
    assert r["stored"] == 20 - 5 and len(reasons) == 5


def tar_bytes(archive: Path, name: str) -> bytes:
    with tarfile.open(archive) as tar:
        return tar.extractfile(name).read()  # type: ignore[union-attr]


def test_import_refuses_a_manifest_over_the_bound(tmp_path: Path) -> None:
    archive = tmp_path / "a.tar"
    sparse_member_archive(archive, [(member("README"), b"x")], "manifest.json", MAX_MANIFEST_BYTES + 1)
    result = invoke("import", archive, tmp_path / "dst", expect=2)
    assert f"over the bound of {MAX_MANIFEST_BYTES}" in result.stderr


def test_import_of_a_cut_short_archive_is_refused_whole(store: Path, tmp_path: Path) -> None:
    archive = tmp_path / "a.tar"
    invoke_json("export", store, archive, "--namespace", "test/beta")
    with tarfile.open(archive) as tar:
        last = tar.getmembers()[-1]
    os.truncate(archive, last.offset_data + 100)  # the last block's payload cut short
    assert "is a damaged tar archive" in invoke("import", archive, tmp_path / "dst", expect=2).stderr
    assert not (tmp_path / "dst").exists()


def test_blocks_larger_than_a_read_chunk_round_trip(tmp_path: Path) -> None:
    big = hashlib.shake_256(b"big").digest(3 << 20)  # 3 MiB: read in several chunks, incompressible
    keys = chain_keys(NS_A, "big", 2)
    with ucm_db.open(tmp_path / "src") as s:
        s.put(NS_A, keys, [big, big[::-1]])
    invoke_json("export", tmp_path / "src", tmp_path / "a.tar")
    assert invoke_json("import", tmp_path / "a.tar", tmp_path / "dst")["stored"] == 2
    with ucm_db.open(tmp_path / "dst") as s:
        assert s.get(NS_A, keys) == [bytearray(big), bytearray(big[::-1])]


BLOB_BYTES = 64 << 10


def fill(path: Path, tag: str, blocks: int, capacity_bytes: int = 1 << 30) -> list[bytes]:
    """One chain of incompressible 64 KiB blocks."""
    keys = chain_keys(NS_A, tag, blocks)
    with ucm_db.open(path, capacity_bytes=capacity_bytes) as s:
        s.put(NS_A, keys, [hashlib.shake_256(f"{tag}{i}".encode()).digest(BLOB_BYTES) for i in range(blocks)])
    return keys


def test_import_refuses_to_evict_stored_blocks_unless_allowed(tmp_path: Path) -> None:
    new = fill(tmp_path / "src", "new", 8)
    invoke_json("export", tmp_path / "src", tmp_path / "a.tar")
    old = fill(tmp_path / "dst", "old", 10, capacity_bytes=1 << 20)  # ~640 KiB of 1 MiB used; the archive needs ~512 KiB

    result = invoke("import", tmp_path / "a.tar", tmp_path / "dst", expect=1)
    assert "importing would evict stored blocks" in result.stderr and "--allow-evict" in result.stderr
    with ucm_db.open(tmp_path / "dst") as s:
        assert s.lookup(NS_A, old) == 10 and s.lookup(NS_A, new) == 0  # nothing lost, nothing written

    r = invoke_json("import", tmp_path / "a.tar", tmp_path / "dst", "--allow-evict")
    assert r["stored"] == 8 and r["evicted"] > 0
    with ucm_db.open(tmp_path / "dst") as s:
        assert s.lookup(NS_A, new) == 8 and s.lookup(NS_A, old) < 10


def test_import_that_fits_evicts_nothing_and_blocks_already_stored_need_no_room(tmp_path: Path) -> None:
    fill(tmp_path / "src", "new", 8)
    invoke_json("export", tmp_path / "src", tmp_path / "a.tar")
    fill(tmp_path / "dst", "new", 8, capacity_bytes=1 << 20)  # the same blocks: 512 KiB of 1 MiB used
    r = invoke_json("import", tmp_path / "a.tar", tmp_path / "dst")
    assert r["already_present"] == 8 and r["evicted"] == 0 and r["skipped"] == []


def test_brackets_and_escapes_inside_manifest_strings_do_not_count_as_nesting(tmp_path: Path) -> None:
    odd = ucm_db.Namespace(model='odd/"[[[[[[[[[[[[[[[[[[[[\\', kv_dtype="bfloat16", block_size=16)
    keys = chain_keys(odd, "odd", 2)
    with ucm_db.open(tmp_path / "src") as s:
        s.put(odd, keys, [b"x" * 4096, b"y" * 4096])
    invoke_json("export", tmp_path / "src", tmp_path / "a.tar")
    assert invoke_json("import", tmp_path / "a.tar", tmp_path / "dst")["stored"] == 2


def test_import_refuses_a_manifest_just_over_the_depth_bound(tmp_path: Path) -> None:
    archive = tmp_path / "a.tar"
    deep: object = 1
    for _ in range(17):
        deep = [deep]
    write_tar(archive, [(member("manifest.json"), json.dumps({"format": "ucm-db-export", "x": deep}).encode())])
    assert "nested more than 16 levels deep" in invoke("import", archive, tmp_path / "dst", expect=2).stderr


def test_import_skips_blocks_across_namespaces_and_stores_the_rest(tmp_path: Path) -> None:
    """A block the store would refuse as crossing namespaces (its parent, per
    an altered manifest, is another namespace's block; or its key is stored
    here under another namespace) is skipped with its descendants: never a
    ConfigError after earlier batches were written."""
    x = ucm_db.Namespace(model="x", kv_dtype="bfloat16", block_size=4)
    y = ucm_db.Namespace(model="y", kv_dtype="bfloat16", block_size=4)
    keys_x, keys_y = x.block_keys(list(range(8))), y.block_keys(list(range(100, 108)))
    with ucm_db.open(tmp_path / "src", codec="none") as src:
        src.put(x, keys_x, [b"x" * 64] * 2)
        src.put(y, keys_y, [b"y" * 64] * 2)
    plain = tmp_path / "plain.tar"
    maintenance.export_archive(tmp_path / "src", plain)
    manifest = json.loads(tar_bytes(plain, "manifest.json"))
    rows = {bytes.fromhex(r[0]): r for r in manifest["blocks"]}
    rows[keys_x[0]][1] = keys_y[-1].hex()  # x's root now claims y's last block as its parent
    manifest["blocks"] = [rows[k] for k in keys_y + keys_x]
    altered = tmp_path / "altered.tar"
    write_tar(altered, [(member("manifest.json"), json.dumps(manifest).encode())]
              + [(member(f"blocks/{k.hex()}"), tar_bytes(plain, f"blocks/{k.hex()}")) for k in keys_y + keys_x])
    report = maintenance.import_archive(altered, tmp_path / "dst")
    assert report["stored"] == 2 and {s["key"] for s in report["skipped"]} == {k.hex() for k in keys_x}
    # The second case: x's root is already stored here, under y (keys built for another namespace).
    with ucm_db.open(tmp_path / "dst2", codec="none") as dst:
        dst.put(y, keys_x[:1], [b"z" * 64], parent=None)
    report = maintenance.import_archive(plain, tmp_path / "dst2")
    assert report["stored"] == 2 and {s["key"] for s in report["skipped"]} == {k.hex() for k in keys_x}
    with ucm_db.open(tmp_path / "dst2") as dst:
        assert dst.get(y, keys_x[:1]) == [b"z" * 64]


@pytest.mark.parametrize("inside", ["lmdb/data.mdb", "ucm-db.lock", "archive.tar"])
def test_export_refuses_a_target_inside_a_store_and_the_store_still_opens(store: Path, tmp_path: Path, inside: str) -> None:
    """An archive written over a store's data file (or its lock file, or
    anywhere in its directory) destroyed that store: the source's own, here."""
    before = (store / "lmdb" / "data.mdb").read_bytes()
    result = invoke("export", store, store / inside, expect=2)
    assert "lies inside the ucm-db store" in result.stderr and "outside every store directory" in result.stderr
    assert (store / "lmdb" / "data.mdb").read_bytes() == before and not (store / "archive.tar").exists()
    with ucm_db.open(store) as reopened:
        assert reopened.lookup(NS_A, chain_keys(NS_A, "a0", 5)) == 5


def test_export_into_a_read_only_directory_is_a_usage_error(store: Path, tmp_path: Path) -> None:
    """Audit F13: a destination that cannot be written exited 1; cli.md says 2."""
    from readonly_mount import read_only_view, tree

    def files() -> dict[str, tuple[int, int]]:
        return {name: seen for name, seen in tree(store).items() if name != "lmdb/lock.mdb"}  # LMDB's reader table

    (tmp_path / "out").mkdir()
    before = files()
    with read_only_view(tmp_path / "out", tmp_path / "ro") as view:
        error = invoke_json("export", store, view / "x.tar", expect=2)["error"]
    assert error["type"] == "ConfigError" and "Read-only file system" in error["message"]
    assert error["message"].startswith(f"cannot write {tmp_path / 'ro' / 'x.tar'}") and "mounted read-write" in error["hint"]
    assert list((tmp_path / "out").iterdir()) == [] and files() == before


@pytest.mark.parametrize(("code", "exit_code"), [("EACCES", 2), ("EPERM", 2), ("ENOSPC", 1), ("EIO", 1)])
def test_export_temp_file_errors_a_user_can_fix_exit_2_and_the_disks_exit_1(
        store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: str, exit_code: int) -> None:
    import errno

    real_open = os.open

    def refusing_open(path: object, flags: int, *args: object, **kwargs: object) -> int:
        if str(path).endswith(".partial"):  # the export's temp file alone
            raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)), str(path))
        return real_open(path, flags, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", refusing_open)
    error = invoke_json("export", store, tmp_path / "x.tar", expect=exit_code)["error"]
    assert error["type"] == ("ConfigError" if exit_code == 2 else "TierError")
    assert os.strerror(getattr(errno, code)) in error["message"]
    assert not (tmp_path / "x.tar").exists()
