"""Keyed authentication of remote objects (issue 26 item 6).

A real writer signs its uploads; an attacker who can write the bucket but
holds no key plants an object with valid unkeyed checksums (built with the
library's own object packer: what anyone can recompute). With a key set a
reader serves only objects one of its keys signed; without one the plant
is served (the attack the keys exist for). On ``memory://``, a ``file://``
directory and a real S3 endpoint (moto).
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any

import pytest

import ucm_db
from ucm_db import codec
from ucm_db.errors import ConfigError
from ucm_db.remote.keying import MARKER_NAME
from ucm_db.remote.tier import RemoteRoot, write_whole
from ucm_db.remote.envelope import SIGNED_FORMAT_VERSION, pack_object
from ucm_db.auth import AuthKeys, key_id

from .conftest import Remote, chain, key_file, read_through, write_through

pytestmark = pytest.mark.timeout(120)
CAP = 64 << 20
OLD_KEY = bytes(range(32))
NEW_KEY = bytes(range(100, 164))
OTHER_KEY = b"\x07" * 32








def _plant(remote: Remote, namespace: Any, key: bytes, parent: bytes | None, payload: bytes, keys: AuthKeys | None = None) -> None:
    """What a bucket writer without our key can do: a whole object whose
    envelope and codec checksums are right for ``key``."""
    root = RemoteRoot.from_url(remote.url, remote.options)
    ns_id = namespace.digest[:16]
    blob = codec.encode(key, payload, codec="none")
    write_whole(root.fs, root.object_path(ns_id, key), pack_object(key, parent, ns_id, blob, keys))


def test_planted_object_with_recomputed_checksums_is_a_miss_when_a_key_is_set(tmp_path: Path, remote: Remote, namespace: Any) -> None:
    keys, payloads = chain(namespace, 4, seed=3)
    auth = {"remote_auth_key_file": key_file(tmp_path, NEW_KEY)}
    write_through(tmp_path, "writer", remote, namespace, keys, payloads, **auth)
    forged = b"forged KV " * 100
    _plant(remote, namespace, keys[1], keys[0], forged)

    got, stats = read_through(tmp_path, "reader", remote, namespace, keys, **auth)
    assert got == [payloads[0], None, payloads[2], payloads[3]]  # only the plant is refused
    assert stats["unauthenticated"] >= 1 and stats["corrupt"] == 0
    with ucm_db.open(tmp_path / "looker", capacity_bytes=CAP, **remote.store_options(remote_deadline_s=10, **auth)) as store:
        assert store.lookup(namespace, keys) == 1  # a lookup promotes only the authentic prefix

    # Without a key a node is refused: the remote is keyed (issue 46 findings 3 and 4).
    with pytest.raises(ConfigError, match="is keyed"):
        read_through(tmp_path, "open-reader", remote, namespace, keys)

    # A plant signed with a key the reader does not hold is a miss too.
    _plant(remote, namespace, keys[1], keys[0], forged, AuthKeys((OTHER_KEY,), "test"))
    got, stats = read_through(tmp_path, "reader2", remote, namespace, keys, **auth)
    assert got == [payloads[0], None, payloads[2], payloads[3]]
    assert stats["mac_mismatch"] >= 1 and stats["corrupt"] == 0


def test_signed_objects_verify_across_a_key_rotation(tmp_path: Path, remote: Remote, namespace: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    old_keys, old_payloads = chain(namespace, 3, seed=4)
    new_keys, new_payloads = chain(namespace, 3, seed=40)
    write_through(tmp_path, "old-writer", remote, namespace, old_keys, old_payloads, remote_auth_key_file=key_file(tmp_path, OLD_KEY, name="old.key"))
    rotated = key_file(tmp_path, NEW_KEY, OLD_KEY, name="rotated.key")
    write_through(tmp_path, "new-writer", remote, namespace, new_keys, new_payloads, remote_auth_key_file=rotated)

    root = RemoteRoot.from_url(remote.url, remote.options)
    ns_id = namespace.digest[:16]
    for keys, signer in ((old_keys, OLD_KEY), (new_keys, NEW_KEY)):  # uploads sign with the first key
        for k in keys:
            data = root.fs.cat_file(root.object_path(ns_id, k))
            assert struct.unpack_from("<H", data, 4)[0] == SIGNED_FORMAT_VERSION
            assert data[-40:-32] == key_id(signer)

    # During the rotation a reader with [new, old] serves both chains.
    got, stats = read_through(tmp_path, "rotated-reader", remote, namespace, old_keys, remote_auth_key_file=rotated)
    assert got == old_payloads and stats["mac_mismatch"] == 0
    # After it (old key dropped; keys from an environment variable this
    # time), what only the old key signed is a miss.
    monkeypatch.setenv("UCM_TEST_AUTH_KEY", NEW_KEY.hex())
    got, stats = read_through(tmp_path, "new-only-reader", remote, namespace, old_keys, remote_auth_key_env="UCM_TEST_AUTH_KEY")
    assert got == [None] * 3 and stats["mac_mismatch"] >= 1
    got, _ = read_through(tmp_path, "new-only-reader2", remote, namespace, new_keys, remote_auth_key_env="UCM_TEST_AUTH_KEY")
    assert got == new_payloads

    # A node with no key is refused: the remote is keyed.
    with pytest.raises(ConfigError, match="is keyed"):
        read_through(tmp_path, "keyless-reader", remote, namespace, new_keys)


def test_wrong_key_is_a_miss_and_the_object_stays(tmp_path: Path, remote: Remote, namespace: Any) -> None:
    keys, payloads = chain(namespace, 2, seed=5)
    write_through(tmp_path, "writer", remote, namespace, keys, payloads, remote_auth_key_file=key_file(tmp_path, NEW_KEY))
    got, stats = read_through(tmp_path, "reader", remote, namespace, keys, remote_auth_key_file=key_file(tmp_path, OTHER_KEY, name="o.key"))
    assert got == [None, None] and stats["mac_mismatch"] >= 1 and stats["corrupt"] == 0
    got, _ = read_through(tmp_path, "right", remote, namespace, keys, remote_auth_key_file=key_file(tmp_path, NEW_KEY, name="n.key"))
    assert got == payloads


def test_flipped_byte_in_a_signed_body_is_a_miss(tmp_path: Path, namespace: Any) -> None:
    """The MAC covers the body: one flipped payload byte with every
    unkeyed checksum recomputed is refused."""
    keys, payloads = chain(namespace, 1, seed=6)
    signer = AuthKeys((NEW_KEY,), "test")
    ns_id = namespace.digest[:16]
    honest = pack_object(keys[0], None, ns_id, codec.encode(keys[0], payloads[0], codec="none"), signer)
    tampered = bytearray(payloads[0])
    tampered[0] ^= 1
    forged_body = pack_object(keys[0], None, ns_id, codec.encode(keys[0], bytes(tampered), codec="none"), signer)
    forged = forged_body[: -32] + honest[-32:]  # the honest MAC on forged bytes
    from ucm_db.remote.envelope import UnauthenticatedObject, unpack_object

    assert bytes(unpack_object(honest, keys[0], signer).blob) == bytes(codec.encode(keys[0], payloads[0], codec="none"))
    with pytest.raises(UnauthenticatedObject) as caught:
        unpack_object(forged, keys[0], signer)
    assert caught.value.reason == "mac_mismatch"


@pytest.mark.parametrize("content, mode, message", [
    ("", 0o600, "holds no key"),
    ("00" * 16 + "\n", 0o600, "a key of 16 bytes"),
    ("zz" * 32 + "\n", 0o600, "not hex"),
    ("00" * 65 + "\n", 0o600, "a key of 65 bytes"),
    ("11" * 32 + "\n", 0o644, "readable by everyone"),
    ("11" * 32 + "\n", 0o620, "writable by others"),
])
def test_bad_key_file_is_a_clear_config_error(tmp_path: Path, content: str, mode: int, message: str) -> None:
    remote = Remote("file", f"file://{tmp_path}/shared")
    path = tmp_path / "bad.key"
    path.write_text(content)
    path.chmod(mode)
    with pytest.raises(ConfigError, match=message):
        ucm_db.open(tmp_path / "s", capacity_bytes=CAP, **remote.store_options(remote_auth_key_file=str(path)))
    assert not (tmp_path / "s").exists() or not any((tmp_path / "s").iterdir())  # refused before anything opened


def test_missing_key_settings_are_clear_config_errors(tmp_path: Path) -> None:
    remote = Remote("file", f"file://{tmp_path}/shared")
    with pytest.raises(ConfigError, match="cannot read auth key file"):
        ucm_db.open(tmp_path / "s", capacity_bytes=CAP, **remote.store_options(remote_auth_key_file=str(tmp_path / "nope")))
    os.environ.pop("UCM_TEST_UNSET_KEY", None)
    with pytest.raises(ConfigError, match="UCM_TEST_UNSET_KEY"):
        ucm_db.open(tmp_path / "s", capacity_bytes=CAP, **remote.store_options(remote_auth_key_env="UCM_TEST_UNSET_KEY"))
    with pytest.raises(ConfigError, match="never the key itself"):
        ucm_db.open(tmp_path / "s", capacity_bytes=CAP, **remote.store_options(remote_auth_key_env="11" * 32 + "="))
    with pytest.raises(ConfigError, match="no remote is set"):
        ucm_db.open(tmp_path / "s", capacity_bytes=CAP, remote_auth_key_file=key_file(tmp_path, NEW_KEY))


def test_key_text_format(tmp_path: Path) -> None:
    """Hex keys, one per line (or comma/space separated in a variable),
    ``#`` comments, first signs; a group-readable file (0640) is accepted."""
    from ucm_db.auth import parse_keys, read_key_file

    parsed = parse_keys(f"# rotation 2026-11\n{NEW_KEY.hex()}  # current\n\n{OLD_KEY.hex().upper()}\n", "test")
    assert parsed.keys == (NEW_KEY, OLD_KEY) and parsed.signing_id == key_id(NEW_KEY)
    assert parse_keys(f"{NEW_KEY.hex()},{OLD_KEY.hex()}", "env").keys == (NEW_KEY, OLD_KEY)
    path = Path(key_file(tmp_path, OLD_KEY))
    path.chmod(0o640)
    assert read_key_file(path).keys == (OLD_KEY,)
    assert "auth.key" in repr(read_key_file(path)) and str(OLD_KEY)[2:12] not in repr(read_key_file(path))


@pytest.mark.parametrize("setting", ["remote_auth_key_file", "remote_auth_key_env"])
def test_a_key_given_in_place_of_a_path_or_name_is_never_echoed(tmp_path: Path, setting: str) -> None:
    """Issue 46 finding 10: ``remote_auth_key_file=<hex key>`` said "cannot
    read auth key file <key>", so the key landed in server logs."""
    key_hex = "ab" * 32
    with pytest.raises(ConfigError) as caught:
        ucm_db.open(tmp_path / "s", remote=f"file://{tmp_path}/remote", **{setting: key_hex})
    text = f"{caught.value} {caught.value.hint}"
    assert key_hex not in text and key_hex[:16] not in text, text
    assert "a key itself" in text
    assert not (tmp_path / "s").exists(), "nothing is created before the key is checked"


def test_a_store_that_used_a_keyed_remote_refuses_a_keyless_open(tmp_path: Path, remote: Remote, namespace: Any) -> None:
    """Issue 46 finding 3: a keyless open (``ucm-db warm`` without the key)
    of a keyed node's store took an unsigned plant into the local tier, which
    the keyed node then served. The store records that its remote is keyed
    (key ids only): the keyless open is refused even where the remote's own
    marker is gone, and nothing is fetched."""
    keys, payloads = chain(namespace, 3, seed=8)
    auth = {"remote_auth_key_file": key_file(tmp_path, NEW_KEY)}
    write_through(tmp_path, "node", remote, namespace, keys[:1], payloads[:1], **auth)
    _plant(remote, namespace, keys[1], keys[0], b"forged KV " * 100)
    root = RemoteRoot.from_url(remote.url, remote.options)
    root.fs.rm(f"{root.root}/{MARKER_NAME}")  # the marker deleted (or the remote unreachable at open)
    with pytest.raises(ConfigError, match="used the remote .* with an auth key") as caught:
        ucm_db.open(tmp_path / "node", capacity_bytes=CAP, **remote.store_options(remote_deadline_s=10))
    assert "remote_auth_key_file" in (caught.value.hint or "")
    got, stats = read_through(tmp_path, "node", remote, namespace, keys[:2], **auth)  # still keyed: the plant is a miss
    assert got == [payloads[0], None] and stats["unauthenticated"] >= 1
    with ucm_db.open(tmp_path / "node", capacity_bytes=CAP) as store:  # without the remote: fine
        assert store.stats().blocks == 1


def test_a_keyless_node_cannot_rewrite_a_keyed_fleets_objects(tmp_path: Path, remote: Remote, namespace: Any) -> None:
    """Issue 46 finding 4: a keyless node's put of a chain the keyed nodes
    had signed rewrote the objects unsigned, and keyed readers missed them
    for good. The remote's marker refuses the keyless node at open."""
    keys, payloads = chain(namespace, 3, seed=9)
    auth = {"remote_auth_key_file": key_file(tmp_path, NEW_KEY)}
    write_through(tmp_path, "keyed", remote, namespace, keys, payloads, **auth)
    with pytest.raises(ConfigError, match="is keyed"):
        write_through(tmp_path, "keyless", remote, namespace, keys, payloads)
    assert not (tmp_path / "keyless" / "lmdb").exists() or ucm_db.open(tmp_path / "keyless").stats().blocks == 0
    got, stats = read_through(tmp_path, "reader", remote, namespace, keys, **auth)
    assert got == payloads and stats["unauthenticated"] == 0 and stats["mac_mismatch"] == 0
