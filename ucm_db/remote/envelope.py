"""The remote tier's object format: a verified envelope around a codec blob.

Object format (little-endian): a 64-byte envelope followed by the codec blob
(:mod:`ucm_db.codec`) exactly as the local tier stores it::

    envelope  magic "UCMR" | version u16 | flags u16 | namespace id 16B |
              parent key 32B | checksum u64
    blob      codec header (owning key, raw length, ...) | frame table | body
    trailer   (version 2 only) key id 8B | MAC 32B

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

Invariants:
    * An object states its own exact length in its first
      :data:`PROBE_BYTES` (:func:`stated_object_bytes`), never more than
      :data:`MAX_OBJECT_BYTES`: a reader needs to read no further.
    * Every parse failure is a :class:`~ucm_db.errors.CorruptBlockError`;
      an object that the reader's keys do not authenticate is an
      :class:`UnauthenticatedObject` (not damage: nothing to quarantine).
    * With keys, the MAC is checked before the codec parses the blob.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

from ucm_db import auth, codec
from ucm_db.errors import ConfigError, CorruptBlockError
from ucm_db.engines.base import Buffer

OBJECT_MAGIC = b"UCMR"
OBJECT_FORMAT_VERSION = 1
#: The format of an object signed with a key (a MAC trailer).
SIGNED_FORMAT_VERSION = 2
TRAILER_BYTES = auth.KEY_ID_BYTES + auth.MAC_BYTES
_ENVELOPE = struct.Struct("<4sHH16s32sQ")
ENVELOPE_BYTES = _ENVELOPE.size
_ENV_CHECKSUM_OFFSET = ENVELOPE_BYTES - 8
_FLAG_HAS_PARENT = 1
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
MAX_OBJECT_BYTES = (ENVELOPE_BYTES + codec.HEADER_BYTES + codec.MAX_FRAMES * (_FRAME_ENTRY_BYTES + _FRAME_OVERHEAD_BYTES)
                    + codec.MAX_RAW_BYTES + TRAILER_BYTES)


class UnauthenticatedObject(Exception):
    """An object the reader's keys do not authenticate.

    Attributes:
        reason: ``"unauthenticated"`` (it carries no MAC) or
            ``"mac_mismatch"`` (no configured key made its MAC).
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


def pack_object(key: bytes, parent: bytes | None, namespace_id: bytes, blob: Buffer, keys: auth.AuthKeys | None = None) -> bytes:
    """Builds the object bytes for ``blob`` (envelope + blob, and with
    ``keys`` a trailer signed with the first key)."""
    if len(namespace_id) != 16:
        raise ConfigError("namespace id must be 16 bytes", hint="pass namespace.digest[:16]")
    flags = _FLAG_HAS_PARENT if parent is not None else 0
    version = OBJECT_FORMAT_VERSION if keys is None else SIGNED_FORMAT_VERSION
    head = _ENVELOPE.pack(OBJECT_MAGIC, version, flags, namespace_id, parent or _NO_PARENT, 0)
    checksum = xxhash.xxh3_64(head + key).intdigest()
    head = head[:_ENV_CHECKSUM_OFFSET] + struct.pack("<Q", checksum)
    if keys is None:
        return head + bytes(blob)
    signer = keys.signing_id
    _signer, tag = keys.sign([key, head, blob, signer], auth.REMOTE_OBJECT)
    return b"".join((head, blob, signer, tag))


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
    if version not in (OBJECT_FORMAT_VERSION, SIGNED_FORMAT_VERSION):
        raise CorruptBlockError(f"remote object format {version} is not {OBJECT_FORMAT_VERSION} or {SIGNED_FORMAT_VERSION}")
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
    table); the envelope is verified for ``key``.

    Raises:
        CorruptBlockError: bad envelope, implausible codec header, a body
            longer than the encoder can produce for the stated raw length,
            or a total above :data:`MAX_OBJECT_BYTES`.
    """
    parse_envelope(data, key)
    blob = memoryview(data)[ENVELOPE_BYTES:]
    if len(blob) < codec.HEADER_BYTES or bytes(blob[:4]) != codec.MAGIC:
        raise CorruptBlockError("remote object has no codec header after its envelope")
    head = codec.head_bytes(blob)  # bounds n_frames
    n_frames = (head - codec.HEADER_BYTES) // _FRAME_ENTRY_BYTES
    raw_len, body_len = _CODEC_LENGTHS.unpack_from(blob, _CODEC_LENGTHS_OFFSET)
    if raw_len > codec.MAX_RAW_BYTES or body_len > raw_len + n_frames * _FRAME_OVERHEAD_BYTES:
        raise CorruptBlockError(f"implausible remote object: {raw_len} raw bytes stored in {body_len}")
    total = ENVELOPE_BYTES + head + body_len + (TRAILER_BYTES if is_signed(data) else 0)
    if total > MAX_OBJECT_BYTES:
        raise CorruptBlockError(f"remote object states {total} bytes, more than the {MAX_OBJECT_BYTES} allowed")
    return total


def is_signed(data: Buffer) -> bool:
    """True if the object (its envelope already parsed) carries a MAC trailer."""
    return bool(struct.unpack_from("<H", data, 4)[0] == SIGNED_FORMAT_VERSION)


def unpack_object(data: Buffer, key: bytes, keys: auth.AuthKeys | None = None) -> RemoteObject:
    """Verifies a whole object (envelope, MAC when ``keys`` are given, codec
    blob) for ``key``.

    Raises:
        CorruptBlockError: damaged or malformed.
        UnauthenticatedObject: ``keys`` given, and no MAC or a MAC that no
            key of theirs made.
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
    header = codec.verify(view[ENVELOPE_BYTES:end], key)
    return RemoteObject(key, parent, namespace_id, view[ENVELOPE_BYTES:end], header.raw_len)


def check_mac(data: memoryview, key: bytes, keys: auth.AuthKeys) -> None:
    """Raises :class:`UnauthenticatedObject` unless one of ``keys`` signed
    the object ``data`` of ``key`` (envelope already parsed)."""
    if not is_signed(data):
        raise UnauthenticatedObject("unauthenticated", "remote object carries no MAC and an auth key is set")
    body_end = len(data) - TRAILER_BYTES
    signer, tag = data[body_end : body_end + auth.KEY_ID_BYTES], data[body_end + auth.KEY_ID_BYTES :]
    if not keys.verify([key, data[:body_end], signer], auth.REMOTE_OBJECT, bytes(signer), bytes(tag)):
        raise UnauthenticatedObject("mac_mismatch", "remote object's MAC was not made by any configured auth key")
