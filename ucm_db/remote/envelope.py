"""The remote tier's object format: a verified envelope around a codec blob.

Object format (little-endian): a 64-byte envelope followed by the codec blob
(:mod:`ucm_db.codec`) exactly as the local tier stores it::

    envelope  magic "UCMR" | version u16 | flags u16 | namespace id 16B |
              parent key 32B | checksum u64
    blob      codec header (owning key, raw length, ...) | frame table | body
    trailer   (version 2, and version 3 with flag bit 1) key id 8B | MAC 32B

A version 3 (sealed) object carries, in place of the codec blob, its sealed
body (:mod:`ucm_db.remote.sealing`: key id, nonce, plain length, AES-256-GCM
ciphertext of the codec blob and tag)::

    envelope  as above, version 3; flags bit 0 parent, bit 1 MAC trailer
    sealed    key id 8B | nonce 12B | plain length u64 | ciphertext | tag 16B
    trailer   (flag bit 1 only) key id 8B | MAC 32B

The envelope carries what the codec blob lacks to promote the block into a
local tier: its parent key (flag bit 0 set; a chain's first block has none)
and the 16-byte namespace id. Its checksum is xxh3-64 over the envelope with
the checksum field zeroed, followed by the object's own key, so an envelope
that is bit-flipped or served under another key's path fails.

Version 1 objects carry no MAC (a store with no auth key writes them).
Version 2 objects, written by a store with ``remote_auth_key_file`` or
``remote_auth_key_env``, end with a trailer: the id of the signing key and
an HMAC-SHA256 (:mod:`ucm_db.auth`) over the object's key, the whole
envelope, the whole codec blob and the key id. A reader with keys accepts
only a version 2 object whose MAC one of its keys made
(:class:`UnauthenticatedObject` otherwise); a reader without keys reads
both versions and ignores the MAC (its checksums still hold). A reader
older than version 2 takes a signed object for a corrupt one: a miss.

Version 3 objects are written by a store with ``remote_encryption_key_file``
or ``remote_encryption_key_env`` (with an auth key too, they also carry the
MAC trailer, computed over the ciphertext: both keys are then checked). The
associated data of the encryption binds the object's key, its whole
envelope (format version, flags, namespace id, parent key, checksum) and
the sealed head: a valid ciphertext copied to another key's path, namespace
or parent fails to open. The namespace's epoch is bound through the key:
key chains are rooted at the epoch (:meth:`ucm_db.Namespace.root_key`),
and the uploader, which packs objects from the upload queue, does not know
the epoch a block was written at; an object of another epoch is one of
another key. Encryption is *required* where configured: a reader with
encryption keys serves only version 3 objects that one of them opens (a
plaintext object is a miss counted ``unencrypted``, one it cannot open a
miss counted ``undecryptable``); a reader without encryption keys never
serves a version 3 object (``undecryptable``): it sees misses, never
ciphertext. Readers older than version 3 take a sealed object for a corrupt
one: a miss.

Invariants:
    * An object states its own exact length in its first
      :data:`PROBE_BYTES` (:func:`stated_object_bytes`), never more than
      :data:`MAX_OBJECT_BYTES`: a reader needs to read no further.
    * Every parse failure is a :class:`~ucm_db.errors.CorruptBlockError`;
      an object that the reader's keys do not authenticate is an
      :class:`UnauthenticatedObject` (not damage: nothing to quarantine).
    * With keys, the MAC is checked before the codec parses the blob, and
      the ciphertext is opened (its tag checked) before the codec parses
      the plaintext.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

from ucm_db import auth, codec
from ucm_db.errors import ConfigError, CorruptBlockError
from ucm_db.engines.base import Buffer
from ucm_db.remote import sealing
from ucm_db.remote.sealing import SealingKeys, UnsealError

OBJECT_MAGIC = b"UCMR"
OBJECT_FORMAT_VERSION = 1
#: The format of an object signed with a key (a MAC trailer).
SIGNED_FORMAT_VERSION = 2
#: The format of an encrypted object (a sealed body; flag bit 1: a MAC trailer).
SEALED_FORMAT_VERSION = 3
_VERSIONS = (OBJECT_FORMAT_VERSION, SIGNED_FORMAT_VERSION, SEALED_FORMAT_VERSION)
#: The label of the sealing context of remote objects (:func:`ucm_db.remote.sealing.context`).
SEAL_LABEL = b"ucm-db remote v3"
TRAILER_BYTES = auth.KEY_ID_BYTES + auth.MAC_BYTES
_ENVELOPE = struct.Struct("<4sHH16s32sQ")
ENVELOPE_BYTES = _ENVELOPE.size
_ENV_CHECKSUM_OFFSET = ENVELOPE_BYTES - 8
_FLAG_HAS_PARENT = 1
_FLAG_SIGNED = 2
_NO_PARENT = bytes(32)
#: Bytes a presence probe reads: the envelope plus the codec header.
PROBE_BYTES = ENVELOPE_BYTES + codec.HEADER_BYTES
#: Codec wire format (see :mod:`ucm_db.codec`): a frame table entry's size
#: and where the header's raw_len u64 and body_len u64 sit.
_FRAME_ENTRY_BYTES = 24
_CODEC_LENGTHS = struct.Struct("<QQ")
_CODEC_LENGTHS_OFFSET = 12
#: The most bytes the encoder adds to a frame beyond its raw length (the
#: shuffle mode's u32 length per plane, at most 4 planes).
_FRAME_OVERHEAD_BYTES = 16
#: The largest object a header may state: envelope, the biggest codec head
#: and a body of the largest raw block the codec decodes (plus the shuffle
#: mode's per-frame plane lengths). Anything the local tier can decode fits.
_MAX_BLOB_BYTES = codec.HEADER_BYTES + codec.MAX_FRAMES * (_FRAME_ENTRY_BYTES + _FRAME_OVERHEAD_BYTES) + codec.MAX_RAW_BYTES
MAX_OBJECT_BYTES = ENVELOPE_BYTES + sealing.sealed_bytes(_MAX_BLOB_BYTES) + TRAILER_BYTES


class UnauthenticatedObject(Exception):
    """An object the reader's keys do not authenticate, or cannot open.

    Attributes:
        reason: the counter it is counted in: ``"unauthenticated"`` (it
            carries no MAC), ``"mac_mismatch"`` (no configured key made its
            MAC), ``"undecryptable"`` (encrypted, and no configured
            encryption key opens it) or ``"unencrypted"`` (not encrypted,
            and an encryption key is set).
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class RemoteObject:
    """A verified remote block (or, from a probe, its verified envelope).

    Attributes:
        key: the block key.
        parent: the parent key, None for a chain's first block.
        namespace_id: 16-byte namespace id (first bytes of its digest).
        blob: the codec blob, a read-only view into the fetched object
            (empty for a probe result).
        raw_bytes: raw payload length from the codec header (-1 for a
            probe result).
    """

    key: bytes
    parent: bytes | None
    namespace_id: bytes
    blob: Buffer
    raw_bytes: int


def _envelope(key: bytes, version: int, flags: int, namespace_id: bytes, parent: bytes | None) -> bytes:
    head = _ENVELOPE.pack(OBJECT_MAGIC, version, flags, namespace_id, parent or _NO_PARENT, 0)
    checksum = xxhash.xxh3_64(head + key).intdigest()
    return head[:_ENV_CHECKSUM_OFFSET] + struct.pack("<Q", checksum)


def seal_context(key: bytes, envelope: Buffer) -> bytes:
    """The sealing context of an object (:func:`ucm_db.remote.sealing.context`):
    its key and whole envelope (format version, flags, namespace id, parent)."""
    return sealing.context(SEAL_LABEL, key, memoryview(envelope)[:ENVELOPE_BYTES])


def pack_object(key: bytes, parent: bytes | None, namespace_id: bytes, blob: Buffer, keys: auth.AuthKeys | None = None,
                seal: SealingKeys | None = None) -> bytes:
    """Builds the object bytes for ``blob``: envelope + blob; with ``seal``
    the blob encrypted with its first key (version 3); with ``keys`` a
    trailer signed with the first key (over the ciphertext when sealed)."""
    if len(namespace_id) != 16:
        raise ConfigError("namespace id must be 16 bytes", hint="pass namespace.id")
    flags = _FLAG_HAS_PARENT if parent is not None else 0
    if seal is not None:
        head = _envelope(key, SEALED_FORMAT_VERSION, flags | (_FLAG_SIGNED if keys is not None else 0), namespace_id, parent)
        parts = [head, *seal.seal_parts(blob, seal_context(key, head))]
    else:
        head = _envelope(key, OBJECT_FORMAT_VERSION if keys is None else SIGNED_FORMAT_VERSION, flags, namespace_id, parent)
        parts = [head, blob]  # type: ignore[list-item]
    if keys is None:
        return b"".join(parts)
    signer = keys.signing_id
    _signer, tag = keys.sign([key, *parts, signer], auth.REMOTE_OBJECT)
    return b"".join((*parts, signer, tag))


def parse_envelope(data: Buffer, key: bytes) -> tuple[bytes | None, bytes]:
    """Verifies an object's envelope; returns ``(parent, namespace_id)``.

    Raises:
        CorruptBlockError: short, wrong magic or version, or bad checksum.
    """
    if len(data) < ENVELOPE_BYTES:
        raise CorruptBlockError(f"remote object of {len(data)} bytes is shorter than its envelope")
    magic, version, flags, namespace_id, parent, checksum = _ENVELOPE.unpack_from(data, 0)
    if magic != OBJECT_MAGIC:
        raise CorruptBlockError("bad magic: not a ucm-db remote object")
    if version not in _VERSIONS:
        raise CorruptBlockError(f"remote object format {version} is not one of {', '.join(map(str, _VERSIONS))}")
    view = memoryview(data)
    hasher = xxhash.xxh3_64(view[:_ENV_CHECKSUM_OFFSET])
    hasher.update(bytes(8))
    hasher.update(key)
    if hasher.intdigest() != checksum:
        raise CorruptBlockError("remote envelope checksum mismatch")
    return (bytes(parent) if flags & _FLAG_HAS_PARENT else None), bytes(namespace_id)


def stated_object_bytes(data: Buffer, key: bytes) -> int:
    """The exact length an object states for itself, from its first bytes.

    ``data`` must hold the envelope and the codec head (header and frame
    table), or for a sealed object the sealed head; the envelope is
    verified for ``key``.

    Raises:
        CorruptBlockError: bad envelope, implausible codec header, a body
            longer than the encoder can produce for the stated raw length,
            or a total above :data:`MAX_OBJECT_BYTES`.
    """
    parse_envelope(data, key)
    trailer = TRAILER_BYTES if is_signed(data) else 0
    if is_sealed(data):
        if len(data) < ENVELOPE_BYTES + sealing.HEAD_BYTES:
            raise CorruptBlockError("sealed remote object has no sealed head after its envelope")
        plain_bytes = sealing.stated_plain_bytes(memoryview(data)[ENVELOPE_BYTES:])
        if plain_bytes > _MAX_BLOB_BYTES:
            raise CorruptBlockError(f"sealed remote object states {plain_bytes} bytes of plaintext, more than a block can be")
        return ENVELOPE_BYTES + sealing.sealed_bytes(plain_bytes) + trailer
    blob = memoryview(data)[ENVELOPE_BYTES:]
    if len(blob) < codec.HEADER_BYTES or bytes(blob[:4]) != codec.MAGIC:
        raise CorruptBlockError("remote object has no codec header after its envelope")
    head = codec.head_bytes(blob)  # bounds n_frames
    n_frames = (head - codec.HEADER_BYTES) // _FRAME_ENTRY_BYTES
    raw_len, body_len = _CODEC_LENGTHS.unpack_from(blob, _CODEC_LENGTHS_OFFSET)
    if raw_len > codec.MAX_RAW_BYTES or body_len > raw_len + n_frames * _FRAME_OVERHEAD_BYTES:
        raise CorruptBlockError(f"implausible remote object: {raw_len} raw bytes stored in {body_len}")
    total = ENVELOPE_BYTES + head + body_len + trailer
    if total > MAX_OBJECT_BYTES:
        raise CorruptBlockError(f"remote object states {total} bytes, more than the {MAX_OBJECT_BYTES} allowed")
    return total


def _version_flags(data: Buffer) -> tuple[int, int]:
    return struct.unpack_from("<HH", data, 4)  # type: ignore[return-value]


def is_signed(data: Buffer) -> bool:
    """True if the object (its envelope already parsed) carries a MAC trailer."""
    version, flags = _version_flags(data)
    return version == SIGNED_FORMAT_VERSION or (version == SEALED_FORMAT_VERSION and bool(flags & _FLAG_SIGNED))


def is_sealed(data: Buffer) -> bool:
    """True if the object (its envelope already parsed) is encrypted."""
    return _version_flags(data)[0] == SEALED_FORMAT_VERSION


def probe_problem(data: Buffer, keys: auth.AuthKeys | None = None, seal: SealingKeys | None = None) -> str | None:
    """Why an object whose first bytes (envelope parsed, at least
    :data:`PROBE_BYTES`) were probed cannot be served to a reader with
    ``keys`` and ``seal``: the counter to count it in, or None when it may
    be (a probe checks no MAC nor tag: a forged object can lengthen a
    prefix search, never make a hit)."""
    if keys is not None and not is_signed(data):
        return "unauthenticated"
    if is_sealed(data) != (seal is not None):
        return "unencrypted" if seal is not None else "undecryptable"
    if seal is not None:
        return None if seal.knows(sealing.sealing_key_id(memoryview(data)[ENVELOPE_BYTES:])) else "undecryptable"
    return None if bytes(memoryview(data)[ENVELOPE_BYTES : ENVELOPE_BYTES + 4]) == codec.MAGIC else "corrupt"


def unpack_object(data: Buffer, key: bytes, keys: auth.AuthKeys | None = None, seal: SealingKeys | None = None) -> RemoteObject:
    """Verifies a whole object (envelope, MAC when ``keys`` are given, its
    encryption when sealed, codec blob) for ``key``.

    Raises:
        CorruptBlockError: damaged or malformed.
        UnauthenticatedObject: ``keys`` given, and no MAC or a MAC that no
            key of theirs made; ``seal`` given and the object not sealed,
            or sealed and not opened by a key of ``seal`` (or ``seal`` not
            given): see :class:`UnauthenticatedObject`'s reasons.
    """
    parent, namespace_id = parse_envelope(data, key)
    view = memoryview(data).toreadonly()  # views: no copy of the payload
    end = len(view)
    if is_signed(view):
        end -= TRAILER_BYTES
        if end < ENVELOPE_BYTES:
            raise CorruptBlockError("signed remote object is shorter than its envelope and trailer")
    if keys is not None:
        check_mac(view, key, keys)
    blob = view[ENVELOPE_BYTES:end]
    if is_sealed(view) or seal is not None:
        blob = open_blob(view, blob, key, seal)
    header = codec.verify(blob, key)
    return RemoteObject(key, parent, namespace_id, blob, header.raw_len)


def open_blob(data: memoryview, sealed: memoryview, key: bytes, seal: SealingKeys | None) -> memoryview:
    """The codec blob of an object ``data`` whose body is ``sealed``, as
    ``seal`` requires (:class:`UnauthenticatedObject` otherwise)."""
    if seal is None:
        raise UnauthenticatedObject("undecryptable", "remote object is encrypted and no encryption key is set")
    if not is_sealed(data):
        raise UnauthenticatedObject("unencrypted", "remote object is not encrypted and an encryption key is set")
    try:
        return memoryview(seal.open(sealed, seal_context(key, data))).toreadonly()
    except UnsealError as exc:
        raise UnauthenticatedObject("undecryptable", f"remote object cannot be opened: {exc}") from None


def check_mac(data: memoryview, key: bytes, keys: auth.AuthKeys) -> None:
    """Raises :class:`UnauthenticatedObject` unless one of ``keys`` signed
    the object ``data`` of ``key`` (envelope already parsed)."""
    if not is_signed(data):
        raise UnauthenticatedObject("unauthenticated", "remote object carries no MAC and an auth key is set")
    body_end = len(data) - TRAILER_BYTES
    signer, tag = data[body_end : body_end + auth.KEY_ID_BYTES], data[body_end + auth.KEY_ID_BYTES :]
    if not keys.verify([key, data[:body_end], signer], auth.REMOTE_OBJECT, bytes(signer), bytes(tag)):
        raise UnauthenticatedObject("mac_mismatch", "remote object's MAC was not made by any configured auth key")
