"""Block payload encoding: header, checksum, byte-shuffle + zstd.

Wire format (little-endian)::

    header   magic "UCMB" | format u16 | codec u8 | flags u8 | n_frames u32 |
             raw_len u64 | body_len u64 | key 32B | checksum u64
    table    n_frames x (raw_len u64 | stored_len u64 | mode u8 |
             element_bytes u8 | plane_mask u8 | 5 pad)
    body     the frames' stored bytes, back to back

The *head* is header plus table; the *body* is the frames. A blob is head
and body back to back (remote objects, archives); the local tier keeps the
two apart (:func:`encode_parts`, :func:`decode_parts_into`) so that an
uncompressed body goes into the store as the caller's own buffer, without a
copy to put a header in front of it.

A frame is a run of the caller's frames (layers) or the whole block. With
codec ``none`` each caller frame is one stored frame; ``zstd`` compresses
runs of adjacent small frames together (:data:`ZSTD_GROUP_BYTES`), so its
frame table keeps fewer boundaries than the caller gave. Readers place
layers by the layout, never by the frame table. Modes: RAW (stored as is),
ZSTD (whole frame), SHUFFLE (bytes of each element split into planes, plane
``i`` zstd-compressed if bit ``i`` of plane_mask is set, else raw; the body
of such a frame starts with one u32 stored length per plane).

Invariants:
    * The checksum (xxh3-64) covers header (checksum field zeroed), table and
      body, and the header holds the owning key: a block served for the
      wrong key, truncated, extended or bit-flipped fails :func:`decode`.
    * Every length is checked against the header's bounds before anything is
      allocated or decompressed (no decompression bombs).
    * Any mismatch raises :class:`~ucm_db.errors.CorruptBlockError`; nothing
      else escapes for malformed input.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Union, cast

import xxhash
import zstandard

from ucm_db import checked_copy, native
from ucm_db.errors import ConfigError, CorruptBlockError

Buffer = Union[bytes, bytearray, memoryview]

MAGIC = b"UCMB"
CODEC_FORMAT_VERSION = 1
CODEC_IDS = {"none": 0, "zstd": 1}
MODE_RAW, MODE_ZSTD, MODE_SHUFFLE = 0, 1, 2
MAX_FRAMES = 4096
#: zstd compresses adjacent frames of a block together until a group holds
#: this many raw bytes: below ~64 KiB zstd's fixed cost per frame (a
#: context reset, the frame's entropy tables) dominates. bf16-like K/V
#: through the store on the 2-core host (``ucm-db bench codec-frames``,
#: BENCHMARKS.md): 512 KiB blocks of 8 KiB frames (vLLM-CPU's layer of one
#: head) decode at 0.61 GB/s and encode at 0.20 GB/s frame by frame, at
#: 1.47 and 0.43 GB/s grouped; a 4 KiB exponent plane took ~10 us alone.
ZSTD_GROUP_BYTES = 256 << 10
#: Largest raw block accepted on decode (bounds allocation on hostile input).
MAX_RAW_BYTES = 1 << 32

_HEADER = struct.Struct("<4sHBBIQQ32sQ")
_FRAME = struct.Struct("<QQBBB5x")
HEADER_BYTES = _HEADER.size
_CHECKSUM_OFFSET = HEADER_BYTES - 8
_CODEC_ID_OFFSET = 6
_N_FRAMES_OFFSET = 8
_CODEC_NAMES = {cid: name for name, cid in CODEC_IDS.items()}
#: Frame tables (bytes) all of whose frames are raw -> their raw total (all_raw).
_RAW_TABLES: dict[bytes, int] = {}
_ZERO_CHECKSUM = bytes(8)
#: A plane is kept compressed only if it shrinks below this fraction.
_KEEP_COMPRESSED_RATIO = 0.92
_PROBE_BYTES = 64 * 1024
#: zstd settings for byte planes at level 1. The exponent plane of bf16/fp16
#: K/V repeats little beyond a few bytes, so level 1's short matches cost
#: more to code and to decode than the literals they replace; asking for
#: 7-byte matches from a small hash table leaves an almost literal-only
#: (Huffman) frame that is slightly smaller and about 1.5x faster to
#: decompress on real bf16 K/V (BENCHMARKS.md). Any zstd decoder reads it.
_PLANE_PARAMS = zstandard.ZstdCompressionParameters(
    strategy=zstandard.STRATEGY_FAST, window_log=17, hash_log=8, chain_log=6, search_log=1,
    min_match=7, target_length=0, write_content_size=True,
)

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


_local = threading.local()


def _compressor(level: int, *, planes: bool = False) -> zstandard.ZstdCompressor:
    """This thread's compressor for ``level`` (plane-tuned at level 1)."""
    cache = getattr(_local, "cctx", None)
    if cache is None:
        cache = _local.cctx = {}
    tuned = planes and level == 1
    cctx = cache.get((level, tuned))
    if cctx is None:
        if tuned:
            cctx = zstandard.ZstdCompressor(compression_params=_PLANE_PARAMS)
        else:
            cctx = zstandard.ZstdCompressor(level=level, write_content_size=True)
        cache[(level, tuned)] = cctx
    return cctx


def _decompressor() -> zstandard.ZstdDecompressor:
    dctx = getattr(_local, "dctx", None)
    if dctx is None:
        dctx = _local.dctx = zstandard.ZstdDecompressor()
    return dctx


@dataclass(frozen=True, slots=True)
class EncodedBlock:
    """One encoded block as head (sealed header + frame table) and body.

    ``body`` is a list of buffers laid back to back; for codec ``none`` they
    are views of the caller's frames (valid while the caller's buffers are).
    """

    head: bytes
    body: list[Buffer]
    raw_len: int
    body_len: int

    def body_buffer(self) -> Buffer:
        """The body as one buffer: the caller's own when there is one part."""
        if len(self.body) == 1:
            return self.body[0]
        return b"".join(self.body)

    def blob(self) -> bytes:
        """Head and body joined: the portable form (remote, archives)."""
        return b"".join([self.head, *self.body])


def buffer_view(obj: object, what: str) -> memoryview:
    """``memoryview(obj)``, or a :class:`ConfigError` naming what ``obj``
    is: not a buffer at all, or a numpy dtype that exports none
    (datetime64, timedelta64)."""
    try:
        return memoryview(obj)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        dtype = getattr(obj, "dtype", None)
        if dtype is not None:
            raise ConfigError(
                f"{what} of dtype {dtype} exposes no buffer to store",
                hint="store its bytes as integers, e.g. arr.view(numpy.int64) for datetime64/timedelta64",
            ) from None
        raise ConfigError(
            f"{what} must be bytes-like (bytes, bytearray, memoryview, numpy array), got {type(obj).__name__}",
            hint="pass the block's bytes, or a list of per-layer byte buffers",
        ) from None


@dataclass(frozen=True, slots=True)
class Framed:
    """A block held in one contiguous buffer and cut into frames (e.g. a
    staged KV unit whose layers lie back to back): encoded exactly like the
    list of its frames, but with codec ``none`` the body is ``buffer``
    itself, never joined from its pieces.

    Attributes:
        buffer: the block's bytes (C-contiguous).
        frame_bytes: the frames' lengths, in order; they sum to the
            buffer's length.
    """

    buffer: Buffer
    frame_bytes: tuple[int, ...]

    def __post_init__(self) -> None:
        view = buffer_view(self.buffer, "a Framed buffer")
        if isinstance(self.frame_bytes, list):
            object.__setattr__(self, "frame_bytes", tuple(self.frame_bytes))
        if not isinstance(self.frame_bytes, tuple):
            raise ConfigError(
                f"Framed.frame_bytes is a tuple of frame lengths, got {type(self.frame_bytes).__name__}",
                hint="pass each frame's length in bytes, e.g. Framed(buf, (len(buf),)) for one frame",
            )
        if not view.c_contiguous:
            raise ConfigError("a Framed buffer is not C-contiguous (a strided view)", hint="pass numpy.ascontiguousarray(buffer)")
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in self.frame_bytes):
            raise ConfigError("Framed.frame_bytes must be non-negative integers", hint="pass each frame's length in bytes")
        if sum(self.frame_bytes) != view.nbytes:
            raise ConfigError(
                f"Framed.frame_bytes sum to {sum(self.frame_bytes)} bytes but the buffer holds {view.nbytes}",
                hint="pass one length per frame, covering the whole buffer",
            )

    def frames(self) -> list[memoryview]:
        """The frames as views of the buffer (no copy)."""
        view = memoryview(self.buffer).cast("B")
        out, offset = [], 0
        for n in self.frame_bytes:
            out.append(view[offset : offset + n])
            offset += n
        return out


def encode(
    key: bytes,
    frames: Sequence[Buffer] | Buffer,
    *,
    codec: str = "zstd",
    element_bytes: int = 2,
    level: int = 1,
) -> bytes:
    """Encodes one block into a blob (head and body joined); see :func:`encode_parts`."""
    return encode_parts(key, frames, codec=codec, element_bytes=element_bytes, level=level).blob()


def encode_parts(
    key: bytes,
    frames: Sequence[Buffer] | Buffer | Framed,
    *,
    codec: str = "zstd",
    element_bytes: int = 2,
    level: int = 1,
) -> EncodedBlock:
    """Encodes one block.

    Args:
        key: the 32-byte key the block belongs to (bound into the checksum).
        frames: the block's raw bytes, a sequence of per-layer frames, or
            a :class:`Framed` buffer.
        codec: ``"none"`` or ``"zstd"``.
        element_bytes: element size for byte-shuffling (2 for bf16/fp16).
        level: zstd level.

    Returns:
        The head and the body; nothing of the payload is copied for codec
        ``none``.
    """
    if codec not in CODEC_IDS:
        raise ConfigError(f"unknown codec {codec!r}", hint=f"use one of {', '.join(CODEC_IDS)}")
    if len(key) != 32:
        raise ConfigError("block keys are 32 bytes", hint="use Namespace.block_keys")
    if isinstance(frames, (bytes, bytearray, memoryview)):
        frames = [frames]
    if len(frames.frame_bytes if isinstance(frames, Framed) else frames) > MAX_FRAMES:
        raise ConfigError(f"at most {MAX_FRAMES} frames per block", hint="merge layers into fewer frames")
    if isinstance(frames, Framed):
        if codec == "none":
            return _encode_framed_raw(key, frames)
        groups = _zstd_groups_of_framed(frames, element_bytes)
    else:
        views = [memoryview(frame).cast("B") for frame in frames]
        groups = views if codec == "none" else _zstd_groups_of_views(views, element_bytes)
    table: list[bytes] = []
    parts: list[Buffer] = []
    raw_len = body_len = 0
    for view in groups:
        mode, elem, mask, stored = _encode_frame(view, codec, element_bytes, level)
        stored_len = sum(len(p) for p in stored)
        table.append(_FRAME.pack(len(view), stored_len, mode, elem, mask))
        parts.extend(stored)
        raw_len += len(view)
        body_len += stored_len
    return _sealed(key, codec, table, parts, raw_len, body_len)


def _zstd_runs(frame_bytes: Sequence[int], element_bytes: int) -> list[range]:
    """Which frames zstd compresses together: runs of adjacent frames (as
    index ranges) joined until a run holds :data:`ZSTD_GROUP_BYTES`. A
    frame of that size or more stands alone, and so does one whose length
    is not a whole number of elements, so every run shuffles on element
    boundaries."""
    step = element_bytes if element_bytes in (2, 4) else 1
    runs: list[range] = []
    start = run_bytes = 0
    for i, size in enumerate(frame_bytes):
        if size >= ZSTD_GROUP_BYTES or size % step:
            if start < i:
                runs.append(range(start, i))
            runs.append(range(i, i + 1))
            start, run_bytes = i + 1, 0
            continue
        run_bytes += size
        if run_bytes >= ZSTD_GROUP_BYTES:
            runs.append(range(start, i + 1))
            start, run_bytes = i + 1, 0
    if start < len(frame_bytes):
        runs.append(range(start, len(frame_bytes)))
    return runs


def _zstd_groups_of_views(views: list[memoryview], element_bytes: int) -> list[memoryview]:
    """The compression groups of separate frames (a run of several is joined: one copy)."""
    runs = _zstd_runs([len(v) for v in views], element_bytes)
    return [views[r.start] if len(r) == 1 else memoryview(b"".join(views[r.start : r.stop])) for r in runs]


def _zstd_groups_of_framed(framed: Framed, element_bytes: int) -> list[memoryview]:
    """The compression groups of a :class:`Framed` block: views of its buffer, no copy."""
    body = memoryview(framed.buffer).cast("B")
    offsets = [0]
    for size in framed.frame_bytes:
        offsets.append(offsets[-1] + size)
    return [body[offsets[r.start] : offsets[r.stop]] for r in _zstd_runs(framed.frame_bytes, element_bytes)]


def _sealed(key: bytes, codec: str, table: list[bytes], parts: list[Buffer], raw_len: int, body_len: int) -> EncodedBlock:
    """The block with its header, whose checksum covers header, table and body."""
    header = _HEADER.pack(MAGIC, CODEC_FORMAT_VERSION, CODEC_IDS[codec], 0, len(table), raw_len, body_len, bytes(key), 0)
    hasher = xxhash.xxh3_64(header)
    for entry in table:
        hasher.update(entry)
    for piece in parts:
        hasher.update(piece)
    head = b"".join([header[:_CHECKSUM_OFFSET], struct.pack("<Q", hasher.intdigest()), *table])
    return EncodedBlock(head, parts, raw_len, body_len)


def _encode_framed_raw(key: bytes, framed: Framed) -> EncodedBlock:
    """Codec ``none`` of a :class:`Framed` block (at most ``MAX_FRAMES``
    frames, checked by :func:`encode_parts`): the same bytes as its frames'
    list would give, with the buffer itself as the one body part."""
    body = memoryview(framed.buffer).cast("B")
    table = [_FRAME.pack(n, n, MODE_RAW, 1, 0) for n in framed.frame_bytes]
    return _sealed(key, "none", table, [body], len(body), len(body))


def _encode_frame(view: memoryview, codec: str, element_bytes: int, level: int) -> tuple[int, int, int, list[Buffer]]:
    if codec == "none" or len(view) == 0:
        return MODE_RAW, 1, 0, [view]
    cctx = _compressor(level)
    if element_bytes not in (2, 4) or len(view) % element_bytes:
        packed = cctx.compress(view)
        if len(packed) < len(view) * _KEEP_COMPRESSED_RATIO:
            return MODE_ZSTD, 1, 0, [packed]
        return MODE_RAW, 1, 0, [view]
    planes = _shuffle(view, element_bytes)
    cctx = _compressor(level, planes=True)
    mask = 0
    stored: list[Buffer] = []
    top = element_bytes - 1
    for i, plane in enumerate(planes):
        # Only low planes (mantissa bits) are probed first: the top plane of
        # a float holds sign and exponent and is nearly always compressible.
        probe = plane[:_PROBE_BYTES]
        if i == top or len(cctx.compress(probe)) < len(probe) * _KEEP_COMPRESSED_RATIO:
            packed = cctx.compress(plane)
            if len(packed) < len(plane) * _KEEP_COMPRESSED_RATIO:
                mask |= 1 << i
                stored.append(packed)
                continue
        stored.append(plane)
    if not mask:  # no plane shrank: the frame as it is reads back with one copy, no plane merge
        return MODE_RAW, 1, 0, [view]
    lengths = struct.pack(f"<{element_bytes}I", *(len(p) for p in stored))
    return MODE_SHUFFLE, element_bytes, mask, [lengths, *stored]


def _shuffle(view: memoryview, element_bytes: int) -> list[memoryview]:
    """Splits elements into byte planes, least significant byte first
    (one pass in C when :mod:`ucm_db.native` is built)."""
    return [memoryview(p) for p in native.split_planes(view, element_bytes)]


def _unshuffle(planes: list[Buffer], out: memoryview, element_bytes: int) -> None:
    """Interleaves byte planes back into elements, straight into ``out``."""
    try:
        native.merge_planes(planes, out, element_bytes)
    except ValueError as exc:
        raise CorruptBlockError(f"byte planes do not fit the frame: {exc}") from exc


def head_bytes(blob: Buffer) -> int:
    """Length of a blob's head (header + table), bounds-checked."""
    if len(blob) < HEADER_BYTES:
        raise CorruptBlockError(f"block of {len(blob)} bytes is shorter than its header")
    n_frames = struct.unpack_from("<I", blob, _N_FRAMES_OFFSET)[0]
    if n_frames > MAX_FRAMES:
        raise CorruptBlockError(f"implausible header: {n_frames} frames")
    return HEADER_BYTES + n_frames * _FRAME.size


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
    magic, version, codec_id, _flags, n_frames, raw_len, body_len, key, checksum = _HEADER.unpack_from(head, 0)
    if magic != MAGIC:
        raise CorruptBlockError("bad magic: not a ucm-db block")
    if version != CODEC_FORMAT_VERSION:
        raise CorruptBlockError(f"block format {version} is not {CODEC_FORMAT_VERSION}")
    codec = _CODEC_NAMES.get(codec_id)
    if codec is None:
        raise CorruptBlockError(f"unknown codec id {codec_id}")
    if n_frames > MAX_FRAMES or raw_len > MAX_RAW_BYTES:
        raise CorruptBlockError(f"implausible header: {n_frames} frames, {raw_len} raw bytes")
    if HEADER_BYTES + n_frames * _FRAME.size != len(head):
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
    header = read_head(head, len(body))
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
    hasher = xxhash.xxh3_64(head_view[:_CHECKSUM_OFFSET])
    hasher.update(_ZERO_CHECKSUM)
    hasher.update(head_view[HEADER_BYTES:])
    return hasher


def decode_into(blob: Buffer, key: bytes, out: Buffer | Sequence[Buffer]) -> int:
    """Verifies ``blob`` and writes its raw bytes into ``out``: one buffer,
    or a list or tuple of buffers filled one after another (a scatter list:
    the raw bytes need not lie in one place, e.g. one KV slab per layer).

    Returns:
        The number of raw bytes written.

    Raises:
        CorruptBlockError: on any mismatch (``out`` may be partly written).
        ValueError: ``out`` is too small.
    """
    head, body = split(blob)
    return decode_parts_into(head, body, key, out)


def decode_parts_into(head: Buffer, body: Buffer, key: bytes, out: Buffer | Sequence[Buffer]) -> int:
    """:func:`decode_into` for a head and body kept apart (a raw body is verified as copied: :mod:`ucm_db.checked_copy`)."""
    header = read_head(head, len(body))
    if header.codec == "none" and header.key == key and all_raw(head, header, len(body)):
        return checked_copy.copy_verified(head_hasher(head), body, out, header.checksum)
    header = verify_parts(head, body, key)
    if isinstance(out, (list, tuple)):
        return _decode_scattered(head, body, header, out)
    return _decode_verified(head, body, header, cast(Buffer, out))  # not a list or tuple: one buffer


def _decode_scattered(head: Buffer, body: Buffer, header: Header, outs: Sequence[Buffer]) -> int:
    """Decodes a verified block across ``outs`` in order, via this thread's (hot) scratch buffer."""
    source = _scratch(header.raw_len)
    _decode_verified(head, body, header, source)
    return checked_copy.copy_out(source, list(outs))  # one C call however many pieces


_scratch_local = threading.local()
#: Largest scratch buffer a thread keeps between calls (a larger block gets one of its own).
_SCRATCH_KEEP_BYTES = 16 << 20


def _scratch(size: int) -> memoryview:
    """A view of ``size`` bytes of this thread's reusable scratch buffer
    (valid until this thread's next call)."""
    if size > _SCRATCH_KEEP_BYTES:
        return memoryview(bytearray(size))
    buffer = getattr(_scratch_local, "buffer", None)
    if buffer is None or len(buffer) < size:
        buffer = _scratch_local.buffer = bytearray(size)
    return memoryview(buffer)[:size]


def _decode_verified(head: Buffer, body: Buffer, header: Header, out: Buffer) -> int:
    """Decodes a block whose header and checksum :func:`verify_parts` accepted."""
    out_view = memoryview(out).cast("B")
    if len(out_view) < header.raw_len:
        raise ConfigError(
            f"output buffer of {len(out_view)} bytes is smaller than the block's {header.raw_len}",
            hint="pass get_into buffers at least as large as the stored blocks",
        )
    body_view = memoryview(body)
    if header.codec == "none" and all_raw(head, header, len(body_view)):
        out_view[: header.raw_len] = body_view  # the frames back to back: one copy, not one per frame
        return header.raw_len
    table_at = HEADER_BYTES
    body_at = 0
    raw_at = 0
    for _ in range(header.n_frames):
        raw_len, stored_len, mode, elem, mask = _FRAME.unpack_from(head, table_at)
        table_at += _FRAME.size
        if raw_at + raw_len > header.raw_len or body_at + stored_len > len(body_view):
            raise CorruptBlockError("frame table exceeds the block")
        _decode_frame(body_view[body_at : body_at + stored_len], out_view[raw_at : raw_at + raw_len], mode, elem, mask)
        raw_at += raw_len
        body_at += stored_len
    if raw_at != header.raw_len:
        raise CorruptBlockError("frames do not add up to the raw length")
    return raw_at


def all_raw(head: Buffer, header: Header, body_bytes: int) -> bool:
    """Whether every frame of a checked head is stored raw, as long as it
    is raw, and the frames fill the block exactly: then the body is the raw
    bytes themselves (what codec ``none`` writes). Tables found raw are
    remembered with their total (a store's units share a few tables)."""
    if header.raw_len != body_bytes:
        return False
    table = bytes(memoryview(head)[HEADER_BYTES:])
    total = _RAW_TABLES.get(table)
    if total is None:
        frames = list(_FRAME.iter_unpack(table))
        if any(f[2] != MODE_RAW or f[0] != f[1] for f in frames):  # (raw_len, stored_len, mode, ...)
            return False
        if len(_RAW_TABLES) >= 1024:
            _RAW_TABLES.clear()  # bounded whatever the input
        total = _RAW_TABLES[table] = sum(f[0] for f in frames)
    return total == body_bytes


def decode(blob: Buffer, key: bytes) -> bytearray:
    """Verifies ``blob`` and returns its raw bytes."""
    head, body = split(blob)
    return decode_parts(head, body, key)


def decode_parts(head: Buffer, body: Buffer, key: bytes) -> bytearray:
    """:func:`decode` for a head and body kept apart."""
    # Checksum first: a corrupt raw_len must not size an allocation (a
    # flipped high bit would otherwise allocate up to MAX_RAW_BYTES).
    header = verify_parts(head, body, key)
    out = bytearray(header.raw_len)
    _decode_verified(head, body, header, out)
    return out


def readable(head: Buffer, body: Buffer, key: bytes) -> bool:
    """Whether a block passes every check a read makes: header bounds,
    owning key, checksum and the decode of each frame. A block whose
    checksum holds but whose frames do not decode is as unreadable as a
    damaged one (a quarantine re-checks with this, not with
    :func:`verify_parts`)."""
    try:
        decode_parts(head, body, key)
    except CorruptBlockError:
        return False
    return True


def codec_of_head(head: Buffer) -> str | None:
    """The codec named by a head (unverified), or None if unreadable."""
    if len(head) <= _CODEC_ID_OFFSET:
        return None
    return _CODEC_NAMES.get(head[_CODEC_ID_OFFSET])


def mean_frame_bytes_of_head(head: Buffer) -> int:
    """Raw bytes per frame on average, as a head states them (unverified;
    0 if unreadable): what the codec pool sizes its work by."""
    if len(head) < HEADER_BYTES:
        return 0
    n_frames = struct.unpack_from("<I", head, _N_FRAMES_OFFSET)[0]
    raw_len = struct.unpack_from("<Q", head, _N_FRAMES_OFFSET + 4)[0]
    return raw_len // n_frames if n_frames else 0


def frame_sizes(blob: Buffer) -> list[int]:
    """Raw sizes of the blob's frames (header-checked, not checksummed)."""
    header = read_header(blob)
    return [_FRAME.unpack_from(blob, HEADER_BYTES + i * _FRAME.size)[0] for i in range(header.n_frames)]


def _decode_frame(stored: memoryview, out: memoryview, mode: int, elem: int, mask: int) -> None:
    if mode == MODE_RAW:
        if len(stored) != len(out):
            raise CorruptBlockError("raw frame length mismatch")
        out[:] = stored
    elif mode == MODE_ZSTD:
        out[:] = _zstd_exact(stored, len(out))
    elif mode == MODE_SHUFFLE:
        if elem not in (2, 4) or len(out) % elem or len(stored) < 4 * elem:
            raise CorruptBlockError("bad shuffle frame")
        lengths = struct.unpack_from(f"<{elem}I", stored, 0)
        plane_len = len(out) // elem
        at = 4 * elem
        planes: list[Buffer] = []
        for i, length in enumerate(lengths):
            part = stored[at : at + length]
            if len(part) != length:
                raise CorruptBlockError("shuffle plane exceeds the frame")
            at += length
            if mask >> i & 1:
                planes.append(_zstd_exact(part, plane_len))
            elif length == plane_len:
                planes.append(part)
            else:
                raise CorruptBlockError("raw plane length mismatch")
        if at != len(stored):
            raise CorruptBlockError("shuffle frame has trailing bytes")
        _unshuffle(planes, out, elem)
    else:
        raise CorruptBlockError(f"unknown frame mode {mode}")


def _zstd_exact(data: memoryview, size: int) -> bytes:
    try:
        # zstandard allocates a frame's own content size and then ignores
        # max_output_size: refuse any claim other than the table's first.
        claimed = zstandard.frame_content_size(data)
        if claimed not in (-1, size):
            raise CorruptBlockError(f"zstd frame claims {claimed} bytes where the block table says {size}")
        result = _decompressor().decompress(data, max_output_size=size)
    except zstandard.ZstdError as exc:
        raise CorruptBlockError(f"zstd: {exc}") from exc
    if len(result) != size:
        raise CorruptBlockError("decompressed size mismatch")
    return result


def transcode(blob: Buffer, key: bytes, *, codec: str, element_bytes: int, level: int = 1) -> Buffer:
    """``blob`` re-encoded with ``codec`` (frames kept apart), or ``blob``
    itself when it already uses it. The block is verified first: a corrupt
    one raises :class:`CorruptBlockError` and is never re-sealed as whole.

    Raises:
        CorruptBlockError: ``blob`` fails verification against ``key``.
    """
    if codec_of_head(blob) == codec:
        return blob
    raw = memoryview(decode(blob, key))
    frames: list[memoryview] = []
    offset = 0
    for size in frame_sizes(blob):
        frames.append(raw[offset : offset + size])
        offset += size
    return encode_parts(key, frames, codec=codec, element_bytes=element_bytes, level=level).blob()
