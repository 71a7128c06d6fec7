"""The CLI with an encryption key (issue 46): ``export --encryption-key-file``
writes a version 3 archive whose block members are sealed (AES-256-GCM);
``import`` needs the key (refused without it, before a store is created),
refuses a key for a plain archive, and skips a member no key opens for its
manifest row. Tampering as anyone who can write the archive could."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

import ucm_db

from cli_stores import NS_A, NS_B, invoke, invoke_json, make_store, payload
from test_cli_archive_migrate import rewrite_member

KEY = bytes(range(32))
OLD_KEY = bytes(range(50, 82))
MAC_KEY = b"\x2a" * 32


def key_file(tmp_path: Path, *keys: bytes, name: str = "encryption.key") -> Path:
    path = tmp_path / name
    path.write_text("".join(k.hex() + "\n" for k in keys))
    path.chmod(0o600)
    return path


def _members(archive: Path) -> dict[str, bytes]:
    with tarfile.open(archive) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers()}  # type: ignore[union-attr]


@pytest.fixture
def sealed(tmp_path: Path) -> tuple[dict[str, list[bytes]], Path, Path]:
    chains = make_store(tmp_path / "src")
    archive, key = tmp_path / "all.tar", key_file(tmp_path, KEY)
    r = invoke_json("export", tmp_path / "src", archive, "--encryption-key-file", key)
    assert r["encrypted"] is True and r["authenticated"] is False and r["blocks"] == 23
    return chains, archive, key


def test_encrypted_export_hides_the_kv_and_round_trips(tmp_path: Path, sealed: tuple[dict[str, list[bytes]], Path, Path]) -> None:
    chains, archive, key = sealed
    members = _members(archive)
    manifest = json.loads(members["manifest.json"])
    assert manifest["version"] == 3 and manifest["encryption"]["cipher"] == "AES-256-GCM"
    blob = b"".join(v for k, v in members.items() if k.startswith("blocks/"))
    assert payload("b0", 1)[:64] not in blob and payload("a0", 0)[:64] not in blob
    r = invoke_json("import", archive, tmp_path / "dst", "--encryption-key-file", key)
    assert r["stored"] == 23 and r["skipped"] == [] and r["encrypted"] is True
    with ucm_db.open(tmp_path / "dst") as store:
        assert store.get(NS_B, chains["b0"]) == [bytearray(payload("b0", i)) for i in range(3)]


def test_import_without_the_key_or_with_another_is_refused(tmp_path: Path, sealed: tuple[dict[str, list[bytes]], Path, Path]) -> None:
    _chains, archive, _key = sealed
    r = invoke("import", archive, tmp_path / "dst", expect=2)
    assert "is encrypted" in r.stderr and "--encryption-key-file" in r.stderr
    wrong = key_file(tmp_path, OLD_KEY, name="wrong.key")
    r = invoke("import", archive, tmp_path / "dst", "--encryption-key-file", wrong, expect=2)
    assert "no given encryption key has" in r.stderr
    r = invoke("import", archive, tmp_path / "dst", "--encryption-key-env", "UCM_TEST_ENCRYPTION_KEY", expect=2)
    assert "UCM_TEST_ENCRYPTION_KEY" in r.stderr  # not set
    assert not (tmp_path / "dst").exists()  # refused before a store was created


def test_a_key_for_a_plain_archive_is_refused(tmp_path: Path) -> None:
    make_store(tmp_path / "src")
    plain = tmp_path / "plain.tar"
    assert invoke_json("export", tmp_path / "src", plain)["encrypted"] is False
    r = invoke("import", plain, tmp_path / "dst", "--encryption-key-file", key_file(tmp_path, KEY), expect=2)
    assert "is not encrypted" in r.stderr
    assert not (tmp_path / "dst").exists()


def test_tampered_or_moved_members_are_skipped(tmp_path: Path, sealed: tuple[dict[str, list[bytes]], Path, Path]) -> None:
    chains, archive, key = sealed

    def flip(data: bytes) -> bytes:
        return data[:100] + bytes([data[100] ^ 1]) + data[101:]

    rewrite_member(archive, f"blocks/{chains['a1'][2].hex()}", flip)
    moved = _members(archive)[f"blocks/{chains['a2'][0].hex()}"]  # a valid member, under another row
    rewrite_member(archive, f"blocks/{chains['a3'][0].hex()}", lambda _: moved)
    r = invoke_json("import", archive, tmp_path / "dst", "--encryption-key-file", key, expect=1)
    skipped = {s["key"]: s["reason"] for s in r["skipped"]}
    assert set(skipped) == {k.hex() for k in chains["a1"][2:] + chains["a3"]}
    assert skipped[chains["a1"][2].hex()].startswith("undecryptable") and skipped[chains["a3"][0].hex()].startswith("undecryptable")
    assert r["stored"] == 23 - 3 - 5
    with ucm_db.open(tmp_path / "dst") as store:
        assert store.lookup(NS_A, chains["a1"]) == 2 and store.lookup(NS_A, chains["a3"]) == 0


def test_an_altered_epoch_no_longer_opens(tmp_path: Path, sealed: tuple[dict[str, list[bytes]], Path, Path]) -> None:
    """Without a MAC the manifest can be edited; the epoch is bound into
    every member, so an archive claiming another epoch imports nothing of it."""
    _chains, archive, key = sealed

    def raise_epoch(data: bytes) -> bytes:
        manifest = json.loads(data)
        ns_hex = NS_B.digest[:16].hex()
        manifest["epochs"][ns_hex] += 7
        return json.dumps(manifest).encode()

    rewrite_member(archive, "manifest.json", raise_epoch)
    r = invoke_json("import", archive, tmp_path / "dst", "--encryption-key-file", key, expect=1)
    assert r["stored"] == 20 and len(r["skipped"]) == 3
    assert r["skipped"][0]["reason"].startswith("undecryptable")  # its chain's root; the rest as "parent missing"
    assert all(s["reason"] == "parent block missing or bad" for s in r["skipped"][1:])


def test_rotation_and_both_keys(tmp_path: Path) -> None:
    chains = make_store(tmp_path / "src")
    archive = tmp_path / "old.tar"
    mac = key_file(tmp_path, MAC_KEY, name="auth.key")
    r = invoke_json("export", tmp_path / "src", archive, "--encryption-key-file", key_file(tmp_path, OLD_KEY, name="old.key"),
                    "--auth-key-file", mac)
    assert r["encrypted"] and r["authenticated"]
    rotated = key_file(tmp_path, KEY, OLD_KEY, name="rotated.key")
    r = invoke_json("import", archive, tmp_path / "dst", "--encryption-key-file", rotated, "--auth-key-file", mac)
    assert r["stored"] == 23
    with ucm_db.open(tmp_path / "dst") as store:
        assert store.get(NS_A, chains["a0"][:1]) == [bytearray(payload("a0", 0))]
    # The MAC covers the sealed member: a flipped byte fails it first.
    rewrite_member(archive, f"blocks/{chains['b0'][0].hex()}", lambda d: d[:-1] + bytes([d[-1] ^ 1]))
    r = invoke_json("import", archive, tmp_path / "dst2", "--encryption-key-file", rotated, "--auth-key-file", mac, expect=1)
    assert r["skipped"][0]["reason"].startswith("unauthenticated") and len(r["skipped"]) == 3


def test_help_names_the_flags() -> None:
    for command in ("export", "import", "warm"):
        out = invoke(command, "--help").stdout
        assert "--encryption-key-file" in out and "--encryption-key-env" in out


#: A serving node: opens its store with an encrypted remote, puts, and
#: (UCM_DB_CRASH_AT) is killed at its third remote write, the first
#: block's after the root's encryption marker and the namespace manifest:
#: the chain stays queued.
_SERVE = """
import json, sys, time, ucm_db
spec = json.loads(sys.argv[1])
store = ucm_db.open(spec["store"], remote=spec["remote"], capacity_bytes=1 << 26, codec="none", upload_concurrency=1,
                    remote_encryption_key_file=spec["key"])
ns = ucm_db.Namespace.from_dict(spec["namespace"])
store.put(ns, ns.block_keys(spec["tokens"]), [bytes.fromhex(p) for p in spec["payloads"]])
time.sleep(60)
"""


@pytest.fixture
def crashed_node(tmp_path: Path) -> tuple[str, Path, Path, list[bytes]]:
    """The audit's setup for ``warm``: a node with an encrypted remote died
    with its uploads queued. Returns the remote URL, the key file, a
    ``--tokens`` file of the chain's prompt and the chain's keys."""
    url, key = f"file://{tmp_path / 'remote'}", key_file(tmp_path, KEY)
    tokens = [(13 * i + 5) % 30000 for i in range(NS_A.block_size * 3)]
    keys = NS_A.block_keys(tokens)
    spec = {"store": str(tmp_path / "node"), "remote": url, "key": str(key), "namespace": NS_A.to_dict(),
            "tokens": tokens, "payloads": [payload("q", i).hex() for i in range(3)]}
    env = dict(os.environ, UCM_DB_CRASH_AT="remote.during_upload:3")  # after the root's encryption marker and the manifest
    node = subprocess.run([sys.executable, "-c", _SERVE, json.dumps(spec)], env=env, capture_output=True, text=True, timeout=60)
    assert node.returncode == -signal.SIGKILL, node.stderr[-2000:]
    assert _remote_objects(tmp_path) == []
    tokens_file = tmp_path / "prompts.jsonl"
    tokens_file.write_text(json.dumps(tokens) + "\n")
    return url, key, tokens_file, keys


def _remote_objects(tmp_path: Path) -> list[bytes]:
    return [p.read_bytes() for p in (tmp_path / "remote").rglob("*") if p.is_file() and len(p.name) == 64]


def test_warm_without_the_key_of_an_encrypted_store_is_refused(tmp_path: Path, crashed_node: tuple[str, Path, Path, list[bytes]]) -> None:
    """`ucm-db warm` opened the store with its remote and no encryption key:
    its uploader sent the queued KV to the bucket as plaintext (format 1),
    which keyed nodes then miss. Now a usage error naming the option, and
    nothing is uploaded."""
    url, _key, tokens_file, _keys = crashed_node
    r = invoke("warm", tmp_path / "node", "--remote", url, "--namespace", "test/alpha", "--tokens", tokens_file, expect=2)
    assert "encryption key" in r.stderr and "--encryption-key-file" in r.stderr
    assert _remote_objects(tmp_path) == []


def test_warm_with_the_key_uploads_the_queue_sealed(tmp_path: Path, crashed_node: tuple[str, Path, Path, list[bytes]]) -> None:
    url, key, tokens_file, keys = crashed_node
    invoke_json("warm", tmp_path / "node", "--remote", url, "--namespace", "test/alpha", "--tokens", tokens_file,
                "--encryption-key-file", key)
    with ucm_db.open(tmp_path / "node", remote=url, remote_encryption_key_file=str(key)) as store:
        store.flush(upload_timeout_s=60)  # whatever warm's close left queued
    objects = _remote_objects(tmp_path)
    assert len(objects) == 3
    assert all(int.from_bytes(o[4:6], "little") == 3 for o in objects)  # format 3: sealed
    assert not any(payload("q", i)[:64] in o for o in objects for i in range(3))
    with ucm_db.open(tmp_path / "reader", remote=url, capacity_bytes=1 << 26, remote_encryption_key_file=str(key)) as reader:
        assert reader.get(NS_A, keys) == [bytearray(payload("q", i)) for i in range(3)]
        assert reader.stats().remote["unencrypted"] == 0
