"""The remote tier's object format: a verified envelope around a codec blob.

Object format (little-endian): a 64-byte envelope followed by the codec blob
(:mod:`ucm_db.codec`) exactly as the local tier stores it::

    envelope  magic "UCMR" | version u16 | flags u16 | namespace id 16B |
              parent key 32B | checksum u64
    blob      codec header (owning key, raw length, ...) | frame table | body

The envelope carries what the codec blob lacks to promote the block into a
local tier: its parent key (flag bit 0 set; a chain's first block has none)
and the 16-byte namespace id. Its checksum is xxh3-64 over the envelope with
the checksum field zeroed, followed by the object's own key, so an envelope
that is bit-flipped or served under another key's path fails.

Invariants:
    * An object states its own exact length in its first
      :data:`PROBE_BYTES` (:func:`stated_object_bytes`), never more than
      :data:`MAX_OBJECT_BYTES`: a reader needs to read no further.
    * Every parse failure is a :class:`~ucm_db.errors.CorruptBlockError`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

from ucm_db import codec
from ucm_db.errors import ConfigError, CorruptBlockError
from ucm_db.tiers.base import Buffer

OBJECT_MAGIC = b"UCMR"
OBJECT_FORMAT_VERSION = 1
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
                    + codec.MAX_RAW_BYTES)


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


def pack_object(key: bytes, parent: bytes | None, namespace_id: bytes, blob: Buffer) -> bytes:
    """Builds the object bytes for ``blob`` (envelope + blob)."""
    if len(namespace_id) != 16:
        raise ConfigError("namespace id must be 16 bytes", hint="pass namespace.digest[:16]")
    flags = _FLAG_HAS_PARENT if parent is not None else 0
    head = _ENVELOPE.pack(OBJECT_MAGIC, OBJECT_FORMAT_VERSION, flags, namespace_id, parent or _NO_PARENT, 0)
    checksum = xxhash.xxh3_64(head + key).intdigest()
    return head[:_ENV_CHECKSUM_OFFSET] + struct.pack("<Q", checksum) + bytes(blob)


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
    if version != OBJECT_FORMAT_VERSION:
        raise CorruptBlockError(f"remote object format {version} is not {OBJECT_FORMAT_VERSION}")
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
    total = ENVELOPE_BYTES + head + body_len
    if total > MAX_OBJECT_BYTES:
        raise CorruptBlockError(f"remote object states {total} bytes, more than the {MAX_OBJECT_BYTES} allowed")
    return total


def unpack_object(data: Buffer, key: bytes) -> RemoteObject:
    """Verifies a whole object (envelope and codec blob) for ``key``."""
    parent, namespace_id = parse_envelope(data, key)
    blob = memoryview(data).toreadonly()[ENVELOPE_BYTES:]  # a view: no copy of the payload
    header = codec.verify(blob, key)
    return RemoteObject(key, parent, namespace_id, blob, header.raw_len)
