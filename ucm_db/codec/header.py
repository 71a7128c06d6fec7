"""The block wire format of :mod:`ucm_db.codec`: its constants, the header,
and the checks that read a head (bounds, owning key, checksum).

See :mod:`ucm_db.codec` for the layout of header, frame table and body.

Invariants:
    * Every length is checked against the header's bounds before anything
      is allocated; any mismatch raises
      :class:`~ucm_db.errors.CorruptBlockError`.
    * The checksum (xxh3-64) covers header (checksum field zeroed), table
      and body; :func:`head_hasher` is its state after the head.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

from ucm_db.buffers import Buffer
from ucm_db.errors import CorruptBlockError

MAGIC = b"UCMB"
CODEC_FORMAT_VERSION = 1
CODEC_IDS = {"none": 0, "zstd": 1}
MODE_RAW, MODE_ZSTD, MODE_SHUFFLE = 0, 1, 2
MAX_FRAMES = 4096

#: Largest raw block accepted on decode (bounds allocation on hostile input).
MAX_RAW_BYTES = 1 << 32

HEADER_STRUCT = struct.Struct("<4sHBBIQQ32sQ")
FRAME_STRUCT = struct.Struct("<QQBBB5x")
HEADER_BYTES = HEADER_STRUCT.size
CHECKSUM_OFFSET = HEADER_BYTES - 8
CODEC_ID_OFFSET = 6
N_FRAMES_OFFSET = 8
RAW_LEN_OFFSET = 12  # the header's raw length (u64, little-endian)
CODEC_NAMES = {cid: name for name, cid in CODEC_IDS.items()}
#: Frame tables (bytes) all of whose frames are raw -> their raw total (all_raw).
RAW_TABLES: dict[bytes, int] = {}
ZERO_CHECKSUM = bytes(8)


_DTYPE_ELEMENT_BYTES = {
    "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2,
    "float32": 4, "fp32": 4, "float": 4,
}


def element_bytes_for(kv_dtype: str) -> int:
    """Element size used for byte-shuffling a KV dtype (1 = no shuffle)."""
    name = kv_dtype.lower().removeprefix("torch.")
    return _DTYPE_ELEMENT_BYTES.get(name, 1)


@dataclass(frozen=True, slots=True)
class Header:
    """Parsed block header (validated against the blob's length)."""

    codec: str
    n_frames: int
    raw_len: int
    body_len: int
    key: bytes
    checksum: int


def head_bytes(blob: Buffer) -> int:
    """Length of a blob's head (header + table), bounds-checked."""
    if len(blob) < HEADER_BYTES:
        raise CorruptBlockError(f"block of {len(blob)} bytes is shorter than its header")
    n_frames = struct.unpack_from("<I", blob, N_FRAMES_OFFSET)[0]
    if n_frames > MAX_FRAMES:
        raise CorruptBlockError(f"implausible header: {n_frames} frames")
    return HEADER_BYTES + n_frames * FRAME_STRUCT.size


def split(blob: Buffer) -> tuple[memoryview, memoryview]:
    """A blob's head and body, as views (no copy)."""
    view = memoryview(blob)
    at = head_bytes(view)
    return view[:at], view[at:]


def read_header(blob: Buffer) -> Header:
    """Parses and bounds-checks a blob's header (checksum not verified)."""
    head, body = split(blob)
    return read_head(head, len(body))


def read_head(head: Buffer, body_bytes: int) -> Header:
    """Parses and bounds-checks a head against its body's length."""
    if len(head) < HEADER_BYTES:
        raise CorruptBlockError(f"block head of {len(head)} bytes is shorter than its header")
    magic, version, codec_id, _flags, n_frames, raw_len, body_len, key, checksum = HEADER_STRUCT.unpack_from(head, 0)
    if magic != MAGIC:
        raise CorruptBlockError("bad magic: not a ucm-db block")
    if version != CODEC_FORMAT_VERSION:
        raise CorruptBlockError(f"block format {version} is not {CODEC_FORMAT_VERSION}")
    codec = CODEC_NAMES.get(codec_id)
    if codec is None:
        raise CorruptBlockError(f"unknown codec id {codec_id}")
    if n_frames > MAX_FRAMES or raw_len > MAX_RAW_BYTES:
        raise CorruptBlockError(f"implausible header: {n_frames} frames, {raw_len} raw bytes")
    if HEADER_BYTES + n_frames * FRAME_STRUCT.size != len(head):
        raise CorruptBlockError(f"block head of {len(head)} bytes does not match its {n_frames} frames")
    if body_len != body_bytes:
        raise CorruptBlockError(f"block body of {body_bytes} bytes does not match its header ({body_len})")
    return Header(codec, n_frames, raw_len, body_len, bytes(key), checksum)


def verify(blob: Buffer, key: bytes) -> Header:
    """Checks header bounds, owning key and checksum; returns the header."""
    head, body = split(blob)
    return verify_parts(head, body, key)


def verify_parts(head: Buffer, body: Buffer, key: bytes) -> Header:
    """:func:`verify` for a head and body kept apart."""
    return verify_read_head(head, body, key, read_head(head, len(body)))


def verify_read_head(head: Buffer, body: Buffer, key: bytes, header: Header) -> Header:
    """:func:`verify_parts` for a head :func:`read_head` already parsed into ``header``."""
    if header.key != key:
        raise CorruptBlockError("block belongs to another key")
    hasher = head_hasher(head)
    hasher.update(body)
    if hasher.intdigest() != header.checksum:
        raise CorruptBlockError("checksum mismatch")
    return header


def head_hasher(head: Buffer) -> xxhash.xxh3_64:
    """The block checksum's state after the head (checksum field zeroed):
    updated with the body, its digest is the header's checksum."""
    head_view = memoryview(head)
    hasher = xxhash.xxh3_64(head_view[:CHECKSUM_OFFSET])
    hasher.update(ZERO_CHECKSUM)
    hasher.update(head_view[HEADER_BYTES:])
    return hasher


def all_raw(head: Buffer, header: Header, body_bytes: int) -> bool:
    """Whether every frame of a checked head is stored raw, as long as it
    is raw, and the frames fill the block exactly: then the body is the raw
    bytes themselves (what codec ``none`` writes). Tables found raw are
    remembered with their total (a store's units share a few tables)."""
    if header.raw_len != body_bytes:
        return False
    table = bytes(memoryview(head)[HEADER_BYTES:])
    total = RAW_TABLES.get(table)
    if total is None:
        frames = list(FRAME_STRUCT.iter_unpack(table))
        if any(f[2] != MODE_RAW or f[0] != f[1] for f in frames):  # (raw_len, stored_len, mode, ...)
            return False
        if len(RAW_TABLES) >= 1024:
            RAW_TABLES.clear()  # bounded whatever the input
        total = RAW_TABLES[table] = sum(f[0] for f in frames)
    return total == body_bytes


def codec_of_head(head: Buffer) -> str | None:
    """The codec named by a head (unverified), or None if unreadable."""
    if len(head) <= CODEC_ID_OFFSET:
        return None
    return CODEC_NAMES.get(head[CODEC_ID_OFFSET])


def raw_len_of_head(head: Buffer) -> int:
    """The raw length a head states (unverified), or -1 if it has no header."""
    if len(head) < HEADER_BYTES:
        return -1
    return int(struct.unpack_from("<Q", head, RAW_LEN_OFFSET)[0])


def mean_frame_bytes_of_head(head: Buffer) -> int:
    """Raw bytes per frame on average, as a head states them (unverified;
    0 if unreadable): what the codec pool sizes its work by."""
    if len(head) < HEADER_BYTES:
        return 0
    n_frames = struct.unpack_from("<I", head, N_FRAMES_OFFSET)[0]
    raw_len = struct.unpack_from("<Q", head, N_FRAMES_OFFSET + 4)[0]
    return raw_len // n_frames if n_frames else 0


def frame_sizes(blob: Buffer) -> list[int]:
    """Raw sizes of the blob's frames (header-checked, not checksummed)."""
    header = read_header(blob)
    return [FRAME_STRUCT.unpack_from(blob, HEADER_BYTES + i * FRAME_STRUCT.size)[0] for i in range(header.n_frames)]
