"""MACs of export archives (``ucm-db export/import --auth-key-file``).

An archive exported with a key ends with one more member, ``manifest.auth``
(binary, little-endian)::

    magic "UCMA" | version u16 | signing key id 8B | manifest MAC 32B |
    per block: key 32B | MAC 32B

The manifest MAC is HMAC-SHA256 (:mod:`ucm_db.auth`) over the exact
bytes of ``manifest.json`` (which lists every block's key, parent and
namespace); a block's MAC covers its key and its whole member (the codec
blob). Separate personalisation strings keep either from passing as the
other, or as a remote object's.

Invariants:
    * Import with keys refuses (:class:`~ucm_db.errors.ConfigError`, before
      anything is written) an archive with no ``manifest.auth``, one whose
      manifest MAC no key made, or a malformed or oversized
      ``manifest.auth``; a block whose MAC does not match is skipped as
      unauthenticated (its descendants as "parent missing"), like a corrupt
      one.
    * ``manifest.auth`` is never larger than the manifest plus
      :data:`_SLACK_BYTES` (a manifest row takes over 100 bytes, an entry
      64): a hostile one cannot make import read more.
    * Import without keys ignores ``manifest.auth``; an older ucm-db does too.
"""

from __future__ import annotations

import hmac
import struct
import tarfile
from pathlib import Path

from ucm_db import auth
from ucm_db.auth import Buffer
from ucm_db.errors import ConfigError

AUTH_MEMBER = "manifest.auth"
_MAGIC = b"UCMA"
_VERSION = 1
_HEAD = struct.Struct(f"<4sH{auth.KEY_ID_BYTES}s{auth.MAC_BYTES}s")
_ENTRY_BYTES = 32 + auth.MAC_BYTES
_SLACK_BYTES = 4096


class ArchiveSigner:
    """Collects an export's MACs, signed with the first key."""

    def __init__(self, keys: auth.AuthKeys) -> None:
        self._key = keys.keys[0]
        self._head = b""
        self._entries: list[bytes] = []

    def manifest(self, data: bytes) -> None:
        self._head = _HEAD.pack(_MAGIC, _VERSION, auth.key_id(self._key), auth.mac(self._key, [data], auth.ARCHIVE_MANIFEST))

    def block(self, key: bytes, blob: Buffer) -> None:
        self._entries.append(key + auth.mac(self._key, [key, blob], auth.ARCHIVE_BLOCK))

    def member(self) -> bytes:
        """The bytes of ``manifest.auth`` (call after every block)."""
        return self._head + b"".join(self._entries)


class ArchiveVerifier:
    """Checks an import against ``manifest.auth`` with the configured keys."""

    def __init__(self, tar: tarfile.TarFile, archive: Path, keys: auth.AuthKeys) -> None:
        self._tar, self._archive, self._keys = tar, archive, keys
        self._key: bytes | None = None
        self._block_macs: dict[bytes, bytes] = {}

    def check_manifest(self, data: bytes) -> None:
        """Reads ``manifest.auth`` and checks the manifest's exact bytes;
        ConfigError unless one configured key signed them."""
        where = f"{self._archive}"
        try:
            member = self._tar.getmember(AUTH_MEMBER)
        except KeyError:
            raise ConfigError(f"{where} carries no MAC ({AUTH_MEMBER}) and an auth key was given",
                              hint="export it with --auth-key-file, or import it without a key if you trust its source") from None
        if not member.isfile() or not _HEAD.size <= member.size <= len(data) + _SLACK_BYTES or (member.size - _HEAD.size) % _ENTRY_BYTES:
            raise ConfigError(f"{where}: {AUTH_MEMBER} is malformed", hint="the archive was altered; export it again")
        handle = self._tar.extractfile(member)
        raw = handle.read(member.size) if handle is not None else b""
        if len(raw) != member.size:
            raise ConfigError(f"{where}: {AUTH_MEMBER} is truncated", hint="the archive was altered; export it again")
        magic, version, signer, tag = _HEAD.unpack_from(raw, 0)
        if magic != _MAGIC or version != _VERSION:
            raise ConfigError(f"{where}: {AUTH_MEMBER} is not a ucm-db archive MAC of version {_VERSION}", hint="export it again with this ucm-db")
        self._key = next((k for k in self._keys.keys if hmac.compare_digest(auth.key_id(k), signer)
                          and hmac.compare_digest(auth.mac(k, [data], auth.ARCHIVE_MANIFEST), tag)), None)
        if self._key is None:
            raise ConfigError(f"{where}: the manifest's MAC was not made by any given auth key (wrong key, or altered)",
                              hint="pass the key it was exported with (keys are tried in order)")
        for at in range(_HEAD.size, len(raw), _ENTRY_BYTES):
            self._block_macs[raw[at : at + 32]] = raw[at + 32 : at + _ENTRY_BYTES]

    def block_ok(self, key: bytes, blob: Buffer) -> bool:
        """True if the manifest's key signed ``blob`` as the block ``key``."""
        tag = self._block_macs.get(key)
        return (self._key is not None and tag is not None
                and hmac.compare_digest(auth.mac(self._key, [key, blob], auth.ARCHIVE_BLOCK), tag))
