"""export/import round trips and verification; migrate and engine conversion."""

from __future__ import annotations

import io
import json
import shutil
import tarfile
from pathlib import Path

import pytest

import ucm_db
from ucm_db import migrations

from cli_stores import NS_A, NS_B, invoke, invoke_json, make_store, payload

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "stores"


def rewrite_member(archive: Path, name: str, change: object) -> None:
    """Rewrites one member of a tar archive through ``change(bytes) -> bytes``."""
    with tarfile.open(archive) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]  # type: ignore[union-attr]
    with tarfile.open(archive, "w") as tar:
        for member, data in members:
            if member.name == name:
                data = change(data)  # type: ignore[operator]
                member.size = len(data)
            tar.addfile(member, io.BytesIO(data))


def test_export_import_round_trip_of_chosen_namespace(tmp_path: Path) -> None:
    chains = make_store(tmp_path / "src")
    archive = tmp_path / "beta.tar"
    r = invoke_json("export", tmp_path / "src", archive, "--namespace", "test/beta")
    assert r["blocks"] == 3 and list(r["namespaces"]) == [NS_B.digest[:16].hex()]

    r = invoke_json("import", archive, tmp_path / "dst")
    assert r["stored"] == 3 and r["skipped"] == []
    with ucm_db.open(tmp_path / "dst") as store:
        assert store.get(NS_B, chains["b0"]) == [bytearray(payload("b0", i)) for i in range(3)]
        assert store.lookup(NS_A, chains["a0"]) == 0
        assert store._tier.check() == []
    assert invoke_json("import", archive, tmp_path / "dst")["already_present"] == 3  # idempotent


@pytest.mark.parametrize("engine", ["lmdb", "rocksdb"])
def test_import_skips_a_corrupt_block_and_its_descendants(tmp_path: Path, engine: str) -> None:
    chains = make_store(tmp_path / "src")
    archive = tmp_path / "all.tar"
    invoke_json("export", tmp_path / "src", archive)
    bad = chains["a2"][2]
    rewrite_member(archive, f"blocks/{bad.hex()}", lambda b: b[:-1] + bytes([b[-1] ^ 1]))
    ucm_db.open(tmp_path / "dst", engine=engine).close()

    r = invoke_json("import", archive, tmp_path / "dst", expect=1)
    assert sorted(s["key"] for s in r["skipped"]) == sorted(k.hex() for k in chains["a2"][2:])
    assert r["stored"] == 23 - 3
    with ucm_db.open(tmp_path / "dst") as store:
        assert store.lookup(NS_A, chains["a2"]) == 2 and store._tier.check() == []


def test_import_refuses_a_namespace_that_does_not_match_its_id(tmp_path: Path) -> None:
    make_store(tmp_path / "src")
    archive = tmp_path / "all.tar"
    invoke_json("export", tmp_path / "src", archive)

    def retarget(data: bytes) -> bytes:
        manifest = json.loads(data)
        for desc in manifest["namespaces"].values():
            desc["model"] = "someone/else"
        return json.dumps(manifest).encode()

    rewrite_member(archive, "manifest.json", retarget)
    result = invoke("import", archive, tmp_path / "dst", expect=2)
    assert "does not match its description" in result.stderr
    assert not (tmp_path / "dst").exists()


def test_migrate_command_on_the_format1_fixture(tmp_path: Path) -> None:
    shutil.copytree(FIXTURES / "format1-lmdb", tmp_path / "old")
    dry = invoke_json("migrate", tmp_path / "old", "--dry-run")
    assert [m["name"] for m in dry["pending"]] == ["created_record", "split_heads"] and dry["applied_now"] == []
    assert invoke("verify", tmp_path / "old", "--fix", expect=2).stderr.count("ucm-db migrate") == 1
    r = invoke_json("migrate", tmp_path / "old")
    assert r["applied_now"] == [2, 3] and [a["name"] for a in r["applied"]] == ["created_record", "split_heads"]
    assert "nothing to migrate" in invoke("migrate", tmp_path / "old").stdout
    assert invoke_json("verify", tmp_path / "old")["checked"] == 11


def test_migrate_refuses_while_the_store_is_open(tmp_path: Path) -> None:
    make_store(tmp_path / "s")
    with ucm_db.open(tmp_path / "s"):
        result = invoke("migrate", tmp_path / "s", expect=2)
    assert "is open in pid" in result.stderr


def test_engine_conversion_round_trip_preserves_everything(tmp_path: Path) -> None:
    chains = make_store(tmp_path / "lmdb")
    with ucm_db.open(tmp_path / "lmdb") as store:
        store._tier.quarantine(b"q" * 32, "kept across conversion", lambda head, body: True)
        all_keys = [k for keys in chains.values() for k in keys]
        metas_before = store._tier.metas(all_keys)

    r = invoke_json("migrate", "--to-engine", "rocksdb", tmp_path / "lmdb", tmp_path / "rocks")
    assert r["blocks_verified"] == 23 and r["tables"]["blocks"] == 23
    r = invoke_json("migrate", "--to-engine", "lmdb", tmp_path / "rocks", tmp_path / "back")
    assert r["blocks_verified"] == 23

    for name, engine in (("rocks", "rocksdb"), ("back", "lmdb")):
        with ucm_db.open(tmp_path / name) as store:
            assert store.config.engine == engine
            assert store._tier.metas(all_keys) == metas_before  # LRU times, hits, sizes, parents
            assert b"q" * 32 in store._tier.quarantine_records()
            assert store.stats().hits == 6
            assert store.get(NS_A, chains["a3"]) == [bytearray(payload("a3", i)) for i in range(5)]
    assert migrations.pending(tmp_path / "rocks") == []

    refused = invoke("migrate", "--to-engine", "rocksdb", tmp_path / "lmdb", tmp_path / "rocks", expect=2)
    assert "not empty" in refused.stderr
    usage = invoke("migrate", "--to-engine", "rocksdb", tmp_path / "lmdb", expect=2)
    assert "destination" in usage.stderr


def test_engine_conversion_refuses_an_altered_settings_record(tmp_path: Path) -> None:
    """The copy renews the settings record's checksum: converting a store
    whose record no longer matches its checksum would launder the change."""
    make_store(tmp_path / "lmdb")
    with ucm_db.open(tmp_path / "lmdb") as store:
        def alter(txn) -> None:
            settings = json.loads(bytes(txn.get("info", b"settings")))
            settings["codec"] = "none" if settings["codec"] == "zstd" else "zstd"
            txn.put("info", b"settings", json.dumps(settings, sort_keys=True).encode())

        store._tier.engine.write(alter)
    refused = invoke("migrate", "--to-engine", "rocksdb", tmp_path / "lmdb", tmp_path / "rocks", expect=1)  # a failed migration
    assert "settings record" in refused.stderr and not (tmp_path / "rocks").exists()


def test_import_of_a_member_larger_than_the_memory_limit_skips_it_without_a_traceback(tmp_path: Path) -> None:
    """Issue 46 finding 11: importing a 500 MiB member under a 400 MB data
    limit ended in a MemoryError traceback. The block is skipped and named;
    the others import. A child process runs under the limit (RLIMIT_DATA)."""
    import subprocess
    import sys

    make_store(tmp_path / "src")
    archive = tmp_path / "beta.tar"
    invoke_json("export", tmp_path / "src", archive, "--namespace", "test/beta")
    with tarfile.open(archive) as tar:
        victim = next(m.name for m in tar.getmembers() if m.name.startswith("blocks/"))
    rewrite_member(archive, victim, lambda data: data + bytes((160 << 20) - len(data)))  # 160 MiB
    script = (
        "import resource, sys\n"
        "from ucm_db.tools.cli import main\n"
        "used = int(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmData'))) * 1024\n"
        "resource.setrlimit(resource.RLIMIT_DATA, (used + (96 << 20), resource.RLIM_INFINITY))\n"
        "sys.exit(main(['import', sys.argv[1], sys.argv[2], '--json']))\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(archive), str(tmp_path / "dst")], capture_output=True, text=True,
                          timeout=300)
    assert "Traceback" not in done.stderr and "MemoryError" not in done.stderr, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert any("does not fit in this process's memory" in str(s) for s in report["skipped"]), report


def test_convert_with_dry_run_is_refused_and_writes_nothing(tmp_path: Path) -> None:
    """--dry-run with --to-engine converted for real (DEST written, exit 0)."""
    make_store(tmp_path / "s")
    error = invoke_json("migrate", "--to-engine", "rocksdb", "--dry-run", tmp_path / "s", tmp_path / "d", expect=2)["error"]
    assert "does not apply to --to-engine" in error["message"] and error["hint"]
    assert not (tmp_path / "d").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["s"]


@pytest.mark.parametrize("dest", ["afile/sub", "y" * 300])
def test_convert_into_a_destination_that_cannot_be_created_is_a_usage_error(tmp_path: Path, dest: str) -> None:
    """A file on DEST's path, a name too long: tracebacks from mkdir before."""
    make_store(tmp_path / "s")
    (tmp_path / "afile").write_text("x")
    result = invoke("migrate", "--to-engine", "rocksdb", tmp_path / "s", tmp_path / dest, expect=2)
    assert "cannot create the destination" in result.stderr and "hint:" in result.stderr
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir()), "no temp copy left behind"
