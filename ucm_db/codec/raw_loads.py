"""A batch's raw and shuffled blocks put into the caller's buffers with little Python per block.

``Store.get_into`` hands a read transaction's blocks here first. A block
whose head says codec ``none``, owned by the key asked for, with a frame
table already known to be all raw (:func:`ucm_db.codec.all_raw` remembers
them) is verified while it is copied (:func:`ucm_db.codec.checked_copy.copy_verified`)
straight from one ``struct`` unpack of its header: no :class:`~ucm_db.codec.Header`,
no per-block function chain. A zstd block whose frames are all byte-shuffled
and small enough to decode on the caller's thread (a connector unit: one
frame of grouped layers) is verified, then each frame's planes are merged
straight into the buffers, the same way. Anything else (a frame of another
mode, a block for the codec threads, a table not seen yet, a head that fails
any check, buffers not cut at elements) is left to
:func:`ucm_db.codec.decode_parts_into`, which decides it as before.

Invariants:
    * The fast path takes only heads that ``decode_parts_into`` would take
      on its raw branch or its shuffled scatter branch (the same checks as
      ``codec.read_head`` plus the codec, the owning key and a table that
      fills the body), and computes the same XXH3-64 over the same bytes: a
      block reads alike on either path, and a corrupt one is a miss on both.
    * A block the fast path does not take is handed back untouched, or, if
      its buffers refused the merge part way, with those buffers to be
      written again whole by the codec's path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import xxhash

from ucm_db.codec import checked_copy, native
from ucm_db import codec
from ucm_db.codec.decoding import Frame, frame_table, merge_shuffled
from ucm_db.codec.header import (
    CHECKSUM_OFFSET, FRAME_STRUCT, HEADER_STRUCT, MODE_SHUFFLE, RAW_TABLES, ZERO_CHECKSUM, head_hasher,
)
from ucm_db.errors import CorruptBlockError
from ucm_db.codec.slabs import ScatterSlabs

# The codec's own header layout and its cache of all-raw frame tables
# (this module is the codec's raw read path, kept apart for size), bound
# once: the fast path runs once per block of every load.
_HEADER = HEADER_STRUCT
_HEADER_BYTES = codec.HEADER_BYTES
_CHECKSUM_OFFSET = CHECKSUM_OFFSET
_ZERO_CHECKSUM = ZERO_CHECKSUM
_FRAME_BYTES = FRAME_STRUCT.size
_RAW_TABLES = RAW_TABLES
_NONE_ID, _ZSTD_ID = codec.CODEC_IDS["none"], codec.CODEC_IDS["zstd"]
_MAGIC, _VERSION = codec.MAGIC, codec.CODEC_FORMAT_VERSION
_MAX_FRAMES, _MAX_RAW_BYTES = codec.MAX_FRAMES, codec.MAX_RAW_BYTES


def _owned(head: Any, body_bytes: int, key: bytes) -> tuple[int, int, int, int] | None:
    """(codec id, frames, raw bytes, stored checksum) of a head that
    ``codec.read_head`` accepts for a body of ``body_bytes`` and that ``key``
    owns, else None."""
    head_bytes = len(head)
    if head_bytes <= _HEADER_BYTES:
        return None
    magic, version, stored_codec, _flags, n_frames, raw_len, body_len, owner, checksum = _HEADER.unpack_from(head, 0)
    if (magic != _MAGIC or version != _VERSION or owner != key or body_len != body_bytes
            or n_frames > _MAX_FRAMES or raw_len > _MAX_RAW_BYTES or _HEADER_BYTES + n_frames * _FRAME_BYTES != head_bytes):
        return None
    return stored_codec, n_frames, raw_len, checksum


def _owned_head(head: Any, body_bytes: int, key: bytes, codec_id: int) -> tuple[int, int, int] | None:
    """(frames, raw bytes, stored checksum) of an owned head (:func:`_owned`)
    of codec ``codec_id``, else None."""
    owned = _owned(head, body_bytes, key)
    return owned[1:] if owned is not None and owned[0] == codec_id else None


def _raw_table_known(head: Any, body_bytes: int) -> bytes | None:
    """The frame table of an owned codec-``none`` head if it is one known to
    be all raw over ``body_bytes`` (the body is then the raw bytes), else None."""
    table = bytes(head[_HEADER_BYTES:])
    return table if _RAW_TABLES.get(table) == body_bytes else None


def _checked(head: Any, body_bytes: int, key: bytes) -> tuple[int, bytes] | None:
    """(stored checksum, frame table) of a head the fast path takes (see
    the module invariants), else None."""
    owned = _owned_head(head, body_bytes, key, _NONE_ID)
    if owned is None or owned[1] != body_bytes:
        return None
    table = _raw_table_known(head, body_bytes)
    return None if table is None else (owned[2], table)


def _checked_shuffled(head: Any, body_bytes: int, key: bytes, below_frame_bytes: int | None) -> tuple[int, list[Frame]] | None:
    """(stored checksum, frames) of a zstd head the fast path takes (see the
    module invariants; frames of fewer than ``below_frame_bytes`` raw bytes
    on average, if given), else None."""
    owned = _owned_head(head, body_bytes, key, _ZSTD_ID)
    if owned is None:
        return None
    n_frames, raw_len, checksum = owned
    if n_frames == 0 or (below_frame_bytes is not None and raw_len // n_frames >= below_frame_bytes):
        return None
    try:
        frames = frame_table(head, raw_len, body_bytes)
    except CorruptBlockError:
        return None  # the codec's path reports it
    return (checksum, frames) if all(frame[4] == MODE_SHUFFLE for frame in frames) else None


def raw_checksum(head: Any, body_bytes: int, key: bytes) -> int | None:
    """The stored checksum of a head the fast path takes (see the module
    invariants), else None."""
    checked = _checked(head, body_bytes, key)
    return None if checked is None else checked[0]


def batch_checksum(head: Any, body_bytes: int, key: bytes, below_frame_bytes: int | None) -> tuple[bool, int] | None:
    """``(shuffled, stored checksum)`` of a head whose block a native batch
    may load (:mod:`ucm_db.codec.batch_loads`), from one header unpack: a raw head
    the fast path takes (False), or an owned zstd head of frames averaging
    fewer than ``below_frame_bytes`` raw bytes, if given (True; its frame
    table and modes are checked where it is decoded, and a block that fails
    them goes back to this module's path); else None."""
    owned = _owned(head, body_bytes, key)
    if owned is None:
        return None
    codec_id, n_frames, raw_len, checksum = owned
    if codec_id == _NONE_ID:
        return (False, checksum) if raw_len == body_bytes and _raw_table_known(head, body_bytes) is not None else None
    if codec_id != _ZSTD_ID or n_frames == 0 or (below_frame_bytes is not None and raw_len // n_frames >= below_frame_bytes):
        return None
    return True, checksum


def raw_taker(
    keys: Sequence[bytes], buffers: Sequence[Any], corrupt: list[tuple[bytes, str]], *, shuffled: bool = False,
    below_frame_bytes: int | None = None,
) -> tuple[Callable[[int, memoryview, memoryview], bool], list[bool | None]]:
    """``(take, results)``: ``take(i, head, body)`` copies block ``i`` into
    ``buffers[i]``, verified, if the fast path takes it, and returns whether
    it did; ``results[i]`` is then True (loaded) or False (corrupt: its key
    and reason appended to ``corrupt``), None for a block not taken. Called
    inside the read transaction as each block is read, so a batch keeps no
    views of the blocks it took (``Store.get_into``). ``buffers`` may be a
    :class:`~ucm_db.codec.slabs.ScatterSlabs`: one native call per block.

    The checksum is ``codec.head_hasher``'s (xxh3-64 over the head up to its
    checksum field, eight zero bytes, the frame table, then the body),
    computed here in line: this runs once per block of every load. With
    ``shuffled``, zstd blocks of shuffled frames are taken too (those whose
    frames average fewer than ``below_frame_bytes`` raw bytes, if given:
    larger ones go to the codec threads)."""
    results: list[bool | None] = [None] * len(keys)
    slabs = buffers if isinstance(buffers, ScatterSlabs) else None
    views, sizes, indices = (slabs.views, slabs.slab_bytes, slabs.indices) if slabs is not None else ((), (), [])
    copy_verified, copy_into_slabs, xxh3_64 = checked_copy.copy_verified, native.copy_into_slabs, xxhash.xxh3_64
    chunk_bytes = checked_copy.VERIFY_CHUNK_BYTES

    merge_planes_into, merge_planes_into_slabs = native.merge_planes_into, native.merge_planes_into_slabs

    def take_shuffled(i: int, head: memoryview, body: memoryview) -> bool:
        checked = _checked_shuffled(head, len(body), keys[i], below_frame_bytes)
        if checked is None:
            return False
        checksum, frames = checked
        hasher = head_hasher(head)
        hasher.update(body)
        try:
            if hasher.intdigest() != checksum:
                raise CorruptBlockError("checksum mismatch")
            if slabs is None:
                outs = buffers[i]
                merge_shuffled(body, frames, lambda planes, elem, raw_at: merge_planes_into(planes, outs, elem, raw_at))
            else:
                at = indices[i]
                merge_shuffled(body, frames, lambda planes, elem, raw_at: merge_planes_into_slabs(planes, views, sizes, at, elem, raw_at))
            results[i] = True
        except CorruptBlockError as exc:
            corrupt.append((keys[i], str(exc)))
            results[i] = False
        except ValueError:
            return False  # buffers too small or not cut at elements: the codec's path decides
        return True

    def take(i: int, head: memoryview, body: memoryview) -> bool:
        checked = _checked(head, len(body), keys[i])
        if checked is None:
            return shuffled and take_shuffled(i, head, body)
        checksum, table = checked
        hasher = xxh3_64(head[:_CHECKSUM_OFFSET])
        hasher.update(_ZERO_CHECKSUM)
        hasher.update(table)
        try:
            if slabs is None:
                copy_verified(hasher, body, buffers[i], checksum)
            else:
                try:
                    copy_into_slabs(body, views, sizes, indices[i], hasher, chunk_bytes)
                except ValueError as exc:
                    raise checked_copy.slabs_error(body, exc) from exc
                if hasher.intdigest() != checksum:
                    raise CorruptBlockError("checksum mismatch")
            results[i] = True
        except CorruptBlockError as exc:
            corrupt.append((keys[i], str(exc)))
            results[i] = False
        return True

    return take, results


def copy_raw_blocks(
    blocks: list[tuple[memoryview, memoryview] | None], keys: Sequence[bytes], buffers: Sequence[Any],
    corrupt: list[tuple[bytes, str]],
) -> list[bool | None]:
    """:func:`raw_taker` over a list of blocks read already: returns the
    results; taken blocks are set to None in ``blocks``, the others are
    left for the codec."""
    take, results = raw_taker(keys, buffers, corrupt)
    for i, block in enumerate(blocks):
        if block is not None and take(i, block[0], block[1]):
            blocks[i] = None
    return results
