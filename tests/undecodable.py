"""A block whose checksum holds but whose frames do not decode: what a
writer with a bug, or a hostile one, could store or upload. It passes every
check a fetch or a checksum makes and fails only when decoded."""

from __future__ import annotations

import struct

import xxhash

from ucm_db import codec

#: Offset of the mode byte in a frame table entry (raw_len Q, stored_len Q, mode B, ...).
_MODE_OFFSET = 16
_UNKNOWN_MODE = 9


def resealed_head(head: bytes | bytearray, body: bytes) -> bytes:
    """``head`` (edited by the caller) with its checksum recomputed over it
    and ``body``, as the encoder seals a block."""
    out = bytearray(head)
    checksum_at = codec.HEADER_BYTES - 8
    hasher = xxhash.xxh3_64(bytes(out[:checksum_at]) + bytes(8))
    hasher.update(bytes(out[codec.HEADER_BYTES:]))
    hasher.update(body)
    struct.pack_into("<Q", out, checksum_at, hasher.intdigest())
    return bytes(out)


def undecodable_head(head: bytes, body: bytes) -> bytes:
    """``head`` with its first frame's mode set to one no codec knows and
    the checksum recomputed over the new head and ``body``."""
    out = bytearray(head)
    out[codec.HEADER_BYTES + _MODE_OFFSET] = _UNKNOWN_MODE
    return resealed_head(out, body)


def undecodable_blob(blob: bytes) -> bytes:
    """:func:`undecodable_head` for a whole blob (head and body joined)."""
    at = codec.head_bytes(blob)
    return undecodable_head(blob[:at], blob[at:]) + blob[at:]
