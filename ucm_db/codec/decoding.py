"""Decoding a block (:mod:`ucm_db.codec`): verify, then write its raw bytes
into a new buffer, a caller's buffer or a scatter list; and transcoding.

Invariants:
    * A block is verified (header bounds, owning key, checksum) before its
      bytes are reported decoded; a raw body is verified as it is copied
      (:mod:`ucm_db.codec.checked_copy`).
    * A zstd frame never decompresses to more than the frame table says
      (no decompression bombs). A whole frame decompresses straight into
      its place (past :data:`_COPIED_FRAME_BYTES`: never into an object of
      its size that is then copied, so a block costs its raw size once); a
      plane is merged straight from the object zstandard returns.
    * A zstd frame or plane is exactly one zstd frame: its compressed size
      (as ``ZSTD_findFrameCompressedSize`` walks it) is the whole stored
      length, and its content size, where it states one, and its output are
      exactly what the table says. The native batch load
      (``_native_loads.c``) holds the same rule, so both paths load the
      same blocks. Any mismatch is a :class:`~ucm_db.errors.CorruptBlockError`.
    * A scatter list too small for a block larger than a thread's kept
      scratch is refused before anything of the block's size is allocated.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable, Sequence
from typing import cast

import zstandard

from ucm_db.codec import checked_copy, native
from ucm_db.codec.encoding import encode_parts
from ucm_db.codec.header import (
    FRAME_STRUCT, HEADER_BYTES, MODE_RAW, MODE_SHUFFLE, MODE_ZSTD, Buffer, Header, all_raw, codec_of_head, frame_sizes,
    head_hasher, read_head, split, verify_parts, verify_read_head,
)
from ucm_db.errors import ConfigError, CorruptBlockError

_local = threading.local()


def _decompressor() -> zstandard.ZstdDecompressor:
    dctx = getattr(_local, "dctx", None)
    if dctx is None:
        dctx = _local.dctx = zstandard.ZstdDecompressor()
    return dctx


def _unshuffle(planes: list[Buffer], out: memoryview, element_bytes: int) -> None:
    """Interleaves byte planes back into elements, straight into ``out``."""
    try:
        native.merge_planes(planes, out, element_bytes)
    except ValueError as exc:
        raise CorruptBlockError(f"byte planes do not fit the frame: {exc}") from exc


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
    """:func:`decode_into` for a head and body kept apart (a raw body is verified as copied: :mod:`ucm_db.codec.checked_copy`)."""
    header = read_head(head, len(body))
    if header.codec == "none" and header.key == key and all_raw(head, header, len(body)):
        return checked_copy.copy_verified(head_hasher(head), body, out, header.checksum)
    verify_read_head(head, body, key, header)
    if isinstance(out, (list, tuple)):
        return _decode_scattered(head, body, header, out)
    return _decode_verified(head, body, header, cast(Buffer, out))  # not a list or tuple: one buffer


def _decode_scattered(head: Buffer, body: Buffer, header: Header, outs: Sequence[Buffer]) -> int:
    """Decodes a verified block across ``outs`` in order: a block of
    shuffled frames merges each frame straight into its place among
    ``outs`` (no staging copy); any other block, or outs whose pieces end
    inside an element, goes through this thread's (hot) scratch buffer."""
    if header.raw_len > _SCRATCH_KEEP_BYTES:  # the scratch (or a frame's planes) would be allocated for it
        _require_room(outs, header.raw_len)
    frames = frame_table(head, header.raw_len, len(body))
    if all(frame[4] == MODE_SHUFFLE for frame in frames):
        try:
            merge_shuffled(memoryview(body), frames, lambda planes, elem, raw_at: native.merge_planes_into(planes, outs, elem, raw_at))
            return header.raw_len
        except ValueError:
            pass  # outs too small (the scratch path names it) or not cut at elements
    source = _scratch(header.raw_len)
    _decode_verified(head, body, header, source)
    return checked_copy.copy_out(source, list(outs))  # one C call however many pieces


def _require_room(outs: Sequence[Buffer], raw_len: int) -> None:
    """A :class:`ConfigError` unless ``outs`` hold at least ``raw_len`` bytes."""
    room = sum(memoryview(out).nbytes for out in outs)
    if room < raw_len:
        raise ConfigError(
            f"output buffers of {room} bytes are smaller than the block's {raw_len}",
            hint="pass get_into buffers at least as large as the stored blocks",
        )


#: A frame of a block's table: (raw_at, raw_len, body_at, stored_len, mode, element_bytes, mask).
Frame = tuple[int, int, int, int, int, int, int]


def frame_table(head: Buffer, raw_len: int, body_bytes: int) -> list[Frame]:
    """The frames of a checked head (its block ``raw_len`` raw bytes, its
    body ``body_bytes``), each inside the block; raises
    :class:`CorruptBlockError` if they overrun it or do not fill it."""
    frames: list[Frame] = []
    body_at = raw_at = 0
    for frame_raw, stored_len, mode, elem, mask in FRAME_STRUCT.iter_unpack(memoryview(head)[HEADER_BYTES:]):
        if raw_at + frame_raw > raw_len or body_at + stored_len > body_bytes:
            raise CorruptBlockError("frame table exceeds the block")
        frames.append((raw_at, frame_raw, body_at, stored_len, mode, elem, mask))
        raw_at += frame_raw
        body_at += stored_len
    if raw_at != raw_len:
        raise CorruptBlockError("frames do not add up to the raw length")
    return frames


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
    for raw_at, raw_len, body_at, stored_len, mode, elem, mask in frame_table(head, header.raw_len, len(body_view)):
        _decode_frame(body_view[body_at : body_at + stored_len], out_view[raw_at : raw_at + raw_len], mode, elem, mask)
    return header.raw_len


def decode(blob: Buffer, key: bytes) -> bytearray:
    """Verifies ``blob`` and returns its raw bytes."""
    head, body = split(blob)
    return decode_parts(head, body, key)


def decode_parts(head: Buffer, body: Buffer, key: bytes) -> bytearray:
    """:func:`decode` for a head and body kept apart."""
    # Checksum first: a corrupt raw_len must not size an allocation (a
    # flipped high bit would otherwise allocate up to MAX_RAW_BYTES); and a
    # large one only once the frames are found to fill it (a blob resealed
    # with a checksum of its own, as put_encoded takes them, may claim 4 GiB).
    header = verify_parts(head, body, key)
    if header.raw_len > _SCRATCH_KEEP_BYTES:
        check_frames(head, body, header.raw_len)
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


def _decode_frame(stored: memoryview, out: memoryview, mode: int, elem: int, mask: int) -> None:
    if mode == MODE_RAW:
        if len(stored) != len(out):
            raise CorruptBlockError("raw frame length mismatch")
        out[:] = stored
    elif mode == MODE_ZSTD:
        if len(out) <= _COPIED_FRAME_BYTES:
            out[:] = _zstd_bytes(stored, len(out))
        else:
            _zstd_into(stored, out)
    elif mode == MODE_SHUFFLE:
        _unshuffle(shuffled_planes(stored, len(out), elem, mask), out, elem)
    else:
        raise CorruptBlockError(f"unknown frame mode {mode}")


def shuffled_planes(stored: memoryview, raw_len: int, elem: int, mask: int) -> list[Buffer]:
    """The byte planes of a shuffled frame of ``raw_len`` raw bytes (those
    whose ``mask`` bit is set decompressed, the others views of ``stored``)."""
    plane_len = raw_len // elem if elem else 0
    return [_zstd_bytes(part, plane_len) if packed else part for part, packed in _plane_parts(stored, raw_len, elem, mask)]


def _plane_parts(stored: memoryview, raw_len: int, elem: int, mask: int) -> list[tuple[memoryview, bool]]:
    """A shuffled frame's planes as stored, each with whether it is
    compressed; a stored plane is checked to be a plane's length."""
    if elem not in (2, 4) or raw_len % elem or len(stored) < 4 * elem:
        raise CorruptBlockError("bad shuffle frame")
    lengths = struct.unpack_from(f"<{elem}I", stored, 0)
    plane_len = raw_len // elem
    at = 4 * elem
    parts = []
    for i, length in enumerate(lengths):
        part = stored[at : at + length]
        if len(part) != length:
            raise CorruptBlockError("shuffle plane exceeds the frame")
        at += length
        packed = bool(mask >> i & 1)
        if not packed and length != plane_len:
            raise CorruptBlockError("raw plane length mismatch")
        parts.append((part, packed))
    if at != len(stored):
        raise CorruptBlockError("shuffle frame has trailing bytes")
    return parts


def check_frames(head: Buffer, body: Buffer, raw_len: int) -> None:
    """Every check of a block's layout a decode makes, short of
    decompressing: its frames fill its ``raw_len`` bytes inside its body, a
    raw frame (or plane) stores its raw length, and each zstd frame (or
    plane) claims the size the table gives it (zstandard sizes its
    allocation by that claim). Raises :class:`CorruptBlockError`. So a
    block claiming more bytes than its frames hold is refused before
    anything its header states is allocated."""
    body_view = memoryview(body)
    for _raw_at, frame_raw, body_at, stored_len, mode, elem, mask in frame_table(head, raw_len, len(body_view)):
        stored = body_view[body_at : body_at + stored_len]
        if mode == MODE_RAW:
            if stored_len != frame_raw:
                raise CorruptBlockError("raw frame length mismatch")
        elif mode == MODE_ZSTD:
            _check_claim(stored, frame_raw)
        elif mode == MODE_SHUFFLE:
            for part, packed in _plane_parts(stored, frame_raw, elem, mask):
                if packed:
                    _check_claim(part, frame_raw // elem)
        else:
            raise CorruptBlockError(f"unknown frame mode {mode}")


def verify_sound(blob: Buffer, key: bytes) -> Header:
    """:func:`~ucm_db.codec.header.verify` (bounds, owning key, checksum)
    and :func:`check_frames`: what a store takes an encoded blob from
    outside with (``put_encoded``, an archive's import), so that a blob
    resealed with a checksum of its own over frames that cannot decode is
    refused rather than stored."""
    head, body = split(blob)
    header = verify_parts(head, body, key)
    check_frames(head, body, header.raw_len)
    return header


def merge_shuffled(body: memoryview, frames: Sequence[Frame], merge: Callable[[list[Buffer], int, int], object]) -> None:
    """Hands each shuffled frame's planes to ``merge(planes, element_bytes,
    raw_at)``, which writes them ``raw_at`` bytes into the block's outs."""
    for raw_at, raw_len, body_at, stored_len, _mode, elem, mask in frames:
        merge(shuffled_planes(body[body_at : body_at + stored_len], raw_len, elem, mask), elem, raw_at)


_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
#: A whole zstd frame up to this size is decompressed by zstandard's one
#: call and copied into place; a larger one straight into place
#: (:func:`_zstd_into`). A stream reader costs about 1.5 us more per frame,
#: more than the copy below this size (16 KiB: 8.8 against 10.4 us; 64 KiB:
#: 30.4 against 31.7 us; 256 KiB: 121 against 120 us; 4 MiB: 2.18 against
#: 1.97 ms, CPU time on a loaded 2-core AVX2 host), and the copy's memory is
#: bounded by it: what a block costs stays its raw size, plus this.
_COPIED_FRAME_BYTES = 128 << 10
_ZSTD_BLOCK_RLE, _ZSTD_BLOCK_RESERVED = 1, 3
_ZSTD_CHECKSUM_FLAG = 4


def zstd_frame_bytes(data: memoryview) -> int:
    """The compressed size of the zstd frame ``data`` starts with, walked as
    ``ZSTD_findFrameCompressedSize`` walks it (header, blocks, checksum);
    -1 if ``data`` starts with no zstd frame (a skippable frame is none) or
    ends inside its header or blocks. A frame of ``len(data)`` bytes is
    what the codec stores; anything after it is not."""
    if len(data) < 5 or bytes(data[:4]) != _ZSTD_MAGIC:
        return -1
    try:
        at = zstandard.frame_header_size(data)
    except zstandard.ZstdError:
        return -1
    while at + 3 <= len(data):
        block = int.from_bytes(data[at : at + 3], "little")  # last-block bit, 2 bits type, 21 bits size
        kind = block >> 1 & 3
        if kind == _ZSTD_BLOCK_RESERVED:
            return -1
        at += 3 + (1 if kind == _ZSTD_BLOCK_RLE else block >> 3)
        if block & 1:
            at += 4 if data[4] & _ZSTD_CHECKSUM_FLAG else 0
            return at if at <= len(data) else -1
    return -1


def _check_claim(data: memoryview, size: int) -> None:
    """Refuses ``data`` that starts with no zstd frame (a skippable frame is
    none), or whose frame claims a content size other than ``size``:
    zstandard would allocate what a frame claims, whatever it is told."""
    try:
        claimed = zstandard.frame_content_size(data)  # 0 for a skippable frame: its magic is checked then only
    except zstandard.ZstdError as exc:  # not a frame's start at all
        raise CorruptBlockError(f"zstd frame unreadable: {exc}") from exc
    if claimed not in (-1, size) or (claimed == 0 and bytes(data[:4]) != _ZSTD_MAGIC):
        raise CorruptBlockError(f"zstd frame claims {claimed} bytes where the block table says {size}")


def _zstd_bytes(data: memoryview, size: int) -> bytes:
    """The ``size`` bytes of a compressed plane (merged straight from the
    object zstandard returns), or of a small whole frame. zstandard checks
    that ``data`` is exactly one frame (``allow_extra_data=False``: an empty
    or skippable frame after it, or a second frame, is an error)."""
    try:
        _check_claim(data, size)
        plane = _decompressor().decompress(data, max_output_size=size, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise CorruptBlockError(f"zstd: {exc}") from exc
    if len(plane) != size:
        raise CorruptBlockError("decompressed size mismatch")
    return plane


def _zstd_into(data: memoryview, out: memoryview) -> None:
    """Decompresses ``data`` straight into ``out`` (a whole frame: no object
    of its size is made and copied): it must be exactly one zstd frame
    (:func:`zstd_frame_bytes` is its length) of ``len(out)`` bytes."""
    size = len(out)
    try:
        _check_claim(data, size)
        if zstd_frame_bytes(data) != len(data):
            raise CorruptBlockError("zstd data is not exactly one frame")
        reader = _decompressor().stream_reader(data, read_across_frames=False, closefd=False)
        try:
            got = 0
            while got < size:
                n = reader.readinto(out[got:])
                if not n:
                    break
                got += n
            # One more read runs the frame to its end (its checksum; a frame
            # stating no content size that would run past the table's size).
            exact = got == size and not reader.readinto(bytearray(1))
        finally:
            del reader  # it holds an export of data (a read transaction's view) until freed, even closed
        if not exact:
            raise CorruptBlockError("decompressed size mismatch")
    except zstandard.ZstdError as exc:
        raise CorruptBlockError(f"zstd: {exc}") from exc


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
