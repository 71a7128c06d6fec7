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

This module is the codec's one door: the wire format and its checks live in
:mod:`ucm_db.codec.header`, encoding in :mod:`ucm_db.codec.encoding`,
decoding and transcoding in :mod:`ucm_db.codec.decoding`; callers import
``ucm_db.codec``.
"""

from __future__ import annotations

from ucm_db.codec.decoding import (  # noqa: F401 - the codec's API
    check_frames, decode, decode_into, decode_parts, decode_parts_into, readable, transcode, verify_sound,
)
from ucm_db.codec.encoding import (  # noqa: F401 - the codec's API
    ZSTD_GROUP_BYTES, EncodedBlock, Framed, buffer_view, encode, encode_parts,
)
from ucm_db.codec.header import (  # noqa: F401 - the codec's API
    CODEC_FORMAT_VERSION, CODEC_IDS, HEADER_BYTES, MAGIC, MAX_FRAMES, MAX_RAW_BYTES, MODE_RAW, MODE_SHUFFLE, MODE_ZSTD, Buffer,
    Header, all_raw, codec_of_head, element_bytes_for, frame_sizes, head_bytes, head_hasher, mean_frame_bytes_of_head,
    raw_len_of_head, read_head, read_header, split, verify, verify_parts,
)
from ucm_db.errors import ConfigError, CorruptBlockError  # noqa: F401 - the errors the codec raises
