"""A batch's raw blocks copied into the caller's buffers with little Python per block.

``Store.get_into`` hands a read transaction's blocks here first. A block
whose head says codec ``none``, owned by the key asked for, with a frame
table already known to be all raw (:func:`ucm_db.codec.all_raw` remembers
them) is verified while it is copied (:func:`ucm_db.checked_copy.copy_verified`)
straight from one ``struct`` unpack of its header: no :class:`~ucm_db.codec.Header`,
no per-block function chain. Anything else (a compressed block, a table
not seen yet, a head that fails any check) is left to
:func:`ucm_db.codec.decode_parts_into`, which decides it as before.

Invariants:
    * The fast path takes only heads that ``decode_parts_into`` would take
      on its raw branch (the same checks as ``codec.read_head`` plus codec
      ``none``, the owning key and an all-raw table filling the body), and
      computes the same XXH3-64 over the same bytes: a block reads alike on
      either path, and a corrupt one is a miss on both.
    * A block the fast path does not take is handed back untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ucm_db import checked_copy, codec
from ucm_db.codec_format import FRAME_STRUCT, HEADER_STRUCT, RAW_TABLES
from ucm_db.errors import CorruptBlockError
from ucm_db.slabs import ScatterSlabs

# The codec's own header layout and its cache of all-raw frame tables
# (this module is the codec's raw read path, kept apart for size).
_HEADER = HEADER_STRUCT
_FRAME_BYTES = FRAME_STRUCT.size
_RAW_TABLES = RAW_TABLES
_NONE_ID = codec.CODEC_IDS["none"]


def raw_checksum(head: Any, body_bytes: int, key: bytes) -> int | None:
    """The stored checksum of a head the fast path takes (see the module
    invariants), else None."""
    head_bytes = len(head)
    if head_bytes <= codec.HEADER_BYTES:
        return None
    magic, version, codec_id, _flags, n_frames, raw_len, body_len, owner, checksum = _HEADER.unpack_from(head, 0)
    if (magic != codec.MAGIC or version != codec.CODEC_FORMAT_VERSION or codec_id != _NONE_ID or owner != key
            or raw_len != body_bytes or body_len != body_bytes or n_frames > codec.MAX_FRAMES or raw_len > codec.MAX_RAW_BYTES
            or codec.HEADER_BYTES + n_frames * _FRAME_BYTES != head_bytes):
        return None
    total = _RAW_TABLES.get(bytes(head[codec.HEADER_BYTES:]))
    return checksum if total == body_bytes else None


def raw_taker(
    keys: Sequence[bytes], buffers: Sequence[Any], corrupt: list[tuple[bytes, str]],
) -> tuple[Callable[[int, memoryview, memoryview], bool], list[bool | None]]:
    """``(take, results)``: ``take(i, head, body)`` copies block ``i`` into
    ``buffers[i]``, verified, if the fast path takes it, and returns whether
    it did; ``results[i]`` is then True (loaded) or False (corrupt: its key
    and reason appended to ``corrupt``), None for a block not taken. Called
    inside the read transaction as each block is read, so a batch keeps no
    views of the blocks it took (``Store.get_into``). ``buffers`` may be a
    :class:`~ucm_db.slabs.ScatterSlabs`: one native call per block."""
    results: list[bool | None] = [None] * len(keys)
    head_hasher = codec.head_hasher
    slabs = buffers if isinstance(buffers, ScatterSlabs) else None
    copy_verified, to_slabs = checked_copy.copy_verified, checked_copy.copy_verified_to_slabs

    def take(i: int, head: memoryview, body: memoryview) -> bool:
        checksum = raw_checksum(head, len(body), keys[i])
        if checksum is None:
            return False
        try:
            if slabs is not None:
                to_slabs(head_hasher(head), body, slabs, i, checksum)
            else:
                copy_verified(head_hasher(head), body, buffers[i], checksum)
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
