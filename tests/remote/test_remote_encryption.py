"""Encryption of remote objects (issue 46): AES-256-GCM beside the MAC.

A writer with ``remote_encryption_key_file`` uploads version 3 objects whose
codec blob is sealed; a reader with a key that opens them serves them, a
reader without one (or with another) sees misses counted ``undecryptable``,
never bytes, and a keyed reader misses plaintext objects (``unencrypted``).
Whoever can write the bucket can move a valid ciphertext to another key,
parent or namespace and recompute the envelope's unkeyed checksum (the
object format is public): the associated data makes each a miss. On
``memory://``, a ``file://`` directory and a real S3 endpoint (moto).
"""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import xxhash

import ucm_db
from ucm_db import auth, codec
from ucm_db.errors import ConfigError
from ucm_db.remote import sealing
from ucm_db.remote.envelope import (
    ENVELOPE_BYTES, SEALED_FORMAT_VERSION, UnauthenticatedObject, pack_object, unpack_object,
)
from ucm_db.remote.sealing import SealingKeys, UnsealError, derive_aes_key, load_sealing_keys, seal_key_id
from ucm_db.remote.tier import RemoteRoot, write_whole

from .conftest import Remote, chain, key_file, make_remote, read_through, write_through

pytestmark = pytest.mark.timeout(120)
CAP = 64 << 20
OLD_KEY = bytes(range(32))
NEW_KEY = bytes(range(100, 164))
OTHER_KEY = b"\x07" * 32
MAC_KEY = b"\x2a" * 32
NODE = Path(__file__).with_name("node_proc.py")








def _objects(remote: Remote, namespace: Any, keys: list[bytes]) -> list[bytes]:
    root = RemoteRoot.from_url(remote.url, remote.options)
    return [root.fs.cat_file(root.object_path(namespace.digest[:16], k)) for k in keys]


def _reforge(obj: bytes, key: bytes, *, parent: bytes | None = None, namespace_id: bytes | None = None) -> bytes:
    """What anyone can do to a public-format object: rewrite envelope fields
    and recompute the envelope's unkeyed checksum for ``key``."""
    head = bytearray(obj[:ENVELOPE_BYTES])
    if namespace_id is not None:
        head[8:24] = namespace_id
    if parent is not None:
        head[24:56] = parent
    head[56:64] = bytes(8)
    head[56:64] = struct.pack("<Q", xxhash.xxh3_64(bytes(head[:56]) + bytes(8) + key).intdigest())
    return bytes(head) + obj[ENVELOPE_BYTES:]


def _drop_marker(remote: Remote) -> None:
    """Deletes the root's encryption marker, as a bucket writer may (it guards
    against mistakes, not an attacker): a keyless node then opens, and misses."""
    root = RemoteRoot.from_url(remote.url, remote.options)
    root.fs.rm(f"{root.root}/encryption.json")


@pytest.fixture
def enc(tmp_path: Path) -> dict[str, str]:
    return {"remote_encryption_key_file": key_file(tmp_path, NEW_KEY, name="encryption.key")}


def test_round_trip_and_nothing_readable_on_the_remote(tmp_path: Path, remote: Remote, namespace: Any, enc: dict[str, str]) -> None:
    keys, payloads = chain(namespace, 4, seed=1)
    write_through(tmp_path, "writer", remote, namespace, keys, payloads, **enc)
    for obj, payload in zip(_objects(remote, namespace, keys), payloads):
        assert struct.unpack_from("<H", obj, 4)[0] == SEALED_FORMAT_VERSION
        assert payload[:512] not in obj and payload[-32:] not in obj  # neither the noise nor the key-tail of the payload
    got, stats = read_through(tmp_path, "reader", remote, namespace, keys, **enc)
    assert got == payloads
    assert stats["undecryptable"] == stats["unencrypted"] == stats["corrupt"] == 0
    with ucm_db.open(tmp_path / "looker", capacity_bytes=CAP, **remote.store_options(remote_deadline_s=10, **enc)) as store:
        assert store.lookup(namespace, keys) == 4


@pytest.mark.parametrize("remote_kind", ["memory", "file"])
def test_keyless_and_wrongly_keyed_readers_miss(tmp_path: Path, remote_kind: str, namespace: Any, enc: dict[str, str],
                                                request: pytest.FixtureRequest) -> None:
    from .conftest import make_remote

    remote = make_remote(remote_kind, tmp_path, request)
    keys, payloads = chain(namespace, 3, seed=2)
    write_through(tmp_path, "writer", remote, namespace, keys, payloads, **enc)
    with pytest.raises(ConfigError, match="encryption.json") as refused:  # the root's marker: a keyless node never opens
        read_through(tmp_path, "refused", remote, namespace, keys)
    assert "--encryption-key-file" in refused.value.hint
    _drop_marker(remote)
    got, stats = read_through(tmp_path, "keyless", remote, namespace, keys)
    assert got == [None] * 3 and stats["undecryptable"] >= 1 and stats["corrupt"] == 0
    other = {"remote_encryption_key_file": key_file(tmp_path, OTHER_KEY, name="other.key")}
    got, stats = read_through(tmp_path, "other", remote, namespace, keys, **other)
    assert got == [None] * 3 and stats["undecryptable"] >= 1
    _drop_marker(remote)  # the keyed open wrote it again
    with ucm_db.open(tmp_path / "looker", capacity_bytes=CAP, **remote.store_options(remote_deadline_s=10)) as store:
        assert store.lookup(namespace, keys) == 0  # a probe already refuses what it cannot open


def test_keyed_reader_misses_plaintext_objects(tmp_path: Path, namespace: Any, enc: dict[str, str], request: pytest.FixtureRequest) -> None:
    from .conftest import make_remote

    remote = make_remote("file", tmp_path, request)
    keys, payloads = chain(namespace, 3, seed=3)
    write_through(tmp_path, "plain-writer", remote, namespace, keys, payloads)  # encryption required where configured
    got, stats = read_through(tmp_path, "reader", remote, namespace, keys, **enc)
    assert got == [None] * 3 and stats["unencrypted"] >= 1 and stats["corrupt"] == 0


@pytest.mark.parametrize("remote_kind", ["memory", "file"])
def test_ciphertext_moved_to_another_key_parent_or_namespace_is_a_miss(tmp_path: Path, remote_kind: str, namespace: Any,
                                                                       request: pytest.FixtureRequest) -> None:
    from .conftest import make_remote

    remote = make_remote(remote_kind, tmp_path, request)
    keys_a, payloads_a = chain(namespace, 2, seed=4)
    keys_b, _payloads_b = chain(namespace, 2, seed=5)
    seal = load_sealing_keys(key_file(tmp_path, NEW_KEY, name="encryption.key"), None)
    root = RemoteRoot.from_url(remote.url, remote.options)
    root.sealing = seal
    ns_id = namespace.digest[:16]
    tier = root.tier(ns_id)
    for i, (key, payload) in enumerate(zip(keys_a, payloads_a)):
        tier.store(key, keys_a[i - 1] if i else None, codec.encode(key, payload, codec="none"))
    obj = root.fs.cat_file(tier.path(keys_a[1]))
    assert tier.fetch(keys_a[1]) is not None

    # Under another key's path, with its envelope checksum recomputed for that key.
    write_whole(root.fs, tier.path(keys_b[1]), _reforge(obj, keys_b[1], parent=keys_b[0]))
    assert tier.fetch(keys_b[1]) is None and root.stats.undecryptable == 1
    # Same key, another parent.
    write_whole(root.fs, tier.path(keys_a[1]), _reforge(obj, keys_a[1], parent=keys_b[0]))
    assert tier.fetch(keys_a[1]) is None and root.stats.undecryptable == 2
    # Same key and parent, under another namespace.
    other_ns = bytes(16)
    other = root.tier(other_ns)
    write_whole(root.fs, other.path(keys_a[1]), _reforge(obj, keys_a[1], namespace_id=other_ns))
    assert other.fetch(keys_a[1]) is None and root.stats.undecryptable == 3
    # Copied unchanged to another key's path: the envelope checksum already fails.
    write_whole(root.fs, tier.path(keys_b[0]), obj)
    assert tier.fetch(keys_b[0]) is None and root.stats.corrupt == 1


def test_a_flipped_byte_anywhere_is_a_miss(tmp_path: Path, namespace: Any) -> None:
    seal = load_sealing_keys(key_file(tmp_path, NEW_KEY, name="encryption.key"), None)
    root = RemoteRoot.from_url(f"file://{tmp_path / 'remote'}", {})
    root.sealing = seal
    tier = root.tier(namespace.digest[:16])
    keys, payloads = chain(namespace, 1, seed=6)
    tier.store(keys[0], None, codec.encode(keys[0], payloads[0], codec="none"))
    good = root.fs.cat_file(tier.path(keys[0]))
    positions = [5, 30, ENVELOPE_BYTES + 3, ENVELOPE_BYTES + 12, ENVELOPE_BYTES + 22, ENVELOPE_BYTES + sealing.HEAD_BYTES + 1,
                 len(good) // 2, len(good) - 17, len(good) - 1]
    for at in positions:
        bad = bytearray(good)
        bad[at] ^= 0x40
        write_whole(root.fs, tier.path(keys[0]), bytes(bad))
        assert tier.fetch(keys[0]) is None, f"a flip at byte {at} was served"
    s = root.stats
    assert s.corrupt + s.undecryptable + s.too_large == len(positions) and s.undecryptable >= 5


def test_rotation_new_key_first_old_kept(tmp_path: Path, namespace: Any, request: pytest.FixtureRequest) -> None:
    from .conftest import make_remote

    remote = make_remote("file", tmp_path, request)
    old = {"remote_encryption_key_file": key_file(tmp_path, OLD_KEY, name="old.key")}
    rotated = {"remote_encryption_key_file": key_file(tmp_path, NEW_KEY, OLD_KEY, name="rotated.key")}
    only_new = {"remote_encryption_key_file": key_file(tmp_path, NEW_KEY, name="new.key")}
    old_keys, old_payloads = chain(namespace, 2, seed=7)
    new_keys, new_payloads = chain(namespace, 2, seed=8)
    write_through(tmp_path, "old-writer", remote, namespace, old_keys, old_payloads, **old)
    write_through(tmp_path, "new-writer", remote, namespace, new_keys, new_payloads, **rotated)
    new_ids = {bytes(o[ENVELOPE_BYTES : ENVELOPE_BYTES + 8]) for o in _objects(remote, namespace, new_keys)}
    assert new_ids == {seal_key_id(NEW_KEY)}  # the first key seals

    got, _ = read_through(tmp_path, "r1", remote, namespace, old_keys + new_keys, **rotated)
    assert got == old_payloads + new_payloads  # the new key seals, the old one still opens
    got, stats = read_through(tmp_path, "r2", remote, namespace, old_keys, **only_new)
    assert got == [None, None] and stats["undecryptable"] >= 1  # the old key dropped: its objects are misses
    got, _ = read_through(tmp_path, "r3", remote, namespace, new_keys, **only_new)
    assert got == new_payloads


def test_with_a_mac_key_too_both_are_checked(tmp_path: Path, namespace: Any, enc: dict[str, str], request: pytest.FixtureRequest) -> None:
    from .conftest import make_remote

    remote = make_remote("file", tmp_path, request)
    mac = {"remote_auth_key_file": key_file(tmp_path, MAC_KEY, name="auth.key")}
    keys, payloads = chain(namespace, 3, seed=9)
    write_through(tmp_path, "writer", remote, namespace, keys, payloads, **enc, **mac)
    got, stats = read_through(tmp_path, "both", remote, namespace, keys, **enc, **mac)
    assert got == payloads and stats["mac_mismatch"] == stats["undecryptable"] == 0
    _drop_marker(remote)
    got, stats = read_through(tmp_path, "mac-only", remote, namespace, keys, **mac)
    assert got == [None] * 3 and stats["undecryptable"] >= 1 and stats["mac_mismatch"] == 0  # authentic, yet unreadable
    # The MAC covers the ciphertext: a ciphertext altered in place fails the MAC before any decryption.
    root = RemoteRoot.from_url(remote.url, remote.options)
    path = root.object_path(namespace.digest[:16], keys[0])
    data = bytearray(root.fs.cat_file(path))
    data[ENVELOPE_BYTES + sealing.HEAD_BYTES] ^= 1
    write_whole(root.fs, path, bytes(data))
    got, stats = read_through(tmp_path, "both-again", remote, namespace, keys, **enc, **mac)
    assert got == [None, *payloads[1:]] and stats["mac_mismatch"] == 1 and stats["undecryptable"] == 0


def test_object_format_bindings_and_segments(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seal = SealingKeys((NEW_KEY, OLD_KEY), "test")
    key, parent, ns_id = b"k" * 32, b"p" * 32, b"n" * 16
    blob = codec.encode(key, bytes(range(256)) * 40, codec="none")
    obj = pack_object(key, parent, ns_id, blob, seal=seal)
    assert bytes(unpack_object(obj, key, seal=seal).blob) == bytes(blob)
    with pytest.raises(UnauthenticatedObject) as caught:
        unpack_object(obj, key)  # no key: never the ciphertext as a blob
    assert caught.value.reason == "undecryptable"
    with pytest.raises(UnauthenticatedObject) as caught:
        unpack_object(pack_object(key, parent, ns_id, blob), key, seal=seal)
    assert caught.value.reason == "unencrypted"

    monkeypatch.setattr(sealing, "SEGMENT_BYTES", 1000)  # several segments without GiBs of data
    context = sealing.context(b"test", key)
    plain = bytes(range(256)) * 15
    sealed = seal.seal(plain, context)
    assert len(sealed) == sealing.sealed_bytes(len(plain)) and sealing.segment_count(len(plain)) == 4
    assert bytes(seal.open(sealed, context)) == plain
    head, body = sealed[: sealing.HEAD_BYTES], sealed[sealing.HEAD_BYTES :]
    seg = 1000 + sealing.TAG_BYTES
    swapped = head + body[seg : 2 * seg] + body[:seg] + body[2 * seg :]
    for bad, bad_context in ((swapped, context), (sealed[:-1], context), (sealed, sealing.context(b"test", parent))):
        with pytest.raises(UnsealError):  # reordered segments, a truncated body, another context
            seal.open(bad, bad_context)


def test_derived_keys_and_ids_are_not_the_mac_keys() -> None:
    assert derive_aes_key(NEW_KEY) != NEW_KEY[:32] and len(derive_aes_key(NEW_KEY)) == 32
    assert derive_aes_key(NEW_KEY) != auth.mac(NEW_KEY, (), auth.REMOTE_OBJECT)
    assert seal_key_id(NEW_KEY) != auth.key_id(NEW_KEY)
    shown = repr(SealingKeys((NEW_KEY,), "src"))
    assert NEW_KEY.hex() not in shown and repr(NEW_KEY) not in shown and derive_aes_key(NEW_KEY).hex() not in shown


def test_settings_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no remote is set"):
        ucm_db.open(tmp_path / "a", capacity_bytes=CAP, remote_encryption_key_file=key_file(tmp_path, NEW_KEY, name="encryption.key"))
    pasted = NEW_KEY.hex()
    with pytest.raises(ConfigError) as caught:
        ucm_db.open(tmp_path / "b", capacity_bytes=CAP, remote=f"file://{tmp_path}/r", remote_encryption_key_env=pasted)
    assert pasted not in str(caught.value)
    loose = Path(key_file(tmp_path, NEW_KEY, name="loose.key"))
    loose.chmod(0o644)
    with pytest.raises(ConfigError, match="encryption key file .* readable by everyone"):
        ucm_db.open(tmp_path / "c", capacity_bytes=CAP, remote=f"file://{tmp_path}/r", remote_encryption_key_file=str(loose))
    assert not (tmp_path / "c").exists()  # refused before the store was created


def test_missing_cryptography_is_a_config_error_naming_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cryptography.hazmat.primitives.ciphers.aead", None)
    with pytest.raises(ConfigError, match="cryptography") as caught:
        load_sealing_keys(key_file(tmp_path, NEW_KEY, name="encryption.key"), None)
    assert "pip install cryptography" in str(caught.value)


def test_the_core_imports_and_works_without_cryptography(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "sys.modules['cryptography'] = None\n"
        "import ucm_db, ucm_db.remote.sealing, ucm_db.remote.envelope, ucm_db.maintenance\n"
        f"with ucm_db.open({str(tmp_path / 's')!r}, capacity_bytes=1 << 26, remote='file://{tmp_path}/r') as s: pass\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def _crash_with_uploads_queued(tmp_path: Path, remote: Remote, namespace: Any, n_blocks: int, seed: int,
                               **options: Any) -> None:
    """A serving node (a process of its own) puts a chain into the store
    ``node`` and is killed (SIGKILL) at its first upload (its second remote
    write, after the root's encryption marker): all of it stays
    queued, nothing reaches the remote."""
    spec = {"store": str(tmp_path / "node"), "remote": remote.url, "remote_options": remote.options,
            "namespace": namespace.to_dict(), "n_blocks": n_blocks, "seed": seed, "upload_concurrency": 1,
            "then": "sleep", "options": options}
    env = dict(os.environ, UCM_DB_CRASH_AT="remote.during_upload:2")  # the first write is the root's encryption marker
    node = subprocess.run([sys.executable, str(NODE), json.dumps(spec)], env=env, capture_output=True, text=True, timeout=60)
    assert node.returncode == -signal.SIGKILL, node.stderr[-2000:]


def _object_files(remote: Remote) -> list[Path]:
    return [p for p in Path(remote.url[len("file://"):]).rglob("*") if p.is_file() and len(p.name) == 64]


@pytest.mark.crash
def test_a_store_that_used_an_encrypted_remote_refuses_an_open_without_the_key(
        tmp_path: Path, namespace: Any, enc: dict[str, str], request: pytest.FixtureRequest) -> None:
    """The audit's sequence: a serving node with an encrypted remote dies
    with uploads queued, then its store is opened with the remote but no
    encryption key (``ucm-db warm`` before the engine restarts). That open
    started the uploader, which uploaded the queued KV as plaintext (format
    1): readable to whoever reads the bucket, and missed (``unencrypted``)
    by every keyed node. The store records that its remote is encrypted:
    the open is refused naming the fix, and nothing is uploaded; with the
    key the queue drains sealed."""
    remote = make_remote("file", tmp_path, request)
    keys, payloads = chain(namespace, 4, seed=11)
    _crash_with_uploads_queued(tmp_path, remote, namespace, 4, seed=11, **enc)
    with pytest.raises(ConfigError, match="used the remote .* with an encryption key") as caught:
        ucm_db.open(tmp_path / "node", **remote.store_options(remote_deadline_s=10))
    hint = caught.value.hint or ""
    assert "remote_encryption_key_file" in hint and "--encryption-key-file" in hint
    assert _object_files(remote) == []  # refused before the uploader existed

    with ucm_db.open(tmp_path / "node", **remote.store_options(**enc)) as store:
        assert store.stats().pending_uploads == 4
        store.flush(upload_timeout_s=60)
        assert store.stats().pending_uploads == 0
    for obj, payload in zip(_objects(remote, namespace, keys), payloads):
        assert struct.unpack_from("<H", obj, 4)[0] == SEALED_FORMAT_VERSION and payload[:512] not in obj
    got, stats = read_through(tmp_path, "reader", remote, namespace, keys, **enc)
    assert got == payloads and stats["unencrypted"] == 0
    with ucm_db.open(tmp_path / "node") as store:  # without the remote: fine
        assert store.stats().blocks == 4
