"""The CLI with an auth key (issue 26 item 6): export/import archives carry
MACs, and import with a key refuses what the key did not sign; warm with a
key pulls only signed remote objects. Through the real CLI; tampering as
anyone with write access to the archive or the remote could (valid codec
checksums recomputed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import ucm_db
from ucm_db import codec

from cli_stores import NS_A, NS_B, invoke, invoke_json, make_store, payload
from test_cli_archive_migrate import rewrite_member

KEY = bytes(range(32))
OLD_KEY = bytes(range(50, 82))


def key_file(tmp_path: Path, *keys: bytes, name: str = "auth.key") -> Path:
    path = tmp_path / name
    path.write_text("".join(k.hex() + "\n" for k in keys))
    path.chmod(0o600)
    return path


@pytest.fixture
def signed(tmp_path: Path) -> tuple[dict[str, list[bytes]], Path, Path]:
    chains = make_store(tmp_path / "src")
    archive, key = tmp_path / "all.tar", key_file(tmp_path, KEY)
    r = invoke_json("export", tmp_path / "src", archive, "--auth-key-file", key)
    assert r["authenticated"] is True
    return chains, archive, key


def test_signed_round_trip(tmp_path: Path, signed: tuple[dict[str, list[bytes]], Path, Path]) -> None:
    chains, archive, key = signed
    r = invoke_json("import", archive, tmp_path / "dst", "--auth-key-file", key)
    assert r["stored"] == 23 and r["skipped"] == []
    with ucm_db.open(tmp_path / "dst") as store:
        assert store.get(NS_B, chains["b0"]) == [bytearray(payload("b0", i)) for i in range(3)]
    # Without a key the MAC member is ignored.
    assert invoke_json("import", archive, tmp_path / "dst2")["stored"] == 23


def test_unsigned_or_wrongly_signed_archive_is_refused_with_a_key(tmp_path: Path, signed: tuple[dict[str, list[bytes]], Path, Path]) -> None:
    _chains, signed_archive, key = signed
    unsigned = tmp_path / "unsigned.tar"
    invoke_json("export", tmp_path / "src", unsigned)
    r = invoke("import", unsigned, tmp_path / "dst", "--auth-key-file", key, expect=2)
    assert "carries no MAC" in r.stderr
    r = invoke("import", signed_archive, tmp_path / "dst", "--auth-key-env", "UCM_TEST_ARCHIVE_KEY", expect=2)
    assert "UCM_TEST_ARCHIVE_KEY" in r.stderr  # not set
    wrong = key_file(tmp_path, OLD_KEY, name="wrong.key")
    r = invoke("import", signed_archive, tmp_path / "dst", "--auth-key-file", wrong, expect=2)
    assert "not made by any given auth key" in r.stderr
    assert not (tmp_path / "dst").exists()  # refused before a store was created


def test_altered_manifest_is_refused(tmp_path: Path, signed: tuple[dict[str, list[bytes]], Path, Path]) -> None:
    chains, archive, key = signed

    def drop_a_block(data: bytes) -> bytes:  # still a valid manifest
        manifest = json.loads(data)
        manifest["blocks"] = manifest["blocks"][:-1]
        return json.dumps(manifest).encode()

    rewrite_member(archive, "manifest.json", drop_a_block)
    r = invoke("import", archive, tmp_path / "dst", "--auth-key-file", key, expect=2)
    assert "manifest's MAC" in r.stderr


def test_forged_block_with_recomputed_checksums_is_skipped_with_a_key(tmp_path: Path, signed: tuple[dict[str, list[bytes]], Path, Path]) -> None:
    chains, archive, key = signed
    target = chains["a1"][1]
    forged = b"forged KV ".ljust(4096, b"!")
    rewrite_member(archive, f"blocks/{target.hex()}", lambda _: bytes(codec.encode(target, forged, codec="none")))

    r = invoke_json("import", archive, tmp_path / "dst", "--auth-key-file", key, expect=1)
    assert [s["key"] for s in r["skipped"]] == [k.hex() for k in chains["a1"][1:]]
    assert r["skipped"][0]["reason"].startswith("unauthenticated")
    with ucm_db.open(tmp_path / "dst") as store:
        assert store.lookup(NS_A, chains["a1"]) == 1
    # Without a key the forgery is imported and served: what the key is for.
    invoke_json("import", archive, tmp_path / "open", expect=0)
    with ucm_db.open(tmp_path / "open") as store:
        assert store.get(NS_A, chains["a1"][:2])[1] == bytearray(forged)


def test_archive_signed_with_an_old_key_imports_during_rotation(tmp_path: Path) -> None:
    make_store(tmp_path / "src")
    archive = tmp_path / "old.tar"
    invoke_json("export", tmp_path / "src", archive, "--auth-key-file", key_file(tmp_path, OLD_KEY, name="old.key"))
    rotated = key_file(tmp_path, KEY, OLD_KEY, name="rotated.key")
    assert invoke_json("import", archive, tmp_path / "dst", "--auth-key-file", rotated)["stored"] == 23


def test_world_readable_key_file_is_refused(tmp_path: Path) -> None:
    make_store(tmp_path / "src")
    key = key_file(tmp_path, KEY)
    key.chmod(0o644)
    r = invoke("export", tmp_path / "src", tmp_path / "x.tar", "--auth-key-file", key, expect=2)
    assert "readable by everyone" in r.stderr and "chmod 600" in r.stderr
    assert not (tmp_path / "x.tar").exists()


def test_warm_with_a_key_pulls_only_signed_objects(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'remote'}"
    key = key_file(tmp_path, KEY)
    tokens = [[(11 * p + i) % 30000 for i in range(NS_A.block_size * 3)] for p in range(2)]
    chains = [NS_A.block_keys(t) for t in tokens]
    # The intruder wrote first: once a keyed node has used the remote, a keyless one is refused at open.
    with ucm_db.open(tmp_path / "intruder", remote=url, remote_mode="write_through", capacity_bytes=1 << 26) as intruder:
        intruder.put(NS_A, chains[1], [payload("x", i) for i in range(3)])  # unsigned, checksums all valid
    with ucm_db.open(tmp_path / "signer", remote=url, remote_mode="write_through", capacity_bytes=1 << 26,
                     remote_auth_key_file=str(key)) as source:
        source.put(NS_A, chains[0], [payload("s", i) for i in range(3)])
    tokens_file = tmp_path / "prompts.jsonl"
    tokens_file.write_text("\n".join(json.dumps(t) for t in tokens))

    invoke_json("warm", tmp_path / "b", "--remote", url, "--namespace", "test/alpha", "--tokens", tokens_file, "--auth-key-file", key)
    with ucm_db.open(tmp_path / "b") as store:
        assert store._tier.count_prefix(chains[0]) == 3 and store._tier.count_prefix(chains[1]) == 0


def test_keyless_warm_of_a_keyed_store_is_refused(tmp_path: Path) -> None:
    """Issue 46 finding 3 through the CLI: a keyless `ucm-db warm` of a
    keyed node's store is a usage error naming the fix, and pulls nothing."""
    url = f"file://{tmp_path / 'remote'}"
    key = key_file(tmp_path, KEY)
    tokens = [(5 * i) % 30000 for i in range(NS_A.block_size * 2)]
    with ucm_db.open(tmp_path / "node", remote=url, remote_mode="write_through", capacity_bytes=1 << 26,
                     remote_auth_key_file=str(key)) as store:
        store.put(NS_A, NS_A.block_keys(tokens), [payload("k", i) for i in range(2)])
    (tmp_path / "remote" / "auth.json").unlink()  # even without the remote's marker: the store remembers
    tokens_file = tmp_path / "prompts.jsonl"
    tokens_file.write_text(json.dumps(tokens))
    result = invoke("warm", tmp_path / "node", "--remote", url, "--namespace", "test/alpha", "--tokens", tokens_file, expect=2)
    assert "auth key" in result.stderr and "--auth-key-file" in result.stderr
