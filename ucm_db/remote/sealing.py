"""Encryption (AES-256-GCM) of remote objects and archive members, beside the MAC.

Keys come from their own settings (``remote_encryption_key_file`` /
``remote_encryption_key_env``; ``ucm-db export/import --encryption-key-file``),
in :mod:`ucm_db.auth`'s key-file format with its checks and its rotation: the
first key seals, every key opens, and each sealed body names the id of the
key that sealed it. The MAC and encryption are configured independently.

Sealed body (little-endian), what :meth:`SealingKeys.seal_parts` returns::

    key id 8B | nonce 12B | plain length u64 | segment 0 | segment 1 | ...
    segment i: AES-256-GCM ciphertext of plain[i * SEGMENT_BYTES : ...] | tag 16B

Segments exist because AES-GCM in the ``cryptography`` package takes at most
2**31 - 1 bytes per call and a codec blob may reach 4 GiB; a KV block (KiB to
a few MiB) is always one segment. Segment ``i`` is sealed under the nonce
with ``i`` XORed into its last 4 bytes, and its associated data ends with
``i``; the plain length (hence the segment count) is in every segment's
associated data, so segments can be neither reordered, dropped nor added.

The associated data of every segment is the caller's *context* (a
length-prefixed label and the fields the body must stay bound to: for a
remote object its key, parent, namespace id and format version,
:mod:`ucm_db.remote.envelope`; for an archive member its key, parent,
namespace id, epoch and archive version, :mod:`ucm_db.maintenance.archive.sealed`),
then the body's head (key id, nonce, plain length), then the segment index.
A valid body moved under another key, parent, namespace, epoch or label
fails to open.

Invariants:
    * The AES key is never the key file's bytes: it is HKDF-SHA256 (RFC
      5869) of them with a salt and an info label of its own
      (:func:`derive_aes_key`), so one key file used for both the MAC and
      encryption still gives independent keys. Key ids are a MAC of a label
      of their own (:func:`seal_key_id`): they reveal nothing of the key and
      differ from the same key's MAC id.
    * Nonces are 96 random bits per sealed body (``os.urandom``), never
      derived from the block key. Objects are immutable and content
      addressed, yet the same block may be uploaded again (another node,
      another remote codec, a retry) with other plaintext bytes: a nonce
      derived from the key would then be reused with a different plaintext,
      which breaks GCM (it leaks the XOR of the two and the authentication
      key). Random nonces need no state shared between nodes; their bound
      (NIST SP 800-38D 8.3) is 2**32 seals per key for a collision
      probability under 2**-32: rotate the key before a fleet writes four
      billion objects with it (8 PiB of 2 MiB blocks).
    * Opening returns bytes only when the tag checks for the key the body
      names; otherwise :class:`UnsealError`, never bytes (no partial
      plaintext: segments are opened whole).
    * The ``cryptography`` package is imported only when keys are loaded: a
      store or archive without encryption never needs it; with encryption
      and without the package, loading the keys is a ConfigError naming
      ``pip install cryptography``.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ucm_db import auth
from ucm_db.buffers import Buffer
from ucm_db.errors import ConfigError

NONCE_BYTES = 12
TAG_BYTES = 16
#: The largest plaintext sealed in one AES-GCM call (the cryptography
#: package's limit is 2**31 - 1 bytes). Part of the format: never change it.
SEGMENT_BYTES = 1 << 30
_HEAD = struct.Struct(f"<{auth.KEY_ID_BYTES}s{NONCE_BYTES}sQ")
#: Bytes of the sealed body's head (key id, nonce, plain length).
HEAD_BYTES = _HEAD.size
_PLAIN_LENGTH_OFFSET = auth.KEY_ID_BYTES + NONCE_BYTES
_HKDF_SALT = b"ucm-db sealing v1"
_HKDF_INFO = b"ucm-db aes-256-gcm key"
_SEAL_ID = b"ucm-db seal id"
CIPHER = "AES-256-GCM"
_INSTALL_HINT = "pip install cryptography (or pip install 'ucm-db[remote]'), or drop the encryption key setting"


class UnsealError(Exception):
    """A sealed body that the configured keys cannot open: no key of its
    id, a tag that does not check (altered, or moved to another context),
    or a malformed head. Not damage to quarantine: a miss."""


def derive_aes_key(file_key: bytes) -> bytes:
    """The 32-byte AES-256 key of a key-file key: HKDF-SHA256 (RFC 5869,
    extract then one block of expand) with this module's salt and info."""
    prk = hmac.new(_HKDF_SALT, file_key, hashlib.sha256).digest()
    return hmac.new(prk, _HKDF_INFO + b"\x01", hashlib.sha256).digest()


def seal_key_id(file_key: bytes) -> bytes:
    """The public 8-byte id of an encryption key (not its MAC key id)."""
    return auth.mac(file_key, (), _SEAL_ID)[: auth.KEY_ID_BYTES]


def segment_count(plain_bytes: int) -> int:
    """Segments of a plaintext of ``plain_bytes`` (an empty one is one)."""
    return max(1, -(-plain_bytes // SEGMENT_BYTES))


def sealed_bytes(plain_bytes: int) -> int:
    """The length of the sealed body of ``plain_bytes`` of plaintext."""
    return HEAD_BYTES + plain_bytes + TAG_BYTES * segment_count(plain_bytes)


def stated_plain_bytes(head: Buffer) -> int:
    """The plain length a sealed body's head states (``head`` holds at
    least :data:`HEAD_BYTES`)."""
    return int(struct.unpack_from("<Q", head, _PLAIN_LENGTH_OFFSET)[0])


def sealing_key_id(head: Buffer) -> bytes:
    """The id of the key a sealed body's head names."""
    return bytes(memoryview(head)[: auth.KEY_ID_BYTES])


def _segment_nonce(nonce: bytes, index: int) -> bytes:
    if index == 0:
        return nonce
    return nonce[:8] + (int.from_bytes(nonce[8:], "little") ^ index).to_bytes(4, "little")


def _aad(context: bytes, head: bytes, index: int) -> bytes:
    return b"".join((context, head, index.to_bytes(4, "little")))


def context(label: bytes, *fields: Buffer) -> bytes:
    """A sealing context: ``label`` length-prefixed (labels never run into
    the fields) followed by the fields, each of a fixed length per label."""
    return b"".join((bytes((len(label),)), label, *(bytes(f) for f in fields)))


def _aead() -> tuple[Any, type[Exception]]:
    """``(AESGCM, InvalidTag)`` from the cryptography package (imported here
    only: the core imports without it)."""
    try:
        from cryptography.exceptions import InvalidTag
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError as exc:
        raise ConfigError("encryption (remote_encryption_key_file / remote_encryption_key_env, --encryption-key-file) "
                          "needs the cryptography package, which is not installed", hint=_INSTALL_HINT) from exc
    return AESGCM, InvalidTag


@dataclass(frozen=True, slots=True, eq=False)
class SealingKeys:
    """The encryption keys of one store or archive: ``keys[0]`` seals,
    every key opens (module invariants).

    Attributes:
        keys: the key-file keys (never shown: left out of ``repr``).
        source: where they came from (for messages; never the keys).
    """

    keys: tuple[bytes, ...] = field(repr=False)
    source: str
    _ciphers: dict[bytes, Any] = field(init=False, repr=False)
    _invalid_tag: type[Exception] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        auth.AuthKeys(self.keys, self.source)  # the same checks: present, 32 to 64 bytes each
        aesgcm, invalid_tag = _aead()
        ciphers: dict[bytes, Any] = {}
        for key in self.keys:
            ciphers.setdefault(seal_key_id(key), aesgcm(derive_aes_key(key)))
        object.__setattr__(self, "_ciphers", ciphers)
        object.__setattr__(self, "_invalid_tag", invalid_tag)

    @property
    def sealing_id(self) -> bytes:
        """The id of the key that seals (the first)."""
        return seal_key_id(self.keys[0])

    @property
    def key_ids(self) -> tuple[bytes, ...]:
        return tuple(self._ciphers)

    def knows(self, key_id: bytes) -> bool:
        """True if a configured key has the id ``key_id``."""
        return bytes(key_id) in self._ciphers

    def seal_parts(self, plain: Buffer, context: bytes) -> list[bytes]:
        """The sealed body of ``plain`` under the first key, in parts (head,
        then one ciphertext-and-tag per segment) for the caller to join once."""
        view = memoryview(plain).cast("B")
        key_id = self.sealing_id
        nonce = os.urandom(NONCE_BYTES)
        head = _HEAD.pack(key_id, nonce, len(view))
        cipher = self._ciphers[key_id]
        parts = [head]
        for index in range(segment_count(len(view))):
            chunk = view[index * SEGMENT_BYTES : (index + 1) * SEGMENT_BYTES]
            parts.append(cipher.encrypt(_segment_nonce(nonce, index), chunk, _aad(context, head, index)))
        return parts

    def seal(self, plain: Buffer, context: bytes) -> bytes:
        """:meth:`seal_parts`, joined."""
        return b"".join(self.seal_parts(plain, context))

    def open(self, sealed: Buffer, context: bytes) -> bytes | bytearray:
        """The plaintext of a whole sealed body made for ``context``.

        Raises:
            UnsealError: malformed or wrong length, no configured key of
                its id, or a tag that does not check.
        """
        view = memoryview(sealed).cast("B")
        if len(view) < HEAD_BYTES + TAG_BYTES:
            raise UnsealError(f"sealed body of {len(view)} bytes is shorter than its head and tag")
        head = bytes(view[:HEAD_BYTES])
        key_id, nonce, plain_bytes = _HEAD.unpack(head)
        if len(view) != sealed_bytes(plain_bytes):
            raise UnsealError(f"sealed body of {len(view)} bytes states {plain_bytes} bytes of plaintext")
        cipher = self._ciphers.get(key_id)
        if cipher is None:
            raise UnsealError(f"sealed with key id {key_id.hex()}, which no configured encryption key has")
        count = segment_count(plain_bytes)
        out: bytes | bytearray = b"" if count == 1 else bytearray(plain_bytes)
        at = HEAD_BYTES
        for index in range(count):
            size = min(SEGMENT_BYTES, plain_bytes - index * SEGMENT_BYTES) + TAG_BYTES
            try:
                plain = cipher.decrypt(_segment_nonce(nonce, index), view[at : at + size], _aad(context, head, index))
            except self._invalid_tag:
                raise UnsealError("its tag does not check: altered, sealed for another key, parent, namespace or "
                                  "epoch, or with another key of the same id") from None
            if count == 1:
                return plain  # type: ignore[no-any-return]
            out[index * SEGMENT_BYTES : index * SEGMENT_BYTES + len(plain)] = plain  # type: ignore[index]
            at += size
        return out


def load_sealing_keys(key_file: str | Path | None, key_env: str | None) -> SealingKeys | None:
    """The encryption keys named by a file and/or an environment variable
    (:func:`ucm_db.auth.load_keys`'s format and checks); None when neither
    is given. ConfigError for a bad file or a missing ``cryptography``."""
    found = auth.load_keys(key_file, key_env, kind="encryption")
    return None if found is None else SealingKeys(found.keys, found.source)
